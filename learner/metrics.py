"""Aggregate the loss function's per-micro-batch stats into one step's TrainMetrics.

`policy_loss` returns sums and extremes (not means) precisely so that they add up across micro-batches:
means are taken once here, over the whole batch, so they do not depend on how it was split.
"""

from __future__ import annotations

import math

import torch

from grpo_server.protocol.wire import TrainMetrics

_SUM_KEYS = ("token_count", "seq_count", "clipped_count", "ratio_sum", "ratio_sq_sum", "kl_sum", "gap_sum",
             "gap_tokens", "mismatch_kl_sum", "corrected_count", "mismatch_fresh_sum", "fresh_tokens",
             "offpolicy_stale_sum", "stale_tokens")


class StepStats:
    def __init__(self) -> None:
        self.loss = 0.0
        self.sums = dict.fromkeys(_SUM_KEYS, 0.0)
        self.ratio_min = math.inf
        self.ratio_max = -math.inf
        self.gap_max = 0.0

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        # Micro-batch losses are shares of the batch loss (BatchNormalizer), so they sum to it.
        self.loss += float(loss.detach())
        for key in _SUM_KEYS:
            self.sums[key] += float(stats[key])
        self.ratio_min = min(self.ratio_min, float(stats["ratio_min"]))
        self.ratio_max = max(self.ratio_max, float(stats["ratio_max"]))
        self.gap_max = max(self.gap_max, float(stats["gap_max"]))

    def merge_across_ranks(self, device: torch.device) -> None:
        """Every rank's stats become the whole batch's (sums summed, extremes of extremes), so that every
        rank computes the same metrics; a collective, run by every rank of a data-parallel step."""
        import torch.distributed as dist

        sums = torch.tensor([self.loss, *(self.sums[k] for k in _SUM_KEYS)], dtype=torch.float64, device=device)
        # max(-min) is -min(min): one MAX reduction serves both extremes.
        extremes = torch.tensor([-self.ratio_min, self.ratio_max, self.gap_max], dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        self.loss, *values = sums.tolist()
        self.sums = dict(zip(_SUM_KEYS, values))
        self.ratio_min, self.ratio_max, self.gap_max = -extremes[0].item(), extremes[1].item(), extremes[2].item()

    def metrics(self, step: int, rewards: list[float], grad_norm: float, seconds: float,
                checked_version: int | None = None, kl_computed: bool = False) -> TrainMetrics:
        """`kl_computed`: whether the step ran the reference forward (beta > 0); without it `kl` is None."""
        tokens = self.sums["token_count"]
        n = max(tokens, 1.0)
        ratio_mean = self.sums["ratio_sum"] / n
        # E[r^2] - E[r]^2 can dip below 0 by rounding when all ratios are equal.
        ratio_var = max(self.sums["ratio_sq_sum"] / n - ratio_mean**2, 0.0)
        reward_mean = sum(rewards) / len(rewards)
        reward_var = sum((r - reward_mean) ** 2 for r in rewards) / len(rewards)
        return TrainMetrics(
            step=step,
            loss=self.loss,
            reward_mean=reward_mean,
            reward_std=math.sqrt(reward_var),
            kl=self.sums["kl_sum"] / n if kl_computed else None,
            clipped_fraction=self.sums["clipped_count"] / n,
            ratio_mean=ratio_mean,
            ratio_std=math.sqrt(ratio_var),
            ratio_min=self.ratio_min if tokens else 1.0,
            ratio_max=self.ratio_max if tokens else 1.0,
            grad_norm=grad_norm,
            tokens=int(tokens),
            seconds=seconds,
            checked_version=checked_version,
            sampler_gap_tokens=int(self.sums["gap_tokens"]),
            sampler_gap_mean=self.sums["gap_sum"] / max(self.sums["gap_tokens"], 1.0),
            sampler_gap_max=self.gap_max,
            mismatch_kl=self.sums["mismatch_kl_sum"] / n,
            rollout_corrected_fraction=self.sums["corrected_count"] / n,
            mismatch_kl_fresh=_mean_or_none(self.sums["mismatch_fresh_sum"], self.sums["fresh_tokens"]),
            mismatch_fresh_tokens=int(self.sums["fresh_tokens"]),
            offpolicy_kl_stale=_mean_or_none(self.sums["offpolicy_stale_sum"], self.sums["stale_tokens"]),
            offpolicy_stale_tokens=int(self.sums["stale_tokens"]),
        )


def _mean_or_none(total: float, count: float) -> float | None:
    """None when no token was of the kind: a 0 would read as a measured perfect match."""
    return total / count if count else None
