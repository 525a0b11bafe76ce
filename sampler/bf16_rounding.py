"""Stochastic rounding to bfloat16, where round to nearest would lose a small update: an adapter merged into
weights stored in bf16 (sampler/merged_weights.py), and a LoRA update added to a layer's bf16 output
(sampler/lora_cpu_ops.py). Both add a delta to values on the bf16 grid; under half a grid step round to nearest
gives them back unchanged, so early in training the served model moved only part of the way to a new version
(the push check's step fraction 0.01-0.14 for first versions through LoRA, 0.48-0.95 through merges:
docs/benchmarks/findings.md "bf16 sampling and the push check"). Rounded stochastically, every value is the
exact sum in expectation."""

from __future__ import annotations

import math
from typing import Any


class RoundingNoise:
    """Uniform integers in [0, 2**16), `size` of them drawn once (seeded: the same in every sampler); `take` gives
    a window of them at an offset drawn from the caller's generator. Within a window every weight has its own
    draw, and the windows of two versions are independent wherever their offsets differ, which is what unbiased
    rounding asks of its noise: it must not depend on the weights, and each version rounds afresh."""

    def __init__(self, size: int, seed: int = 0):
        import torch

        self.table = torch.randint(0, 1 << 16, (size,), dtype=torch.int32,
                                   generator=torch.Generator().manual_seed(seed))

    def take(self, shape: Any, generator: Any) -> Any:
        import torch

        count = math.prod(shape)
        if count > self.table.numel():
            raise ValueError(f"{count} weights, a rounding-noise table of {self.table.numel()}")
        offset = int(torch.randint(0, self.table.numel() - count + 1, (1,), generator=generator))
        return self.table[offset:offset + count].view(shape)


def stochastic_round_bf16(weight: Any, noise: Any) -> Any:
    """float32 -> bfloat16, rounded up with probability equal to the distance to the lower neighbour (in grid
    steps): unbiased per weight, where round to nearest is biased toward a grid point the weight sits next to. A
    float32 keeps bf16's 8 exponent and top 7 mantissa bits and adds 16 lower ones: add a uniform 16-bit integer
    (`noise`, an int32 tensor of the weight's shape: `RoundingNoise.take`) to the bits and truncate them (the carry
    is the rounding up; for a negative weight it raises the magnitude, as sign-magnitude wants). A weight already
    on the grid has no lower bits and stays exactly itself."""
    import torch

    bits = weight.contiguous().view(torch.int32) + noise
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)  # exact: the lower bits are 0
