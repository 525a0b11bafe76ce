"""Group-relative advantages, computed by the front end when a group's rewards arrive.

Pure Python on purpose: the front end and the client install have no numpy or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_server.protocol.worker_config import AlgorithmConfig


def _check_finite(rewards_G: Sequence[float]) -> list[float]:
    values = [float(r) for r in rewards_G]
    if not all(math.isfinite(v) for v in values):
        # One NaN would poison every advantage of the group, and then the adapter.
        raise ValueError(f"rewards must be finite numbers, got {list(rewards_G)}")
    return values


def group_advantages(rewards_G: Sequence[float], scale_by_std: bool, eps: float = 1e-4) -> list[float]:
    """reward - group mean; divided by (sample std (n-1 denominator, as TRL) + eps) when scale_by_std.

    A group of 1 gives [0.0]: with nothing to compare against there is no relative signal.
    """
    values = _check_finite(rewards_G)
    n = len(values)
    if n == 0:
        return []
    if n == 1:
        return [0.0]
    mean = math.fsum(values) / n
    centred = [v - mean for v in values]
    if not scale_by_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def is_zero_variance(rewards_G: Sequence[float], tol: float = 1e-9) -> bool:
    """True when all rewards are equal (within tol): every advantage is 0, the group teaches nothing."""
    values = _check_finite(rewards_G)
    if len(values) <= 1:
        return True
    return max(values) - min(values) <= tol


def scale_by_std_for(loss_type: str) -> bool:
    """Dr. GRPO drops the std division (it biases towards too-easy / too-hard prompts); others keep it."""
    return loss_type != "dr_grpo"


def rate(rewards_G: Sequence[float], algorithm: "AlgorithmConfig") -> tuple[str | None, list[float]]:
    """A rated group's (reason it is skipped, None if trained; advantages) under the experiment's algorithm."""
    skipped = "zero_variance" if algorithm.skip_zero_variance and is_zero_variance(rewards_G) else None
    return skipped, group_advantages(rewards_G, scale_by_std_for(algorithm.loss))
