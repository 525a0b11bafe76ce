"""Every loss the learner knows, in one table: name -> family, per-token inputs, config keys with defaults and
bounds, and a one-line doc. No ML package here: the front end's config (AlgorithmConfig.loss) and the docs read
the names from this table, and the learner's functions (learner/tinker_losses.py) are keyed by the same names (it
checks that at import).

Two families:
  * "tinker": Tinker's built-in losses (its `forward_backward` loss_fn), each a SUM over a datum's positions of
    a per-position loss, as Tinker defines them (tinker-docs.thinkingmachines.ai/tinker/losses); so several
    forward_backward calls before one optim_step add up to one call over all their datums.
  * "grpo": the server's own GRPO family (learner/policy_loss.py `policy_loss`), normalised by the whole batch (a train
    step's groups, or one forward_backward call's datums), one advantage per sequence. These are the names an
    experiment's AlgorithmConfig.loss may take (NATIVE_LOSSES).

Inputs are Tinker's: position i of a datum's `tokens` predicts `target_tokens[i]`; `logprobs` are the
sampler's logprobs of those targets, `advantages` and `weights` one value per position.

Name clash: Tinker's SDK also has a `gspo` (GSPO-token, a sum over tokens with a `sequence_ratio_mask` input);
here `gspo` is the server's (per-sequence mean of a sequence-level ratio, batch-normalised). Tinker's own
`gspo`, `stable_reinforce` and `custom` are not in the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

Family = Literal["tinker", "grpo"]


@dataclass(frozen=True)
class ConfigKey:
    """One `loss_fn_config` key: its default and inclusive bounds (a value outside is a 400 naming it)."""

    default: float
    low: float
    high: float
    integer: bool = False


@dataclass(frozen=True)
class LossSpec:
    name: str
    family: Family
    inputs: tuple[str, ...]  # required loss_fn_inputs, one value per position of the datum
    doc: str
    optional: tuple[str, ...] = ()  # loss_fn_inputs it also reads when given
    config: Mapping[str, ConfigKey] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def defaults(self) -> dict[str, float]:
        return {key: spec.default for key, spec in self.config.items()}


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
# Tinker's PPO clip "currently fixed to 0.2" (its docs): the thresholds are ratio bounds, 1 -/+ 0.2. CISPO takes
# the same keys; its default is not in Tinker's docs, so PPO's is used.
_RATIO_CLIP = MappingProxyType({"clip_low_threshold": ConfigKey(0.8, 0.0, 1.0),
                                "clip_high_threshold": ConfigKey(1.2, 1.0, 100.0)})


def _grpo_config(clip_low: float, clip_high: float) -> Mapping[str, ConfigKey]:
    """The GRPO family's keys, named as in AlgorithmConfig: the PPO epsilons, the KL-to-base weight, and dr_grpo's
    constant normaliser (a forward_backward call has no sampling.max_tokens to take it from)."""
    return MappingProxyType({"clip_low": ConfigKey(clip_low, 0.0, 0.999999),
                             "clip_high": ConfigKey(clip_high, 0.0, 10.0), "beta": ConfigKey(0.0, 0.0, 100.0),
                             "max_tokens": ConfigKey(256, 1, 2**24, integer=True)})


_ROWS = (
    LossSpec("cross_entropy", "tinker", ("target_tokens", "weights"),
             "Supervised: -sum(weights * logp(target)), summed over the datum's positions."),
    LossSpec("importance_sampling", "tinker", _RL_INPUTS,
             "REINFORCE with an importance weight: -sum(exp(logp - logprobs) * advantages)."),
    LossSpec("ppo", "tinker", _RL_INPUTS,
             "Clipped ratio per token: -sum(min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)), "
             "r = exp(logp - logprobs).", config=_RATIO_CLIP),
    LossSpec("cispo", "tinker", _RL_INPUTS,
             "The clipped ratio only weighs the policy gradient: "
             "-sum(stopgrad(clip(r, clip_low_threshold, clip_high_threshold)) * logp * A).", config=_RATIO_CLIP),
    LossSpec("dro", "tinker", _RL_INPUTS,
             "A quadratic penalty instead of a clip: -sum(logp * A - beta / 2 * (logp - logprobs)^2), over every "
             "position (as Tinker's docs write it).", config=MappingProxyType({"beta": ConfigKey(0.05, 0.0, 1e3)})),
    LossSpec("grpo", "grpo", _RL_INPUTS,
             "PPO-clipped token ratios, mean over each sequence's tokens, then mean over the batch's sequences "
             "(GRPO, DeepSeekMath).", ("weights",), _grpo_config(0.2, 0.2)),
    LossSpec("dr_grpo", "grpo", _RL_INPUTS,
             "Token sum / (sequences x max_tokens): no length bias; advantages without the std division "
             "(Dr. GRPO).", ("weights",), _grpo_config(0.2, 0.2)),
    LossSpec("dapo", "grpo", _RL_INPUTS,
             "Token mean over the whole batch, clip-higher 0.2 / 0.28 (DAPO).", ("weights",), _grpo_config(0.2, 0.28)),
    LossSpec("gspo", "grpo", _RL_INPUTS,
             "One ratio per sequence (the geometric mean of its token ratios), clipped, mean over sequences; "
             "clips 3e-4 / 4e-4 (GSPO paper v2).", ("weights",), _grpo_config(3e-4, 4e-4)),
)

LOSSES: Mapping[str, LossSpec] = MappingProxyType({row.name: row for row in _ROWS})
NATIVE_LOSSES: tuple[str, ...] = tuple(row.name for row in _ROWS if row.family == "grpo")


def markdown_table() -> str:
    """The table as Markdown rows, for the docs."""
    lines = ["| loss | family | inputs | config (default) | what |", "|---|---|---|---|---|"]
    for row in _ROWS:
        inputs = ", ".join(row.inputs) + "".join(f", [{name}]" for name in row.optional)
        config = ", ".join(f"{key} ({spec.default:g})" for key, spec in row.config.items()) or "-"
        lines.append(f"| `{row.name}` | {row.family} | {inputs} | {config} | {row.doc} |")
    return "\n".join(lines)
