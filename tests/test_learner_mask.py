"""Multi-turn episodes trained as one sequence: `TrainSample.loss_mask` (1 = a token the model sampled, 0 = context
only: tool results, user turns, template tokens between turns, whose sampler logprobs are placeholders).

In-process, with the module-scoped `trainer` fixture (tests/conftest.py). Experiments that must start from the same
weights share one v0 (copied into the others' folders, so they resume from it with a fresh optimizer), and two steps
are compared exactly: a token with mask 0 must change nothing (loss, statistics, weights), one with mask 1 must.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.worker_config import AlgorithmConfig
from grpo_server.protocol.wire import TrainRequest, TrainSample
from learner.batching import Sequence, check_sequence, make_micro_batches
from tests.learner_helpers import LORA, PROMPT, _adapter_weights, _lp
from tests.tolerances import LEARNER_SELF, SAME_STEP_METRICS, observed, rel_within, same_adam_update

# Turn 1 (model), a tool result (context), turn 2 (model), the template's end-of-turn tokens (context).
EPISODE = [3946, 314, 700, 701, 702, 253, 1789, 2, 50, 51]
MASK = [1, 1, 0, 0, 0, 1, 1, 1, 0, 0]
TRAINED = sum(MASK)
OTHER_PROMPT, OTHER_COMPLETION = [1, 88, 99], [400, 401, 402, 403]  # a plain sample, so the batch pads


def _from_same_start(trainer, names: list[str], algo: AlgorithmConfig) -> None:
    """Add the experiments `names`, all starting at the first one's v0 weights, each with a fresh optimizer."""
    v0 = Path(trainer.add_experiment(names[0], LORA, algo).path)
    for name in names[1:]:
        shutil.copytree(v0, v0.parent.parent / name / "v000000")
        trainer.add_experiment(name, LORA, algo)


def _off_policy(trainer, name: str, prompt: list[int], completion: list[int], seed: int) -> list[float]:
    """The current policy's logprobs, moved by noise so the ratios are spread (some clipped)."""
    g = torch.Generator().manual_seed(seed)
    current = _lp(trainer, name, prompt, [completion])[0]
    return [min(x + 0.4 * float(torch.randn((), generator=g)), 0.0) for x in current]


def _episode(completion, logprobs, mask, advantage=1.0, policy_version=0) -> TrainSample:
    return TrainSample(prompt_token_ids=PROMPT, completion_token_ids=completion, sampler_logprobs=logprobs,
                       advantage=advantage, reward=advantage, policy_version=policy_version, loss_mask=mask)


def _batch(trainer, name: str, episode: TrainSample) -> TrainRequest:
    other = TrainSample(prompt_token_ids=OTHER_PROMPT, completion_token_ids=OTHER_COMPLETION,
                        sampler_logprobs=_off_policy(trainer, name, OTHER_PROMPT, OTHER_COMPLETION, seed=1),
                        advantage=-0.7, reward=0.0, policy_version=0)
    return TrainRequest(name=name, samples=[episode, other], max_tokens=16)


def _train_twice(trainer, requests: dict[str, TrainRequest]) -> dict[str, list]:
    """Two steps of each experiment on its request; each step's metrics and the weights after it."""
    out: dict[str, list] = {name: [] for name in requests}
    for _ in range(2):  # the second step moves lora_A too (B != 0 after the first)
        for name, request in requests.items():
            out[name].append((trainer.train(request), _adapter_weights(trainer, name)))
    return out


def _stats(metrics) -> dict:
    return metrics.model_dump(exclude={"seconds", "sampler_gap_mean", "sampler_gap_max", "checked_version"})


