"""The learner's training step, in-process: one MultiAdapterTrainer with its real parts (peft multi-adapter,
DeepSpeed ZeRO-2 on CPU, the tiny Llama), module-scoped so the model loads once (the `trainer` fixture,
tests/conftest.py).

Covers what a step does: the advantage's sign moves the completion's logprob, the free check of the sampler's
logprobs against the version the step starts from, one experiment's step leaves another's weights exactly
unchanged, micro-batching gives the whole-batch step and plain torch's, and a step that fails midway leaves
no stale gradients. Adapter files, resume and error codes: tests/test_learner_adapters.py; the learner process
over HTTP: tests/test_learner_http.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from grpo_server.protocol.worker_config import AlgorithmConfig
from grpo_server.protocol.wire import TrainRequest, TrainSample
from tests.learner_helpers import (COMPLETION, LORA, PROMPT, _adapter_weights, _fresh_base, _logprobs_unpadded, _lp,
                                   _sample)
from tests.tolerances import (LEARNER_SELF, LEARNER_VS_PEFT, SAME_STEP_METRICS, observed, rel_within, same_adam_update,
                              within)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_advantage_sign_moves_the_completion_logprob(trainer, advantage):
    name = "up" if advantage > 0 else "down"
    trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=5e-3))
    before = sum(_lp(trainer, name)[0])
    for _ in range(4):  # on-policy: the sampler logprobs are the current policy's
        metrics = trainer.train(TrainRequest(name=name, samples=[
            _sample(PROMPT, COMPLETION, _lp(trainer, name)[0], advantage, reward=advantage)]))
        assert metrics.tokens == len(COMPLETION) and metrics.grad_norm > 0
    after = sum(_lp(trainer, name)[0])
    assert metrics.step == 4 and observed(LEARNER_SELF, abs(metrics.ratio_mean - 1.0)) and metrics.reward_mean == advantage
    assert (after - before) * advantage > 0.5, (before, after)


def test_a_step_compares_the_sampler_logprobs_of_the_version_it_starts_from(trainer):
    """The free check (grpo_server/runtime/verification.py): samples of the version the weights are at have their
    sampler logprobs compared with the learner's own; other versions' samples, and any sample once a step
    has moved the weights past the last saved version, are not."""
    def step(policy_version: int, offset: float):
        own = _lp(trainer, "gap")[0]
        return trainer.train(TrainRequest(name="gap", samples=[
            TrainSample(prompt_token_ids=PROMPT, completion_token_ids=COMPLETION,
                        sampler_logprobs=[min(x + offset, 0.0) for x in own], advantage=1.0, reward=1.0,
                        policy_version=policy_version),
            TrainSample(prompt_token_ids=PROMPT[:3], completion_token_ids=COMPLETION[:2], sampler_logprobs=[-3.0, -4.0],
                        advantage=-1.0, reward=0.0, policy_version=policy_version - 1)]))

    trainer.add_experiment("gap", LORA, AlgorithmConfig(learning_rate=1e-2))
    first = step(policy_version=0, offset=0.0)  # fresh: the weights are v0's
    assert first.checked_version == 0 and first.sampler_gap_tokens == len(COMPLETION)
    assert observed(LEARNER_SELF, first.sampler_gap_mean) and observed(LEARNER_SELF, first.sampler_gap_max)
    moved = step(policy_version=0, offset=0.0)  # the weights moved past v0 and nothing was saved
    assert moved.checked_version is None and moved.sampler_gap_tokens == 0
    assert trainer.save_adapter("gap").version == 1
    wrong = step(policy_version=1, offset=-0.25)  # a sampler serving other weights than v1's
    assert wrong.checked_version == 1 and wrong.sampler_gap_tokens == len(COMPLETION)
    assert observed(LEARNER_SELF, abs(wrong.sampler_gap_mean - 0.25)) and observed(LEARNER_SELF, abs(wrong.sampler_gap_max - 0.25))


def test_stepping_one_experiment_leaves_the_other_exactly_unchanged(trainer):
    trainer.add_experiment("iso-a", LORA, AlgorithmConfig(learning_rate=1e-2))
    trainer.add_experiment("iso-b", LORA, AlgorithmConfig(learning_rate=1e-2))
    a0, b0 = _adapter_weights(trainer, "iso-a"), _adapter_weights(trainer, "iso-b")
    b_lp = _lp(trainer, "iso-b")
    for advantage in (1.0, -0.5):
        trainer.train(TrainRequest(name="iso-a", samples=[
            _sample(PROMPT, COMPLETION, _lp(trainer, "iso-a")[0], advantage),
            _sample(PROMPT[:3], COMPLETION[:2], [-3.0, -4.0], -advantage)]))
    a1, b1 = _adapter_weights(trainer, "iso-a"), _adapter_weights(trainer, "iso-b")
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)
    assert all(torch.equal(b0[k], b1[k]) for k in b0)
    assert _lp(trainer, "iso-b") == b_lp


def _mixed_batch(trainer, name: str) -> TrainRequest:
    """Five samples of different prompt and completion lengths, off-policy (ratios spread, some clipped),
    sampled at two temperatures (groups of one batch may differ)."""
    g = torch.Generator().manual_seed(7)
    samples = []
    for i, (p, c, adv) in enumerate([(3, 4, 1.2), (7, 1, -0.5), (2, 6, 0.3), (5, 3, -1.0), (9, 2, 0.7)]):
        prompt = torch.randint(3, 4000, (p,), generator=g).tolist()
        completion = torch.randint(3, 4000, (c,), generator=g).tolist()
        temperature = 0.8 if i % 2 == 0 else 1.0
        current = _lp(trainer, name, prompt, [completion], temperature=temperature)[0]
        noise = (0.3 * torch.randn(c, generator=g)).tolist()
        samples.append(_sample(prompt, completion, [min(x + n, 0.0) for x, n in zip(current, noise)], adv, float(i),
                               temperature))
    return TrainRequest(name=name, samples=samples, max_tokens=8)


def _assert_same_adam_update(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    """Weights after the same AdamW steps, up to float noise.

    Adam's first steps move each weight by about lr * g / (|g| + eps): where a gradient element is of
    the size of eps (1e-8), float noise in g shows as a visible difference, so a few elements in a
    thousand may differ; a lost or double-counted micro-batch changes the direction of a large share.
    The scale is checked by the grad norm, and what the odd elements do to the model by its logprobs.
    """
    assert same_adam_update(a, b), key


@pytest.mark.parametrize("loss,beta", [("grpo", 0.0), ("dapo", 0.05)])
def test_micro_batched_step_equals_whole_batch_step_and_plain_torch(trainer, tiny_model_dir, loss, beta):
    from peft import PeftModel

    from learner.policy_loss import BatchNormalizer, LossSettings, policy_loss

    # The clip as this test was calibrated with (0.2/0.28, not grpo's default 0.2/0.2): with a symmetric clip a
    # few more elements' gradients sit near 0, where Adam's normalised update amplifies float noise.
    algo = dict(loss=loss, beta=beta, learning_rate=2e-3, weight_decay=0.01, max_grad_norm=0.5, clip_low=0.2,
                clip_high=0.28)
    whole, micro = f"whole-{loss}", f"micro-{loss}"
    v0 = Path(trainer.add_experiment(whole, LORA, AlgorithmConfig(micro_batch_size=64, **algo)).path)
    # The same starting weights for all three: `micro` resumes from a copy of `whole`'s v0.
    shutil.copytree(v0, v0.parent.parent / micro / "v000000")
    trainer.add_experiment(micro, LORA, AlgorithmConfig(micro_batch_size=2, **algo))
    reference = PeftModel.from_pretrained(_fresh_base(tiny_model_dir), str(v0), is_trainable=True).train()
    ref_params = {n.replace(".default.", "."): p for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(ref_params.values(), lr=algo["learning_rate"], weight_decay=algo["weight_decay"])
    request = _mixed_batch(trainer, whole)
    resolved = AlgorithmConfig(**algo)  # the loss's clip defaults, as the trainer resolved them
    settings = LossSettings(loss, resolved.clip_low, resolved.clip_high, beta)
    norm = BatchNormalizer(len(request.samples), sum(len(s.completion_token_ids) for s in request.samples), 8)
    initial = [_lp(trainer, whole, s.prompt_token_ids, [s.completion_token_ids], s.temperature)[0]
               for s in request.samples]
    moved: list[float] = []

    for step in (1, 2):  # the second step moves lora_A too (B != 0 after the first)
        m_whole, m_micro = trainer.train(request), trainer.train(request.model_copy(update={"name": micro}))
        # Plain torch: one unpadded sequence at a time, gradients summed, one clipped AdamW step.
        optimizer.zero_grad()
        total = 0.0
        for s in request.samples:
            logp_C = _logprobs_unpadded(reference, s.prompt_token_ids, s.completion_token_ids, s.temperature)
            ref_logp_C = None
            if beta > 0:
                with torch.no_grad(), reference.disable_adapter():
                    ref_logp_C = _logprobs_unpadded(reference, s.prompt_token_ids, s.completion_token_ids,
                                                    s.temperature)
            loss_value, _ = policy_loss(logp_C[None], torch.tensor([s.sampler_logprobs]), torch.tensor([s.advantage]),
                                        torch.ones(1, len(logp_C)), settings, norm,
                                        None if ref_logp_C is None else ref_logp_C[None])
            loss_value.backward()
            total += float(loss_value.detach())
        ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref_params.values()), algo["max_grad_norm"]))
        optimizer.step()

        assert m_whole.step == m_micro.step == step
        for m in (m_whole, m_micro):
            assert rel_within(SAME_STEP_METRICS, m.grad_norm, ref_norm), (m.grad_norm, ref_norm)
            assert rel_within(SAME_STEP_METRICS, m.loss, total, abs_floor=1e-6), (m.loss, total)
        assert m_whole.grad_norm > algo["max_grad_norm"] or step == 2  # clipping is exercised
        assert m_micro.tokens == m_whole.tokens == norm.num_tokens
        assert rel_within(SAME_STEP_METRICS, m_micro.ratio_mean, m_whole.ratio_mean)
        assert (m_micro.kl is None) == (beta == 0)  # no reference forward, no kl, when beta = 0
        assert beta == 0 or (m_micro.kl > 0) == (step == 2)  # at step 1 the policy is the base model
        w_whole, w_micro = _adapter_weights(trainer, whole), _adapter_weights(trainer, micro)
        assert w_whole.keys() == ref_params.keys()
        for key, ref in ref_params.items():
            _assert_same_adam_update(w_micro[key], w_whole[key], key)
            _assert_same_adam_update(w_micro[key], ref.detach(), key)
    assert any(torch.count_nonzero(v) for k, v in w_micro.items() if ".lora_B." in k)
    # The three models agree on the batch's logprobs, and two steps moved them well beyond that.
    reference.eval()
    for s, before in zip(request.samples, initial):
        with torch.no_grad():
            ref_lp = _logprobs_unpadded(reference, s.prompt_token_ids, s.completion_token_ids, s.temperature)
        for name in (whole, micro):
            got = torch.tensor(_lp(trainer, name, s.prompt_token_ids, [s.completion_token_ids], s.temperature)[0])
            assert within(LEARNER_VS_PEFT, got, ref_lp), (name, got, ref_lp)
        moved.append(float((ref_lp - torch.tensor(before)).abs().max()))
    assert max(moved) > 1e-2, moved


def test_a_failed_step_leaves_no_stale_gradients(trainer, monkeypatch):
    """Out of memory in the middle of a batch: the next step must not add the lost step's gradients."""
    v0 = Path(trainer.add_experiment("fail-whole", LORA, AlgorithmConfig(micro_batch_size=64)).path)
    shutil.copytree(v0, v0.parent.parent / "fail-micro" / "v000000")
    trainer.add_experiment("fail-micro", LORA, AlgorithmConfig(micro_batch_size=1))
    request = _mixed_batch(trainer, "fail-whole").model_copy(update={"name": "fail-micro"})
    real_forward, calls = trainer._completion_logp, []

    def out_of_memory_at_the_third_micro_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected: out of memory")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(trainer, "_completion_logp", out_of_memory_at_the_third_micro_batch)
    with pytest.raises(MemoryError):
        trainer.train(request)
    monkeypatch.setattr(trainer, "_completion_logp", real_forward)
    assert trainer.status()["fail-micro"]["step"] == 0
    whole = trainer.train(request.model_copy(update={"name": "fail-whole"}))
    micro = trainer.train(request)
    assert micro.step == whole.step == 1
    assert rel_within(SAME_STEP_METRICS, micro.grad_norm, whole.grad_norm), (micro.grad_norm, whole.grad_norm)


