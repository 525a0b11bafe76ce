"""The rollout correction (learner/policy_loss.py `rollout_weights`, AlgorithmConfig.rollout_correction): its
weights and masks, the mismatch KL and the loss gradient on a small example computed by hand; the config's
bounds; and a learner step with the correction on (the in-process `trainer` fixture, tests/conftest.py)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from grpo_server.protocol.worker_config import AlgorithmConfig
from grpo_server.protocol.wire import TrainRequest, TrainSample
from learner.policy_loss import (BatchNormalizer, LossSettings, RolloutCorrection, mismatch_kl_sum, policy_loss,
                                 rollout_weights)
from tests.learner_helpers import COMPLETION, LORA, PROMPT, _adapter_weights, _lp

# Behaviour ratios rho = exp(learner_old - sampler): row 0 has three tokens, row 1 two and one of padding.
RHO = [[4.0, 0.25, 1.0], [1.8, 2.5, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
LEARNER = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, -1.5]])
SAMPLER = LEARNER - torch.log(torch.tensor(RHO))
SAMPLER[1, 2] = -50.0  # padding: whatever is there must not count
ADV = torch.tensor([1.0, -2.0])
NORM = BatchNormalizer(num_sequences=2, num_tokens=5, max_tokens=4)


def _weights(mode: str):
    return rollout_weights(LEARNER, SAMPLER, MASK, RolloutCorrection(mode, is_cap=3.0, mask_low=0.5, mask_high=2.0))


def test_token_tis_caps_each_weight_from_above():
    weight, acted = _weights("token_tis")
    assert torch.allclose(weight, torch.tensor([[3.0, 0.25, 1.0], [1.8, 2.5, 0.0]]), atol=1e-6)
    assert acted.tolist() == [[True, False, False], [False, False, False]]


def test_token_mask_drops_tokens_outside_the_bounds():
    weight, acted = _weights("token_mask")
    assert weight.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    assert acted.tolist() == [[True, True, False], [False, True, False]]


def test_sequence_mask_uses_the_geometric_mean():
    # Row 0: (4 * 0.25 * 1)^(1/3) = 1, kept (its tokens 4 and 0.25 would each be masked alone); row 1:
    # (1.8 * 2.5)^(1/2) = 2.121 > 2, dropped whole (each token alone is inside [0.5, 2] or just past it).
    weight, acted = _weights("sequence_mask")
    assert weight.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert acted.tolist() == [[False, False, False], [True, True, False]]


def test_none_weighs_every_trained_token_one():
    weight, acted = _weights("none")
    assert weight.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]] and not acted.any()


def test_mismatch_kl_is_the_k3_sum():
    # rho - 1 - ln rho: 4 -> 1.613706, 0.25 -> 0.636294, 1 -> 0, 1.8 -> 0.212213, 2.5 -> 0.583709.
    assert math.isclose(float(mismatch_kl_sum(LEARNER, SAMPLER, MASK)), 3.045922, rel_tol=1e-5)


@pytest.mark.parametrize("mode,loss_value,grad", [
    # grpo: per sequence mean of -A * w (the PPO ratio against the learner's own logprobs is 1), over 2 sequences.
    # Row 0: -(3 + 0.25 + 1) / 3 = -1.416667; row 1: 2 * (1.8 + 2.5) / 2 = 4.3; loss (-1.416667 + 4.3) / 2.
    # Gradient of token t: -A * w_t / (length * 2).
    ("token_tis", 1.441667, [[-0.5, -0.041667, -0.166667], [0.9, 1.25, 0.0]]),
    # Masked tokens: weight 0, no gradient. Row 0: -1/3; row 1: 2 * 1 / 2 = 1; loss (-1/3 + 1) / 2.
    ("token_mask", 0.333333, [[0.0, 0.0, -0.166667], [0.5, 0.0, 0.0]]),
    ("sequence_mask", -0.5, [[-0.166667, -0.166667, -0.166667], [0.0, 0.0, 0.0]]),
])
def test_corrected_grpo_loss_and_gradient_by_hand(mode, loss_value, grad):
    logp = LEARNER.clone().requires_grad_(True)
    settings = LossSettings("grpo", 0.2, 0.28, correction=RolloutCorrection(mode))
    loss, stats = policy_loss(logp, SAMPLER, ADV, MASK, settings, NORM)
    loss.backward()
    assert math.isclose(float(loss.detach()), loss_value, rel_tol=1e-5)
    assert torch.allclose(logp.grad, torch.tensor(grad), atol=1e-5), logp.grad
    assert float(stats["clipped_count"]) == 0  # one step per batch: the PPO ratio is 1
    assert float(stats["corrected_count"]) == {"token_tis": 1, "token_mask": 3, "sequence_mask": 2}[mode]
    assert math.isclose(float(stats["ratio_max"]), 4.0, rel_tol=1e-5)  # the behaviour ratio is reported
    assert math.isclose(float(stats["mismatch_kl_sum"]), 3.045922, rel_tol=1e-5)


def test_corrected_gspo_weighs_each_token_of_the_sequence_ratio():
    # GSPO-token: the sequence ratio (1 here) per token, scaled by w; aggregated as grpo. token_tis row 0:
    # -(3 + 0.25 + 1) / 3, row 1: 2 * (1.8 + 2.5) / 2: the same as grpo on this example.
    logp = LEARNER.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, SAMPLER, ADV, MASK, LossSettings("gspo", 3e-4, 4e-4,
                          correction=RolloutCorrection("token_tis")), NORM)
    loss.backward()
    assert math.isclose(float(loss.detach()), 1.441667, rel_tol=1e-5)
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.041667, -0.166667], [0.9, 1.25, 0.0]]), atol=1e-5)


def test_none_keeps_the_ppo_ratio_against_the_sampler():
    logp = LEARNER.clone().requires_grad_(True)
    _, stats = policy_loss(logp, SAMPLER, ADV, MASK, LossSettings("grpo", 0.2, 0.28), NORM)
    # rho 4 with A > 0 is above 1.28; rho 1.8 and 2.5 with A < 0 are not below 0.8: one clipped token.
    assert float(stats["clipped_count"]) == 1 and float(stats["corrected_count"]) == 0


@pytest.mark.parametrize("field,value", [("rollout_correction", "sequence_tis"), ("rollout_is_cap", 0.5),
                                         ("rollout_is_cap", 1e9), ("rollout_mask_low", 0.0),
                                         ("rollout_mask_low", 1.5), ("rollout_mask_high", 0.9),
                                         ("rollout_mask_high", 1e9)])
def test_config_bounds(field, value):
    with pytest.raises(ValidationError, match=field):
        AlgorithmConfig(**{field: value})


def test_default_is_auto_resolved_at_creation():
    algo = AlgorithmConfig()  # auto: token_tis or none by the workers' numerics (tests/test_fast_defaults.py)
    assert (algo.rollout_correction, algo.rollout_is_cap, algo.rollout_mask_low, algo.rollout_mask_high) == (
        "auto", 3.0, 0.5, 2.0)


def _step(trainer, name: str, sampler: list[float], loss_mask: list[int] | None = None):
    return trainer.train(TrainRequest(name=name, max_tokens=8, samples=[TrainSample(
        prompt_token_ids=PROMPT, completion_token_ids=COMPLETION, sampler_logprobs=sampler, advantage=1.0,
        reward=1.0, policy_version=0, loss_mask=loss_mask)]))


def test_learner_step_masks_tokens_and_reports_the_mismatch(trainer):
    """dr_grpo's normaliser is constant, so a token masked by the correction must give exactly the step of the
    same token left out by loss_mask: no gradient through it, nothing else changed."""
    algo = dict(loss="dr_grpo", learning_rate=1e-2, rollout_correction="token_mask")
    v0 = Path(trainer.add_experiment("rc-masked", LORA, AlgorithmConfig(**algo)).path)
    shutil.copytree(v0, v0.parent.parent / "rc-left-out" / "v000000")
    trainer.add_experiment("rc-left-out", LORA, AlgorithmConfig(**algo))
    own = _lp(trainer, "rc-masked")[0]
    # Token 0's sampler logprob 2 nats below the learner's: rho = e^2 = 7.39 > 2, masked.
    shifted = [own[0] - 2.0, *own[1:]]
    masked = _step(trainer, "rc-masked", shifted)
    left_out = _step(trainer, "rc-left-out", own, loss_mask=[0] + [1] * (len(COMPLETION) - 1))
    n = len(COMPLETION)
    assert masked.kl is None  # beta = 0: no reference forward, no KL reported
    assert math.isclose(masked.rollout_corrected_fraction, 1 / n, rel_tol=1e-6)
    assert math.isclose(masked.mismatch_kl, (math.exp(2.0) - 1.0 - 2.0) / n, rel_tol=1e-4)
    assert left_out.rollout_corrected_fraction == 0 and left_out.mismatch_kl < 1e-6
    assert math.isclose(masked.ratio_max, math.exp(2.0), rel_tol=1e-4) and masked.clipped_fraction == 0
    assert masked.grad_norm > 0 and math.isclose(masked.grad_norm, left_out.grad_norm, rel_tol=1e-4)
    a, b = _adapter_weights(trainer, "rc-masked"), _adapter_weights(trainer, "rc-left-out")
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key


def test_learner_step_with_every_token_masked_has_no_gradient(trainer):
    trainer.add_experiment("rc-all", LORA, AlgorithmConfig(learning_rate=1e-2, rollout_correction="sequence_mask"))
    before = _adapter_weights(trainer, "rc-all")
    metrics = _step(trainer, "rc-all", [x - 1.0 for x in _lp(trainer, "rc-all")[0]])  # geometric mean e > 2
    assert metrics.rollout_corrected_fraction == 1.0 and metrics.grad_norm == 0.0
    after = _adapter_weights(trainer, "rc-all")
    assert all(torch.equal(before[k], after[k]) for k in before)