@pytest.mark.parametrize("loss,beta", [("grpo", 0.0), ("dapo", 0.05), ("gspo", 0.0)])
def test_masked_tokens_contribute_nothing_and_trained_ones_do(trainer, loss, beta):
    names = [f"m-{loss}-{k}" for k in ("ref", "ctx", "lp", "id")]
    # A clip wide enough for these off-policy logprobs (gspo's own default, 3e-4, clips every sequence here).
    _from_same_start(trainer, names, AlgorithmConfig(loss=loss, beta=beta, learning_rate=2e-3, checkpoint_every=10**6,
                                                     clip_low=0.2, clip_high=0.28))
    real = _off_policy(trainer, names[0], PROMPT, EPISODE, seed=0)
    logprobs = [x if m else 0.0 for x, m in zip(real, MASK)]
    # Different placeholders everywhere, and other ids for the trailing context tokens (earlier context tokens are
    # seen by the model's later tokens: changing them rightly changes the loss).
    ctx_ids = EPISODE[:-2] + [60, 61]
    ctx_logprobs = [x if m else -7.5 for x, m in zip(real, MASK)]
    lp_logprobs = list(logprobs)
    lp_logprobs[6] -= 0.3  # a trained token's sampler logprob
    id_ids = list(EPISODE)
    id_ids[7] = 77  # a trained token's id
    requests = {
        names[0]: _batch(trainer, names[0], _episode(EPISODE, logprobs, MASK)),
        names[1]: _batch(trainer, names[1], _episode(ctx_ids, ctx_logprobs, MASK)),
        names[2]: _batch(trainer, names[2], _episode(EPISODE, lp_logprobs, MASK)),
        names[3]: _batch(trainer, names[3], _episode(id_ids, logprobs, MASK)),
    }
    steps = _train_twice(trainer, requests)
    for (ref, w_ref), (ctx, w_ctx), (lp, w_lp), (ids, w_id) in zip(*(steps[n] for n in names)):
        assert ref.tokens == TRAINED + len(OTHER_COMPLETION)
        assert ref.loss != 0.0 and ref.grad_norm > 0
        assert ctx.loss == ref.loss and ctx.grad_norm == ref.grad_norm
        assert _stats(ctx) | {"step": 0} == _stats(ref) | {"step": 0}  # tokens, ratios, clipping, KL
        assert all(torch.equal(w_ctx[k], w_ref[k]) for k in w_ref)
        for changed, w_changed in ((lp, w_lp), (ids, w_id)):
            assert changed.loss != ref.loss and changed.grad_norm != ref.grad_norm
            assert any(not torch.equal(w_changed[k], w_ref[k]) for k in w_ref)
    assert (ref.kl is not None and ref.kl > 0) == (beta > 0)  # off the base at step 2: KL computed (beta > 0)


@pytest.mark.parametrize("loss", ["grpo", "dapo"])
def test_a_mask_of_all_ones_is_no_mask(trainer, loss):
    names = [f"ones-{loss}", f"none-{loss}"]
    _from_same_start(trainer, names, AlgorithmConfig(loss=loss, learning_rate=2e-3, checkpoint_every=10**6))
    logprobs = _off_policy(trainer, names[0], PROMPT, EPISODE, seed=2)
    steps = _train_twice(trainer, {
        names[0]: _batch(trainer, names[0], _episode(EPISODE, logprobs, [1] * len(EPISODE))),
        names[1]: _batch(trainer, names[1], _episode(EPISODE, logprobs, None)),
    })
    for (ones, w_ones), (none, w_none) in zip(steps[names[0]], steps[names[1]]):
        assert none.tokens == len(EPISODE) + len(OTHER_COMPLETION)
        assert ones.loss == none.loss and ones.grad_norm == none.grad_norm
        assert _stats(ones) == _stats(none)
        assert all(torch.equal(w_ones[k], w_none[k]) for k in w_none)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
def test_trailing_masked_tokens_train_like_the_truncated_completion(trainer, loss):
    """The normalisers count trained tokens only: dapo's whole-batch token count, grpo's sequence lengths."""
    names = [f"trail-{loss}", f"cut-{loss}"]
    # The clip it was calibrated with: grpo's default symmetric clip leaves more gradients near 0, where Adam's
    # normalised first steps amplify float noise past the tolerance below.
    _from_same_start(trainer, names, AlgorithmConfig(loss=loss, learning_rate=2e-3, checkpoint_every=10**6,
                                                     clip_low=0.2, clip_high=0.28))
    cut = EPISODE[:8]
    real = _off_policy(trainer, names[0], PROMPT, cut, seed=3)
    mask = [1] * 8 + [0, 0]
    masked = _train_twice(trainer, {names[0]: _batch(trainer, names[0], _episode(EPISODE, real + [0.0, 0.0], mask))})
    plain = _train_twice(trainer, {names[1]: _batch(trainer, names[1], _episode(cut, real, None))})
    for (a, w_a), (b, w_b) in zip(masked[names[0]], plain[names[1]]):
        assert a.tokens == b.tokens == 8 + len(OTHER_COMPLETION)
        assert rel_within(SAME_STEP_METRICS, a.loss, b.loss, abs_floor=1e-7), (a.loss, b.loss)
        assert rel_within(SAME_STEP_METRICS, a.grad_norm, b.grad_norm), (a.grad_norm, b.grad_norm)
        assert rel_within(SAME_STEP_METRICS, a.ratio_mean, b.ratio_mean)
        # Training one more token instead leaves 0.43-0.98 of grpo's entries within the bound (not 0.99).
        for k in w_b:
            assert same_adam_update(w_a[k], w_b[k]), k


