"""mismatch_kl apart for fresh and stale tokens (learner/policy_loss.py `mismatch_kl_split`,
TrainMetrics.mismatch_kl_fresh and offpolicy_kl_stale): by hand on a small example, then in one real learner step
(the in-process `trainer` fixture, tests/conftest.py) whose batch holds both kinds."""

from __future__ import annotations

import math

import torch

from grpo_server.protocol.worker_config import AlgorithmConfig
from grpo_server.protocol.wire import TrainRequest, TrainSample
from learner.policy_loss import mismatch_kl_split, mismatch_kl_sum
from tests.learner_helpers import COMPLETION, LORA, PROMPT, _lp

LEARNER = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, -1.5], [-0.2, -0.4, -0.9]])
RHO = torch.tensor([[4.0, 0.25, 1.0], [1.8, 2.5, 1.0], [1.1, 1.0, 0.9]])
SAMPLER = LEARNER - RHO.log()
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
FRESH = torch.tensor([False, True, True])


def _k3(rho: float) -> float:
    return rho - 1.0 - math.log(rho)


def test_the_split_counts_each_token_once_on_its_side():
    split = mismatch_kl_split(LEARNER, SAMPLER, MASK, FRESH)
    # Row 0 is stale (3 tokens); rows 1 and 2 fresh, 2 trained tokens each (their masked token not counted).
    assert int(split["stale_tokens"]) == 3 and int(split["fresh_tokens"]) == 4
    assert math.isclose(float(split["offpolicy_stale_sum"]), _k3(4.0) + _k3(0.25) + _k3(1.0), rel_tol=1e-5)
    assert math.isclose(float(split["mismatch_fresh_sum"]), _k3(1.8) + _k3(2.5) + _k3(1.1) + _k3(0.9), rel_tol=1e-5)
    total = float(mismatch_kl_sum(LEARNER, SAMPLER, MASK))
    assert math.isclose(float(split["offpolicy_stale_sum"] + split["mismatch_fresh_sum"]), total, rel_tol=1e-6)


def test_an_all_fresh_batch_has_no_stale_side():
    split = mismatch_kl_split(LEARNER, SAMPLER, MASK, torch.ones(3, dtype=torch.bool))
    assert int(split["stale_tokens"]) == 0 and float(split["offpolicy_stale_sum"]) == 0.0
    assert int(split["fresh_tokens"]) == int(MASK.sum())


def test_a_learner_step_reports_the_fresh_mismatch_apart_from_the_stale_kl(trainer):
    """v1's sequence carries the learner's own v1 logprobs (a float32 sampler's: mismatch ~0); v0's carries v0's,
    which the step after v1 has moved away from: its KL is the policy's change, not numerics."""
    trainer.add_experiment("split", LORA, AlgorithmConfig(learning_rate=5e-2))
    v0_logprobs = _lp(trainer, "split")[0]
    trainer.train(TrainRequest(name="split", samples=[TrainSample(
        prompt_token_ids=PROMPT, completion_token_ids=COMPLETION, sampler_logprobs=v0_logprobs, advantage=1.0,
        reward=1.0, policy_version=0)]))
    assert trainer.save_adapter("split").version == 1
    v1_logprobs = _lp(trainer, "split")[0]
    fresh_completion = COMPLETION[:3]
    metrics = trainer.train(TrainRequest(name="split", samples=[
        TrainSample(prompt_token_ids=PROMPT, completion_token_ids=fresh_completion,
                    sampler_logprobs=_lp(trainer, "split", completions=(fresh_completion,))[0], advantage=1.0,
                    reward=1.0, policy_version=1),
        TrainSample(prompt_token_ids=PROMPT, completion_token_ids=COMPLETION, sampler_logprobs=v0_logprobs,
                    advantage=-1.0, reward=0.0, policy_version=0)]))
    assert v1_logprobs != v0_logprobs  # the first step moved the policy: the stale tokens are off-policy
    assert metrics.mismatch_fresh_tokens == len(fresh_completion) and metrics.offpolicy_stale_tokens == len(COMPLETION)
    assert metrics.mismatch_kl_fresh is not None and metrics.mismatch_kl_fresh < 1e-6
    expected_stale = sum(_k3(math.exp(a - b)) for a, b in zip(v1_logprobs, v0_logprobs)) / len(COMPLETION)
    assert metrics.offpolicy_kl_stale is not None and metrics.offpolicy_kl_stale > 1e-3
    assert math.isclose(metrics.offpolicy_kl_stale, expected_stale, rel_tol=1e-3)
    # The old number mixes both: the token-weighted mean of the two sides.
    n = metrics.mismatch_fresh_tokens + metrics.offpolicy_stale_tokens
    mixed = (metrics.mismatch_kl_fresh * metrics.mismatch_fresh_tokens
             + metrics.offpolicy_kl_stale * metrics.offpolicy_stale_tokens) / n
    assert math.isclose(metrics.mismatch_kl, mixed, rel_tol=1e-5)
    # A step after which nothing was saved: every token stale, no fresh mismatch to report.
    moved = trainer.train(TrainRequest(name="split", samples=[TrainSample(
        prompt_token_ids=PROMPT, completion_token_ids=COMPLETION, sampler_logprobs=v1_logprobs, advantage=1.0,
        reward=1.0, policy_version=1)]))
    assert moved.mismatch_kl_fresh is None and moved.mismatch_fresh_tokens == 0
    assert moved.offpolicy_stale_tokens == len(COMPLETION) and moved.offpolicy_kl_stale > 0