def test_a_bf16_autocast_step_trains_and_leaves_the_free_check_out(trainer):
    """`learner.autocast`: the step's forward and backward in bf16, the weights and AdamW in float32. Its logprobs
    are not the float32 samplers', so the free check is off; `logprobs` (the push check's probe) stays float32."""
    trainer.add_experiment("bf16", LORA, AlgorithmConfig(learning_rate=5e-3))
    before = _lp(trainer, "bf16")[0]
    trainer.autocast = True
    try:
        metrics = trainer.train(TrainRequest(name="bf16", samples=[_sample(PROMPT, COMPLETION, before, 1.0, 1.0)]))
        scored_during = _lp(trainer, "bf16")[0]
    finally:
        trainer.autocast = False
    assert _lp(trainer, "bf16")[0] == scored_during  # the probe's scoring is float32 whatever the setting
    assert metrics.checked_version is None and metrics.sampler_gap_tokens == 0
    assert metrics.grad_norm > 0 and 0 < abs(metrics.ratio_mean - 1.0) < 0.1  # bf16 noise against float32
    assert all(p.dtype == torch.float32 for p in trainer.experiments["bf16"].params)
    assert sum(_lp(trainer, "bf16")[0]) > sum(before)  # a positive advantage raised the completion's logprob


@pytest.mark.parametrize("setting, device, dtype, expected", [
    ("off", "cpu", torch.float32, False), ("bfloat16", "cpu", torch.float32, True),
    ("bfloat16", "cpu", torch.bfloat16, False), ("bfloat16", "cuda", torch.float32, False)])
def test_autocast_is_for_a_float32_cpu_learner(setting, device, dtype, expected):
    from grpo_server.protocol.cpu_features import read_cpu_features
    from learner.engine import uses_autocast

    assert uses_autocast(setting, torch.device(device), dtype) is expected
    assert uses_autocast("auto", torch.device("cpu"), torch.float32) is read_cpu_features().bf16_native
    assert uses_autocast("auto", torch.device("cpu"), torch.float32, dtype_setting="float32") is False  # exact asked