@pytest.mark.parametrize("mask,message", [
    (MASK[:-1], "9 loss_mask entries for 10 completion tokens"),
    (MASK[:-1] + [2], "loss_mask entries must be 0 or 1, got 2"),
    ([0] * len(EPISODE), "loss_mask has no 1"),
])
def test_bad_masks_are_rejected_before_any_step(trainer, mask, message):
    name = "bad-mask"
    if name not in trainer.experiments:
        trainer.add_experiment(name, LORA, AlgorithmConfig())
    before = _adapter_weights(trainer, name)
    good = _episode(EPISODE, [-1.0] * len(EPISODE), MASK)
    bad = _episode(EPISODE, [-1.0] * len(EPISODE), mask)
    with pytest.raises(BadRequest) as raised:
        trainer.train(TrainRequest(name=name, samples=[good, bad]))
    assert raised.value.message.startswith("samples[1]: ") and message in raised.value.message
    assert trainer.status()[name]["step"] == 0
    after = _adapter_weights(trainer, name)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_sampler_gap_counts_only_the_model_s_tokens(trainer):
    """Placeholders (0.0 here, far from any real logprob) are not compared with the learner's logprobs."""
    trainer.add_experiment("gap-mask", LORA, AlgorithmConfig(learning_rate=1e-2))
    own = _lp(trainer, "gap-mask", PROMPT, [EPISODE])[0]  # the weights are v0's: exactly what v0 sampled
    assert max(abs(x) for x, m in zip(own, MASK) if not m) > 1.0  # the placeholders would show
    metrics = trainer.train(TrainRequest(name="gap-mask", samples=[
        _episode(EPISODE, [x if m else 0.0 for x, m in zip(own, MASK)], MASK, policy_version=0)]))
    assert metrics.checked_version == 0 and metrics.tokens == TRAINED
    assert metrics.sampler_gap_tokens == TRAINED
    assert observed(LEARNER_SELF, metrics.sampler_gap_mean) and observed(LEARNER_SELF, metrics.sampler_gap_max)
    assert observed(LEARNER_SELF, abs(metrics.ratio_mean - 1.0)) and observed(LEARNER_SELF, abs(metrics.ratio_max - 1.0))


def test_a_sample_sampled_under_a_grammar_is_trained_but_not_checked(trainer):
    """A forced tool call's logprobs are renormalised over what the grammar allowed (0 for a forced token), so
    they differ from the learner's by design: the free check must skip it, or it would fail the version."""
    trainer.add_experiment("gap-grammar", LORA, AlgorithmConfig(learning_rate=1e-2))
    own = _lp(trainer, "gap-grammar", PROMPT, [EPISODE])[0]
    forced = [0.0 if i % 2 else x for i, x in enumerate(own)]  # as a grammar would leave them
    sample = _episode(EPISODE, forced, None, policy_version=0).model_copy(update={"constrained": True})
    metrics = trainer.train(TrainRequest(name="gap-grammar", samples=[sample]))
    assert metrics.checked_version == 0 and metrics.tokens == len(EPISODE)
    assert metrics.sampler_gap_tokens == 0


def test_collate_masks_untrained_tokens_and_zeroes_their_placeholders():
    seqs = [Sequence([1, 2], [5, 6, 7, 8], [-1.0, 3.0, float("nan"), -2.0], 1.0, loss_mask=[1, 0, 0, 1]),
            Sequence([1, 2, 3], [9, 10], [-0.5, -0.25])]
    for i, seq in enumerate(seqs):
        check_sequence(seq, vocab_size=100, max_model_len=64, where=f"samples[{i}]")  # placeholders are not checked
    (batch,) = make_micro_batches(seqs, micro_batch_size=8)
    row = {index: r for r, index in enumerate(batch.indices)}
    assert batch.mask_B_C[row[0]].tolist() == [True, False, False, True]
    assert batch.mask_B_C[row[1]].tolist() == [True, True, False, False]
    assert batch.old_logp_B_C[row[0]].tolist() == [-1.0, 0.0, 0.0, -2.0]
    assert batch.num_tokens == 4
    with pytest.raises(BadRequest, match=r"samples\[0\]: sampler_logprobs must be finite and <= 0 where loss_mask is 1"):
        check_sequence(Sequence([1], [5, 6], [-1.0, 3.0], loss_mask=[1, 1]), 100, 64, "samples[0]")
