"""GRPO-family policy losses as pure torch functions.

Shapes ride in the names: B sequences, T completion positions, V vocabulary. Every loss is scaled by
*whole optimizer-batch* sizes (`BatchNormalizer`), so the loss of a micro-batch is its exact share of
the batch loss: summing micro-batch losses (gradient accumulation) gives the batch loss and gradient,
with no bias from how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_server.protocol.loss_table import NATIVE_LOSSES
from grpo_server.protocol.sampling_distribution import outside_nucleus

LOSS_TYPES = NATIVE_LOSSES  # the loss table's GRPO family: "grpo", "dr_grpo", "dapo", "gspo"
ROLLOUT_CORRECTIONS = ("none", "token_tis", "token_mask", "sequence_mask")

# Log-ratios beyond this are a broken batch, not a signal; clamping keeps exp() finite so one bad
# token cannot turn the whole step into inf/NaN (exp(20) ~ 5e8 is far outside any clip range).
_MAX_LOG_RATIO = 20.0
# Vocabulary entries taken at once when finding top-p nuclei (a sort: ~17 bytes each: value, index, mask) and
# in _SelectedLogprob's logsumexp and softmax (an exp() temporary: 4 bytes each).
_NUCLEUS_CHUNK_ENTRIES = 1 << 24


def token_logprobs(logits_B_T_V: Tensor, token_ids_B_T: Tensor, temperature: float = 1.0,
                   top_p: float = 1.0) -> Tensor:
    """The logprob of token_ids under the distribution the sampler drew them from; float32.

    That is log softmax(logits / temperature), renormalised over vLLM's top-p nucleus when top_p < 1
    (protocol/sampling_distribution.py), with the token itself always counted in the nucleus: a sampled
    token that the learner's logits put just outside it (float noise at the boundary, or weights that moved
    since) gets a finite logprob, not -inf. logits[:, t] is the distribution of token_ids[:, t] (the caller
    shifts). Temperature and top_p must be the sampler's, or the ratio would not start at 1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs, got {temperature}")
    logits = logits_B_T_V.float()
    if top_p >= 1.0:
        return _SelectedLogprob.apply(logits, token_ids_B_T.long(), float(temperature))
    if temperature != 1.0:
        logits = logits / temperature
    logp_B_T_V = torch.log_softmax(logits, dim=-1)
    logp_B_T = logp_B_T_V.gather(-1, token_ids_B_T.long().unsqueeze(-1)).squeeze(-1)
    return logp_B_T - nucleus_log_mass(logp_B_T_V, token_ids_B_T, top_p)


class _SelectedLogprob(torch.autograd.Function):
    """log softmax(logits / T)[token] with no [B, T, V] tensor kept beyond the logits themselves.

    Through autograd, `log_softmax(logits / T).gather(...)` keeps a tempered copy or the log-softmax output for
    the backward: one more float32 tensor the size of the logits (B x T x 49,152 x 4 bytes on SmolLM2), plus a
    softmax-sized gradient for each. TRL computes only the sampled tokens' logprobs for the same reason
    (selective_log_softmax). Here the forward keeps the logits and one normaliser per row, and the backward
    recomputes softmax(logits / T) chunk by chunk into the logits' gradient: (onehot(token) - softmax) / T.
    """

    @staticmethod
    def forward(ctx, logits_B_T_V: Tensor, token_ids_B_T: Tensor, temperature: float) -> Tensor:
        flat_N_V = logits_B_T_V.reshape(-1, logits_B_T_V.shape[-1])
        norm_N = flat_N_V.new_empty(flat_N_V.shape[0])
        for rows in _row_chunks(flat_N_V):
            norm_N[rows] = torch.logsumexp(flat_N_V[rows] / temperature, dim=-1)
        picked_B_T = logits_B_T_V.gather(-1, token_ids_B_T.unsqueeze(-1)).squeeze(-1) / temperature
        ctx.save_for_backward(logits_B_T_V, token_ids_B_T, norm_N)
        ctx.temperature = temperature
        return picked_B_T - norm_N.view_as(picked_B_T)

    @staticmethod
    def backward(ctx, grad_B_T: Tensor):
        logits_B_T_V, token_ids_B_T, norm_N = ctx.saved_tensors
        flat_N_V = logits_B_T_V.reshape(-1, logits_B_T_V.shape[-1])
        scale_N = grad_B_T.reshape(-1) / ctx.temperature
        grad_N_V = torch.empty_like(flat_N_V)
        for rows in _row_chunks(flat_N_V):
            probs = torch.exp(flat_N_V[rows] / ctx.temperature - norm_N[rows, None])
            grad_N_V[rows] = probs.mul_(-scale_N[rows, None])
        grad_N_V.scatter_add_(-1, token_ids_B_T.reshape(-1, 1), scale_N[:, None])
        return grad_N_V.view_as(logits_B_T_V), None, None


