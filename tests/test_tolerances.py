"""The bounds of tests/tolerances.py hold what they assume: the tiny model's float32 round-off is the size they
were set from, on this machine's kernels, and every bound stays far below what a wrong adapter gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import tolerances
from tests.tolerances import ROUNDOFF, WRONG_ADAPTER, Tolerance


def test_the_tiny_model_s_float32_round_off_is_what_the_bounds_assume(tiny_model_dir: Path) -> None:
    """float32 logprobs against float64 ones of the same weights: how far one float32 computation is from the
    exact function. Two float32 computations in different orders differ by at most twice that. A kernel library
    with coarser sums would show here first, by name, rather than as a sampler test failing by a hair."""
    import torch
    from transformers import AutoModelForCausalLM

    ids_B_T = torch.tensor([list(range(1000, 1040)), list(range(2000, 2040))])
    logprobs = {}
    for dtype in (torch.float32, torch.float64):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=dtype).eval()
        with torch.no_grad():
            logprobs[dtype] = torch.log_softmax(model(ids_B_T).logits.double(), dim=-1)
    envelope = float((logprobs[torch.float32] - logprobs[torch.float64]).abs().max())
    assert 0 < envelope <= ROUNDOFF, (envelope, ROUNDOFF)


@pytest.mark.parametrize("tol", [v for v in vars(tolerances).values() if isinstance(v, Tolerance)],
                         ids=lambda t: t.name)
def test_every_bound_is_far_below_a_wrong_adapter(tol: Tolerance) -> None:
    """A served wrong version (another adapter) moves logprobs by WRONG_ADAPTER or more, so it fails every
    comparison; and each bound says why it is what it is, and what was measured."""
    assert tol.bound <= WRONG_ADAPTER / 10, tol
    assert tol.why and "AVX2" in tol.measured, tol
