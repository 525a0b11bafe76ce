"""The loss table's functions: one per name of grpo_server/protocol/loss_table.py (which holds the inputs, config
keys and docs; this module checks at import that both name the same losses).

Shapes ride in the names: B datums, T positions (right-padded). Every function takes a `LossInput` and returns a
`LossOutput` whose `loss` is the scalar to backward and whose `elementwise_B_T` is each position's share of it
(detached, 0 on padding): the shares sum to the loss, and a forward_backward answer reports them per datum.

Tinker's losses are SUMS over positions, so a micro-batch's loss is its exact share of the call's, and calls
before one optim_step add up. The GRPO family runs learner/policy_loss.py's `policy_loss` (the native train step's own
function) with whole-call sizes (`BatchNormalizer`), which makes its micro-batch losses shares too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.loss_table import LOSSES, NATIVE_LOSSES, LossSpec
from learner.policy_loss import BatchNormalizer, LossSettings, _clipped_objective, _masked_log_diff, policy_loss


@dataclass
class LossInput:
    logp_B_T: Tensor  # the learner's logprob of each target (float32; carries the gradient in forward_backward)
    valid_B_T: Tensor  # bool: real positions (False on padding)
    inputs: dict[str, Tensor]  # loss_fn_inputs but target_tokens, float32 [B, T], 0 on padding
    config: dict[str, float]  # loss_fn_config with the table's defaults filled in
    norm: BatchNormalizer | None = None  # GRPO family: the whole call's sizes
    ref_logp_B_T: Tensor | None = None  # GRPO family with beta > 0: the base model's logprobs


@dataclass
class LossOutput:
    loss: Tensor
    elementwise_B_T: Tensor
    mask_B_T: Tensor  # positions with a learning signal (weights or advantages != 0): token counts, sampler gap
    clipped_B_T: Tensor | None = None  # where a clip acted (losses with a clip)


def _summed(x: LossInput, elementwise_B_T: Tensor, mask_B_T: Tensor, clipped_B_T: Tensor | None = None) -> LossOutput:
    # torch.where, not a multiply: a padding position's value may be anything, and 0 * inf is NaN.
    elementwise_B_T = torch.where(x.valid_B_T, elementwise_B_T, torch.zeros_like(elementwise_B_T))
    clipped = None if clipped_B_T is None else clipped_B_T & x.valid_B_T
    return LossOutput(elementwise_B_T.sum(), elementwise_B_T.detach(), mask_B_T & x.valid_B_T, clipped)


def _ratio(x: LossInput) -> Tensor:
    """exp(logp - sampler logprobs): 1 on padding; the log-ratio clamped to +-20 as in learner/policy_loss.py, so a
    placeholder logprob (Tinker's datums put 0 on prompt positions, whose advantage is 0) cannot make inf * 0."""
    return _masked_log_diff(x.logp_B_T, x.inputs["logprobs"], x.valid_B_T).exp()


def cross_entropy(x: LossInput) -> LossOutput:
    weights_B_T = x.inputs["weights"]
    return _summed(x, -weights_B_T * x.logp_B_T, weights_B_T != 0)


def importance_sampling(x: LossInput) -> LossOutput:
    adv_B_T = x.inputs["advantages"]
    return _summed(x, -_ratio(x) * adv_B_T, adv_B_T != 0)


def ppo(x: LossInput) -> LossOutput:
    adv_B_T, low, high = x.inputs["advantages"], x.config["clip_low_threshold"], x.config["clip_high_threshold"]
    ratio_B_T = _ratio(x)
    objective_B_T = torch.minimum(ratio_B_T * adv_B_T, ratio_B_T.clamp(low, high) * adv_B_T)
    # Only the bound the advantage's sign makes binding acts: above for A > 0, below for A < 0.
    clipped_B_T = ((adv_B_T > 0) & (ratio_B_T > high)) | ((adv_B_T < 0) & (ratio_B_T < low))
    return _summed(x, -objective_B_T, adv_B_T != 0, clipped_B_T)


def cispo(x: LossInput) -> LossOutput:
    adv_B_T, low, high = x.inputs["advantages"], x.config["clip_low_threshold"], x.config["clip_high_threshold"]
    ratio_B_T = _ratio(x).detach()  # a weight only: no gradient through it
    clipped_B_T = ((ratio_B_T < low) | (ratio_B_T > high)) & (adv_B_T != 0)
    return _summed(x, -ratio_B_T.clamp(low, high) * x.logp_B_T * adv_B_T, adv_B_T != 0, clipped_B_T)


def dro(x: LossInput) -> LossOutput:
    adv_B_T = x.inputs["advantages"]
    diff_B_T = torch.where(x.valid_B_T, x.logp_B_T - x.inputs["logprobs"], torch.zeros_like(x.logp_B_T))
    return _summed(x, -(x.logp_B_T * adv_B_T - 0.5 * x.config["beta"] * diff_B_T.square()), adv_B_T != 0)


def grpo_settings(name: str, config: dict[str, float]) -> LossSettings:
    """The GRPO family's LossSettings from a loss_fn_config; a 400 for values it refuses."""
    try:
        return LossSettings(name, config["clip_low"], config["clip_high"], config["beta"])
    except ValueError as exc:
        raise BadRequest(f"loss_fn_config for {name}: {exc}") from exc


def grpo_mask(inputs: dict[str, Tensor]) -> Tensor:
    """The positions the GRPO family trains: `weights` != 0 when given, else `advantages` != 0 (Tinker's RL datums
    put advantage 0 on prompt positions)."""
    return inputs["weights"] != 0 if "weights" in inputs else inputs["advantages"] != 0


def _grpo(name: str) -> Callable[[LossInput], LossOutput]:
    def loss_fn(x: LossInput) -> LossOutput:
        settings = grpo_settings(name, x.config)
        mask_B_T = grpo_mask(x.inputs) & x.valid_B_T
        # One advantage per sequence (learner/datums.py checked it is the same on all its trained positions).
        counts_B = mask_B_T.sum(-1).clamp(min=1)
        adv_B = torch.where(mask_B_T, x.inputs["advantages"], 0.0).sum(-1) / counts_B
        old_logp_B_T = x.inputs["logprobs"]
        loss, _ = policy_loss(x.logp_B_T, old_logp_B_T, adv_B, mask_B_T, settings, x.norm, x.ref_logp_B_T)
        with torch.no_grad():
            ref = None if x.ref_logp_B_T is None else x.ref_logp_B_T.detach().float()
            shares_B_T, clipped_B_T = _grpo_shares(x.logp_B_T.detach().float(), old_logp_B_T, adv_B, mask_B_T,
                                                   settings, x.norm, ref)
        return LossOutput(loss, shares_B_T, mask_B_T, clipped_B_T)

    return loss_fn


def _share(tok_B_T: Tensor, mask_B_T: Tensor, loss_type: str, norm: BatchNormalizer) -> Tensor:
    """learner/policy_loss.py `_aggregate` without its final sum: each token's part of the micro-batch's share."""
    if loss_type in ("grpo", "gspo"):
        return tok_B_T / mask_B_T.sum(-1, keepdim=True).clamp(min=1.0) / norm.num_sequences
    if loss_type == "dr_grpo":
        return tok_B_T / (norm.num_sequences * norm.max_tokens)
    return tok_B_T / max(norm.num_tokens, 1)


def _grpo_shares(logp_B_T: Tensor, old_logp_B_T: Tensor, adv_B: Tensor, mask_B_T: Tensor, settings: LossSettings,
                 norm: BatchNormalizer, ref_logp_B_T: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each token's part of `policy_loss` (no rollout correction), and where its clip acted. A sequence-level
    term (GSPO's) is spread evenly over the sequence's tokens. tests/test_learner_steps.py holds their sum to the
    loss policy_loss returns."""
    m_B_T = mask_B_T.float()
    log_ratio_B_T = _masked_log_diff(logp_B_T, old_logp_B_T, mask_B_T)
    if settings.loss_type == "gspo":
        lengths_B = m_B_T.sum(-1).clamp(min=1.0)
        objective_B, clipped_B = _clipped_objective((log_ratio_B_T.sum(-1) / lengths_B).exp(), adv_B,
                                                    settings.clip_low, settings.clip_high)
        shares_B_T = (-objective_B / lengths_B).unsqueeze(-1) * m_B_T / norm.num_sequences
        clipped_B_T = clipped_B.unsqueeze(-1) & mask_B_T
    else:
        objective_B_T, clipped_B_T = _clipped_objective(log_ratio_B_T.exp(), adv_B.unsqueeze(-1), settings.clip_low,
                                                        settings.clip_high)
        shares_B_T = _share(-objective_B_T * m_B_T, m_B_T, settings.loss_type, norm)
    if ref_logp_B_T is not None and settings.beta > 0:
        ref_diff_B_T = _masked_log_diff(ref_logp_B_T, logp_B_T, mask_B_T)
        kl_B_T = (ref_diff_B_T.exp() - ref_diff_B_T - 1.0) * m_B_T
        kl_type = "grpo" if settings.loss_type == "gspo" else settings.loss_type
        shares_B_T = shares_B_T + settings.beta * _share(kl_B_T, m_B_T, kl_type, norm)
    return shares_B_T, clipped_B_T & mask_B_T


LOSS_FUNCTIONS: dict[str, Callable[[LossInput], LossOutput]] = {
    "cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo,
    "dro": dro, **{name: _grpo(name) for name in NATIVE_LOSSES}}
if LOSS_FUNCTIONS.keys() != LOSSES.keys():  # one table: a row without a function (or the reverse) is a bug
    raise ImportError("learner/tinker_losses.py and the loss table differ: "
                      f"{sorted(LOSS_FUNCTIONS.keys() ^ LOSSES.keys())}")


def needs_reference(spec: LossSpec, config: dict[str, float]) -> bool:
    """Whether the loss needs the base model's logprobs (the GRPO family's KL penalty)."""
    return spec.family == "grpo" and config["beta"] > 0