def _row_chunks(flat_N_V: Tensor):
    """Row slices of at most _NUCLEUS_CHUNK_ENTRIES entries: an exp() temporary of 64 MiB at most."""
    rows = max(1, _NUCLEUS_CHUNK_ENTRIES // flat_N_V.shape[-1])
    for start in range(0, flat_N_V.shape[0], rows):
        yield slice(start, start + rows)


def nucleus_log_mass(logp_B_T_V: Tensor, token_ids_B_T: Tensor, top_p: float) -> Tensor:
    """log of the probability in vLLM's top-p nucleus (plus token_ids, if outside it), per position.

    Which tokens are in is decided without gradient, in row chunks (a sort over the vocabulary holds an
    index per entry: 8 bytes x V per row); the mass is a differentiable logsumexp of their logprobs.
    """
    V = logp_B_T_V.shape[-1]
    with torch.no_grad():
        flat_N_V = logp_B_T_V.detach().reshape(-1, V)
        dropped_N_V = torch.empty_like(flat_N_V, dtype=torch.bool)
        rows = max(1, _NUCLEUS_CHUNK_ENTRIES // V)
        for start in range(0, flat_N_V.shape[0], rows):
            dropped_N_V[start:start + rows] = outside_nucleus(flat_N_V[start:start + rows], top_p)
        dropped_B_T_V = dropped_N_V.view_as(logp_B_T_V)
        dropped_B_T_V.scatter_(-1, token_ids_B_T.long().unsqueeze(-1), False)  # the token itself counts
    return torch.logsumexp(logp_B_T_V.masked_fill(dropped_B_T_V, -float("inf")), dim=-1)


@dataclass(frozen=True)
class RolloutCorrection:
    """How the sampler/learner mismatch is corrected (AlgorithmConfig.rollout_correction; `rollout_weights`).

    "none": the PPO ratio is taken against the sampler's logprobs (verl's "bypass" mode): the ratio is the
    importance weight and the clip its only bound. Any other mode is the decoupled form: the PPO ratio is
    taken against the learner's own pre-step logprobs (the proximal policy), and each token's loss is
    multiplied by a detached weight computed from rho = exp(learner_old - sampler), the behaviour ratio.
    """

    mode: str = "none"  # "none" | "token_tis" | "token_mask" | "sequence_mask"
    is_cap: float = 3.0  # token_tis: weight = min(rho, is_cap)
    mask_low: float = 0.5  # token_mask / sequence_mask: kept when mask_low <= rho <= mask_high
    mask_high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout correction must be one of {ROLLOUT_CORRECTIONS}, got {self.mode!r}")
        if not (self.is_cap >= 1.0 and 0.0 < self.mask_low <= 1.0 <= self.mask_high):
            raise ValueError(f"need is_cap >= 1 and 0 < mask_low <= 1 <= mask_high: {self}")


@dataclass(frozen=True)
class LossSettings:
    loss_type: str  # "grpo" | "dr_grpo" | "dapo" | "gspo"
    clip_low: float  # ratio lower bound is 1 - clip_low
    clip_high: float  # ratio upper bound is 1 + clip_high (clip-higher, DAPO)
    beta: float = 0.0  # KL-to-base weight
    correction: RolloutCorrection = RolloutCorrection()

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0 or self.beta < 0.0:
            raise ValueError(f"need 0 <= clip_low < 1, clip_high >= 0, beta >= 0: {self}")


@dataclass(frozen=True)
class BatchNormalizer:
    """Whole optimizer-batch sizes, so a micro-batch's loss is its exact share of the batch loss and
    micro-batch losses SUM to the batch loss (gradient accumulation without bias)."""

    num_sequences: int  # sequences in the whole batch
    num_tokens: int  # completion tokens (mask sum) in the whole batch
    max_tokens: int  # dr_grpo's constant normaliser (the generation budget)

    def __post_init__(self) -> None:
        if self.num_sequences < 1 or self.num_tokens < 0 or self.max_tokens < 1:
            raise ValueError(f"need num_sequences >= 1, num_tokens >= 0, max_tokens >= 1: {self}")


def _masked_log_diff(a_B_T: Tensor, b_B_T: Tensor, valid_B_T: Tensor) -> Tensor:
    """a - b on valid positions, exactly 0 on padding.

    torch.where (not a multiply) so padding gets a zero gradient even when a or b is huge there:
    a multiply would give 0 * inf = NaN through exp's backward.
    """
    diff = torch.where(valid_B_T, a_B_T - b_B_T, torch.zeros_like(a_B_T))
    return diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _aggregate(tok_B_T: Tensor, mask_B_T: Tensor, loss_type: str, norm: BatchNormalizer) -> Tensor:
    """Reduce a per-token quantity (already 0 on padding) to this micro-batch's share of the batch."""
    if loss_type in ("grpo", "gspo"):
        # Each sequence weighs the same regardless of length; an empty sequence contributes 0.
        lengths_B = mask_B_T.sum(-1).clamp(min=1.0)
        return (tok_B_T.sum(-1) / lengths_B).sum() / norm.num_sequences
    if loss_type == "dr_grpo":
        # Constant normaliser: no length bias (Dr. GRPO).
        return tok_B_T.sum() / (norm.num_sequences * norm.max_tokens)
    # dapo: every token of the batch weighs the same.
    return tok_B_T.sum() / max(norm.num_tokens, 1)


def _clipped_objective(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO surrogate min(r*A, clip(r)*A) and where the clipped branch is the active (smaller) one."""
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    objective = torch.minimum(ratio * adv, clipped_ratio * adv)
    # Only the bound that the sign of A makes binding matters: above for A > 0, below for A < 0.
    is_clipped = ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))
    return objective, is_clipped


def rollout_weights(learner_old_logp_B_T: Tensor, sampler_logp_B_T: Tensor, mask_B_T: Tensor,
                    correction: RolloutCorrection) -> tuple[Tensor, Tensor]:
    """Per-token loss weights (detached; 0 on padding) and where the correction acted (capped or masked).

    rho = exp(learner_old - sampler) per token. token_tis: min(rho, is_cap) (truncated IS; a weight is only
    capped from above). token_mask: 1 where mask_low <= rho <= mask_high, else 0. sequence_mask: the
    sequence's ratio is the GEOMETRIC mean of its tokens' rho (exp of the mean log-ratio: the product would
    drift with length), and all its tokens get 1 inside the bounds, 0 outside. "none": 1 everywhere.
    """
    valid_B_T = mask_B_T.bool()
    log_rho_B_T = _masked_log_diff(learner_old_logp_B_T.detach().float(), sampler_logp_B_T.detach().float(),
                                   valid_B_T)
    rho_B_T = log_rho_B_T.exp()
    if correction.mode == "token_tis":
        weight_B_T = rho_B_T.clamp(max=correction.is_cap)
        acted_B_T = rho_B_T > correction.is_cap
    elif correction.mode == "token_mask":
        acted_B_T = (rho_B_T < correction.mask_low) | (rho_B_T > correction.mask_high)
        weight_B_T = (~acted_B_T).float()
    elif correction.mode == "sequence_mask":
        lengths_B = valid_B_T.sum(-1).clamp(min=1)
        seq_rho_B = (log_rho_B_T.sum(-1) / lengths_B).exp()
        acted_B = (seq_rho_B < correction.mask_low) | (seq_rho_B > correction.mask_high)
        acted_B_T = acted_B.unsqueeze(-1).expand_as(valid_B_T)
        weight_B_T = (~acted_B_T).float()
    else:
        weight_B_T, acted_B_T = torch.ones_like(rho_B_T), torch.zeros_like(valid_B_T)
    zeros_B_T = torch.zeros_like(weight_B_T)
    return torch.where(valid_B_T, weight_B_T, zeros_B_T), acted_B_T & valid_B_T


def mismatch_kl_sum(learner_logp_B_T: Tensor, sampler_logp_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Sum over valid tokens of k3 = rho - 1 - log rho, rho = exp(learner - sampler): per token an unbiased,
    nonnegative estimate of KL(sampler || learner) under the sampler's tokens (detached)."""
    valid_B_T = mask_B_T.bool()
    log_rho_B_T = _masked_log_diff(learner_logp_B_T.detach().float(), sampler_logp_B_T.detach().float(), valid_B_T)
    return (log_rho_B_T.exp() - 1.0 - log_rho_B_T).sum()  # 0 on padding (log_rho = 0 there)


def mismatch_kl_split(learner_logp_B_T: Tensor, sampler_logp_B_T: Tensor, mask_B_T: Tensor,
                      fresh_B: Tensor) -> dict[str, Tensor]:
    """`mismatch_kl_sum` apart for fresh sequences (sampled by the version whose weights the learner holds: their
    KL is numeric mismatch alone) and stale ones (sampled by an older version: their KL is mostly the policy's
    change since), with each side's token count. The two sums add up to `mismatch_kl_sum`'s."""
    valid_B_T = mask_B_T.bool()
    fresh_B_T = valid_B_T & fresh_B.bool()[:, None]
    stale_B_T = valid_B_T & ~fresh_B.bool()[:, None]
    return {"mismatch_fresh_sum": mismatch_kl_sum(learner_logp_B_T, sampler_logp_B_T, fresh_B_T),
            "fresh_tokens": fresh_B_T.sum(),
            "offpolicy_stale_sum": mismatch_kl_sum(learner_logp_B_T, sampler_logp_B_T, stale_B_T),
            "stale_tokens": stale_B_T.sum()}


def policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    advantages_B: Tensor,
    mask_B_T: Tensor,
    settings: LossSettings,
    norm: BatchNormalizer,
    ref_logp_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the batch loss, and detached stats (sums and extremes).

    old_logp are the sampler's (behaviour) logprobs. With no rollout correction the PPO ratio is taken
    against them (that ratio is the off-policy correction). With one (settings.correction), the ratio is
    taken against the learner's own pre-step logprobs, logp.detach(): the weights do not move within a step
    (one optimizer step per batch, after the last micro-batch), so these are exactly the learner's "old"
    policy; each token's loss, KL term included, is then multiplied by `rollout_weights`. Masked tokens still
    count in the normalisers (their share is 0, not redistributed). ref_logp are the base model's, used for
    the KL penalty when beta > 0. Stats: token_count, seq_count, clipped_count, ratio_sum, ratio_sq_sum,
    ratio_min, ratio_max (+inf / -inf when no valid token, the identities of min / max; the PPO ratio without
    a correction, the behaviour ratio rho before truncation with one), kl_sum (whenever ref is given),
    mismatch_kl_sum (`mismatch_kl_sum`), corrected_count (tokens the correction capped or masked).
    """
    if settings.beta > 0 and ref_logp_B_T is None:
        raise ValueError("beta > 0 needs ref_logp_B_T (the base model's logprobs)")
    valid_B_T = mask_B_T.bool()
    mask_B_T = valid_B_T.float()
    logp_B_T = logp_B_T.float()
    old_logp_B_T = old_logp_B_T.detach().float()
    adv_B = advantages_B.detach().float()
    lengths_B = mask_B_T.sum(-1)
    correcting = settings.correction.mode != "none"
    weight_B_T: Tensor | None = None
    corrected_B_T = torch.zeros_like(valid_B_T)
    anchor_B_T = old_logp_B_T  # the PPO ratio's denominator
    if correcting:
        weight_B_T, corrected_B_T = rollout_weights(logp_B_T, old_logp_B_T, valid_B_T, settings.correction)
        anchor_B_T = logp_B_T.detach()

    log_ratio_B_T = _masked_log_diff(logp_B_T, anchor_B_T, valid_B_T)

    if settings.loss_type == "gspo" and not correcting:
        # One ratio per sequence: the geometric mean of its token ratios (GSPO); gradient flows
        # through the mean into every token.
        seq_log_ratio_B = log_ratio_B_T.sum(-1) / lengths_B.clamp(min=1.0)
        seq_ratio_B = seq_log_ratio_B.exp()
        objective_B, clipped_B = _clipped_objective(seq_ratio_B, adv_B, settings.clip_low, settings.clip_high)
        has_tokens_B = lengths_B > 0
        # An empty sequence has no tokens to learn from: it must not add -A to the loss either.
        loss = -(objective_B * has_tokens_B).sum() / norm.num_sequences
        ratio_B_T = seq_ratio_B.unsqueeze(-1).expand_as(mask_B_T)
        clipped_B_T = clipped_B.unsqueeze(-1).expand_as(valid_B_T) & valid_B_T
    elif settings.loss_type == "gspo":
        # GSPO-token (same value and gradient as GSPO): every token carries the sequence ratio's value and
        # its own logprob's gradient, so a per-token weight can scale each token's share.
        seq_log_ratio_B = (log_ratio_B_T.sum(-1) / lengths_B.clamp(min=1.0)).detach()
        tok_ratio_B_T = (seq_log_ratio_B.unsqueeze(-1) + log_ratio_B_T - log_ratio_B_T.detach()).exp()
        objective_B_T, clipped_B_T = _clipped_objective(
            tok_ratio_B_T, adv_B.unsqueeze(-1), settings.clip_low, settings.clip_high)
        clipped_B_T = clipped_B_T & valid_B_T
        loss = _aggregate(-objective_B_T * weight_B_T, mask_B_T, "grpo", norm)
        ratio_B_T = tok_ratio_B_T
    else:
        ratio_B_T = log_ratio_B_T.exp()  # 1 on padding
        objective_B_T, clipped_B_T = _clipped_objective(
            ratio_B_T, adv_B.unsqueeze(-1), settings.clip_low, settings.clip_high
        )
        clipped_B_T = clipped_B_T & valid_B_T
        tok_weight_B_T = mask_B_T if weight_B_T is None else weight_B_T
        loss = _aggregate(-objective_B_T * tok_weight_B_T, mask_B_T, settings.loss_type, norm)

    kl_sum = torch.zeros((), device=logp_B_T.device)
    if ref_logp_B_T is not None:
        # k3 estimator (Schulman): unbiased for KL(pi || ref) under pi's samples, always >= 0.
        ref_diff_B_T = _masked_log_diff(ref_logp_B_T.detach().float(), logp_B_T, valid_B_T)
        kl_B_T = (ref_diff_B_T.exp() - ref_diff_B_T - 1.0) * mask_B_T
        kl_sum = kl_B_T.detach().sum()
        if settings.beta > 0:
            kl_loss_type = "grpo" if settings.loss_type == "gspo" else settings.loss_type
            kl_tok_B_T = kl_B_T if weight_B_T is None else kl_B_T * weight_B_T
            loss = loss + settings.beta * _aggregate(kl_tok_B_T, mask_B_T, kl_loss_type, norm)

    with torch.no_grad():
        if correcting:  # the PPO ratio is 1 by construction: report the behaviour ratio instead
            ratio_B_T = _masked_log_diff(logp_B_T.detach(), old_logp_B_T, valid_B_T).exp()
        ratio_B_T = ratio_B_T.detach()
        inf = torch.tensor(float("inf"), device=ratio_B_T.device)
        stats = {
            "token_count": mask_B_T.sum(),
            "seq_count": torch.tensor(float(mask_B_T.shape[0]), device=mask_B_T.device),
            "clipped_count": clipped_B_T.float().sum(),
            "ratio_sum": (ratio_B_T * mask_B_T).sum(),
            "ratio_sq_sum": (ratio_B_T.square() * mask_B_T).sum(),
            "ratio_min": torch.where(valid_B_T, ratio_B_T, inf).min() if ratio_B_T.numel() else inf,
            "ratio_max": torch.where(valid_B_T, ratio_B_T, -inf).max() if ratio_B_T.numel() else -inf,
            "kl_sum": kl_sum,
            "mismatch_kl_sum": mismatch_kl_sum(logp_B_T, old_logp_B_T, valid_B_T),
            "corrected_count": corrected_B_T.float().sum(),
        }
    return loss, stats
