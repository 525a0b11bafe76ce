"""Whether sampling and training run at the same time (`schedule` in the server config).

On GPUs the sampler and the learner each have their own device, and sampling while the learner trains
is pure gain. On a CPU host they share the cores: vLLM's CPU worker computes on one core and its
scheduler process busy-polls another, the learner's threads want every core, and running both at once
made each train step 2-3x slower here than the same step alone (BENCHMARKS.md, "End to end"). There
they take turns instead: a train step waits until no sampler call runs, and sampler calls that arrive
while a train step waits or runs wait for it to end. Training goes first, so a busy sampler cannot
starve it; sampling cannot be starved either, because only rated groups (which sampling makes) give the
learner something to train.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import AsyncIterator, Literal

from grpo_server.gate import Gate

Schedule = Literal["auto", "overlap", "alternate"]
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the NVIDIA driver sees


def resolve_schedule(schedule: Schedule, remote_workers: bool) -> Literal["overlap", "alternate"]:
    """`auto`: alternate when the workers run on this machine and it has no NVIDIA GPU (they share its
    CPU cores), overlap otherwise."""
    if schedule != "auto":
        return schedule
    has_gpu = NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir())
    return "overlap" if remote_workers or has_gpu else "alternate"


class ComputeTurns:
    """Sampler calls share their turn; a train step has it alone and goes first (grpo_server/gate.py).
    With `alternate` False nothing waits; sampler calls are counted either way."""

    def __init__(self, alternate: bool):
        self.alternate = alternate
        self._gate = Gate()
        self._sampling = 0  # sampler calls running

    @property
    def sampling_calls(self) -> int:
        """Sampler calls running now (counted in both modes)."""
        return self._sampling

    @contextlib.asynccontextmanager
    async def sampling(self) -> AsyncIterator[None]:
        async with (self._gate.shared() if self.alternate else contextlib.nullcontext()):
            self._sampling += 1
            try:
                yield
            finally:
                self._sampling -= 1

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        async with (self._gate.exclusive() if self.alternate else contextlib.nullcontext()):
            yield
