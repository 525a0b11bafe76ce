"""Tinker's training verbs on the learner (learner/steps.py) and the loss table (grpo_server/protocol/loss_table.py,
learner/tinker_losses.py), on the real trainer: the tiny Llama, peft multi-adapter, DeepSpeed on CPU (the module-scoped
`trainer` fixture, tests/conftest.py), and the verbs' 4xx answers through the learner's real HTTP app.

Covers: each loss against Tinker's written formula; cross_entropy lowers the loss; importance_sampling raises the
rewarded tokens; forward scores as the `logprobs` verb; two forward_backward calls then one optim_step equal one
call and plain torch AdamW (ZeRO 0/1/2, clipped); a state saved and loaded with its optimizer gives the same next
step; LoRA ranks 4 and 8 step apart; the 4xx answers.
"""

from __future__ import annotations

import math
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.loss_table import LOSSES, NATIVE_LOSSES, markdown_table
from grpo_server.protocol.verbs import LearnerVerbs
from grpo_server.protocol.wire import (AdamParams, Datum, DeleteStateRequest, ForwardBackwardRequest, LoadStateRequest,
                                       OptimStepRequest, SaveStateRequest, StatesRequest, TrainRequest)
from grpo_server.protocol.worker_config import AlgorithmConfig, LoraConfig
from tests.learner_helpers import COMPLETION, LORA, PROMPT, TARGETS, _adapter_weights, _fresh_base, _lp, _sample
from tests.tolerances import LEARNER_SELF, SAME_STEP_METRICS, rel_within, same_adam_update, within

ADAM = AdamParams(learning_rate=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.5)


def _sft(prompt: list[int] = PROMPT, completion: list[int] = COMPLETION) -> Datum:
    """Tinker's shift by one: position i predicts token i + 1; the prompt's targets weigh 0."""
    full, weights = prompt + completion, [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": weights})


def _rl(prompt: list[int], completion: list[int], sampler: list[float], advantages: list[float]) -> Datum:
    """An RL datum as Tinker's cookbook builds one: 0 logprob and advantage on the prompt's positions."""
    full, pad = prompt + completion, [0.0] * (len(prompt) - 1)
    return Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "logprobs": pad + sampler,
                                                   "advantages": pad + advantages})


def _fb(name: str, data: list[Datum], loss_fn: str = "cross_entropy", config=None) -> ForwardBackwardRequest:
    return ForwardBackwardRequest(name=name, data=data, loss_fn=loss_fn, loss_fn_config=config)


def _refused(call, status: int, code: str) -> ApiError:
    with pytest.raises(ApiError) as refused:
        call()
    assert (refused.value.status, refused.value.code) == (status, code), refused.value.message
    return refused.value


# --- the table -------------------------------------------------------------------------------------------------


def test_one_table_names_the_losses_everywhere():
    from learner.tinker_losses import LOSS_FUNCTIONS

    assert LOSS_FUNCTIONS.keys() == LOSSES.keys()
    assert AlgorithmConfig.model_json_schema()["properties"]["loss"]["enum"] == list(NATIVE_LOSSES)
    assert set(NATIVE_LOSSES) == {"grpo", "dr_grpo", "dapo", "gspo"}
    assert {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"} <= LOSSES.keys()
    assert all(f"`{name}`" in markdown_table() for name in LOSSES)


def _loss_input(config=None, **inputs):
    from learner.tinker_losses import LossInput

    g = torch.Generator().manual_seed(3)
    logp = (-3.0 * torch.rand(2, 6, generator=g)).requires_grad_()
    valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    base = {"logprobs": (logp.detach() + 0.4 * torch.randn(2, 6, generator=g)).clamp(max=0.0),
            "advantages": torch.tensor([[0.0, 0.0, 1.5, 1.5, -0.5, 2.0], [0.0, -1.0, -1.0, 0.7, 0.0, 0.0]]),
            "weights": torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]])}
    return LossInput(logp, valid, {**base, **inputs}, config or {})


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_each_tinker_loss_is_its_written_formula(name):
    """Tinker's docs' code for each loss, summed over the real positions, and the same gradient."""
    from learner.tinker_losses import LOSS_FUNCTIONS

    config = LOSSES[name].defaults
    x = _loss_input(config)
    out = LOSS_FUNCTIONS[name](x)
    v = x.valid_B_T
    logp, q, a, w = x.logp_B_T[v], x.inputs["logprobs"][v], x.inputs["advantages"][v], x.inputs["weights"][v]
    ratio = torch.exp(logp - q)
    expected = {
        "cross_entropy": lambda: -(w * logp).sum(),
        "importance_sampling": lambda: -(ratio * a).sum(),
        "ppo": lambda: -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a).sum(),
        "cispo": lambda: -(torch.clamp(ratio, 0.8, 1.2).detach() * logp * a).sum(),
        "dro": lambda: -(logp * a - 0.5 * 0.05 * (logp - q) ** 2).sum(),
    }[name]()
    assert torch.allclose(out.loss, expected, rtol=1e-6, atol=1e-6)
    assert torch.allclose(out.elementwise_B_T.sum(), out.loss.detach(), rtol=1e-6, atol=1e-6)
    assert torch.all(out.elementwise_B_T[~v] == 0)
    got, = torch.autograd.grad(out.loss, x.logp_B_T)
    want, = torch.autograd.grad(expected, x.logp_B_T)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NATIVE_LOSSES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_grpo_family_is_policy_loss_with_per_token_shares(name, beta):
    """Through the table the GRPO family is learner/policy_loss.py's own policy_loss (the native step's), and its
    per-position shares add up to it."""
    from learner.policy_loss import BatchNormalizer, LossSettings, policy_loss
    from learner.tinker_losses import LOSS_FUNCTIONS

    adv = torch.tensor([[0.0, 1.5, 1.5, 1.5, 1.5, 1.5], [-1.0, -1.0, 0.0, -1.0, 0.0, 0.0]])
    config = {**LOSSES[name].defaults, "beta": beta}
    x = _loss_input(config, advantages=adv)
    x.norm = BatchNormalizer(num_sequences=3, num_tokens=9, max_tokens=8)
    x.ref_logp_B_T = x.logp_B_T.detach() - 0.2
    del x.inputs["weights"]  # the mask is then where advantages != 0
    out = LOSS_FUNCTIONS[name](x)
    mask = (adv != 0) & x.valid_B_T
    direct, _ = policy_loss(x.logp_B_T, x.inputs["logprobs"], torch.tensor([1.5, -1.0]), mask,
                            LossSettings(name, config["clip_low"], config["clip_high"], beta), x.norm, x.ref_logp_B_T)
    assert torch.equal(out.loss, direct)
    assert math.isclose(float(out.elementwise_B_T.sum()), float(direct.detach()), rel_tol=1e-5, abs_tol=1e-7)
    assert torch.equal(out.mask_B_T, mask)


# --- the verbs on the real trainer -----------------------------------------------------------------------------


def test_forward_scores_what_the_logprobs_verb_scores_and_cross_entropy_lowers_the_loss(trainer):
    trainer.add_experiment("sft", LORA, AlgorithmConfig())
    batch = [_sft(), _sft(PROMPT[:3], COMPLETION[1:])]
    losses = []
    for _ in range(4):
        before = trainer.forward(_fb("sft", batch))
        out = trainer.forward_backward(_fb("sft", batch))
        assert rel_within(SAME_STEP_METRICS, out.metrics["loss:sum"], before.metrics["loss:sum"])
        losses.append(out.metrics["loss:sum"])
        step = trainer.optim_step(OptimStepRequest(name="sft", adam_params=AdamParams(learning_rate=1e-2)))
    assert step.step == 4 and step.metrics["grad_norm:mean"] > 0 and step.metrics["learning_rate:mean"] == 1e-2
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    after = trainer.forward(_fb("sft", batch))
    assert after.metrics["loss:sum"] < losses[-1] and after.metrics["num_tokens:sum"] == len(COMPLETION) * 2 - 1
    # The moved adapter's logprobs, per position: the completion's are the `logprobs` verb's.
    P = len(PROMPT)
    assert within(LEARNER_SELF, after.loss_fn_outputs[0]["logprobs"][P - 1:], _lp(trainer, "sft")[0])
    assert len(after.loss_fn_outputs[0]["logprobs"]) == len(batch[0].tokens)
    # elementwise_loss: -logp on the weighted positions, 0 on the prompt's.
    first = after.loss_fn_outputs[0]
    assert first["elementwise_loss"][:P - 1] == [0.0] * (P - 1)
    assert within(LEARNER_SELF, first["elementwise_loss"][P - 1:], [-v for v in first["logprobs"][P - 1:]])


def test_importance_sampling_raises_the_rewarded_tokens_and_reports_the_sampler_gap(trainer):
    trainer.add_experiment("is", LORA, AlgorithmConfig())
    before = _lp(trainer, "is")[0]
    out = trainer.forward_backward(_fb("is", [_rl(PROMPT, COMPLETION, before, [1.0] * len(COMPLETION))],
                                       "importance_sampling"))
    assert out.metrics["sampler_logprob_gap:mean"] <= LEARNER_SELF.bound  # on-policy: the sampler is the learner
    assert abs(out.metrics["mismatch_kl:mean"]) <= LEARNER_SELF.bound
    trainer.optim_step(OptimStepRequest(name="is", adam_params=AdamParams(learning_rate=5e-3)))
    after = _lp(trainer, "is")[0]
    assert sum(after) - sum(before) > 0.1, (before, after)
    # A sampler 0.25 nats off on every token: the gap says so.
    shifted = [x - 0.25 for x in after]
    off = trainer.forward(_fb("is", [_rl(PROMPT, COMPLETION, shifted, [1.0] * len(COMPLETION))], "importance_sampling"))
    assert abs(off.metrics["sampler_logprob_gap:mean"] - 0.25) <= 1e-4
    assert off.metrics["mismatch_kl:mean"] > 0 and off.metrics["num_tokens:sum"] == len(COMPLETION)


def _offpolicy_batch(trainer, name: str) -> list[Datum]:
    """Four datums of different lengths, sampler logprobs off the learner's by noise (ratios spread, some
    clipped), advantages per token."""
    g = torch.Generator().manual_seed(11)
    data = []
    for p, c in [(3, 4), (7, 2), (2, 6), (5, 3)]:
        prompt, completion = (torch.randint(3, 4000, (n,), generator=g).tolist() for n in (p, c))
        current = _lp(trainer, name, prompt, [completion])[0]
        noise = (0.3 * torch.randn(c, generator=g)).tolist()
        advantages = torch.randn(c, generator=g).tolist()
        data.append(_rl(prompt, completion, [min(x + n, 0.0) for x, n in zip(current, noise)], advantages))
    return data


def _reference_step(model, params, optimizer, data: list[Datum]) -> float:
    """Plain torch: one unpadded datum at a time, ppo's loss summed, clipped, one AdamW step."""
    from learner.policy_loss import token_logprobs
    from learner.tinker_losses import LossInput, ppo

    optimizer.zero_grad()
    for d in data:
        ids = torch.tensor([d.tokens])
        logp = token_logprobs(model(input_ids=ids).logits, torch.tensor([d.loss_fn_inputs["target_tokens"]]))
        inputs = {k: torch.tensor([v], dtype=torch.float32) for k, v in d.loss_fn_inputs.items()
                  if k != "target_tokens"}
        ppo(LossInput(logp, torch.ones_like(logp, dtype=torch.bool), inputs, LOSSES["ppo"].defaults)).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(params, ADAM.grad_clip_norm))
    optimizer.step()
    return norm


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_calls_then_one_step_equal_one_call_and_plain_torch(trainer, tiny_model_dir, stage):
    from peft import PeftModel

    split, whole = f"acc-split-{stage}", f"acc-whole-{stage}"
    trainer.config.zero_stage = stage
    try:
        v0 = Path(trainer.add_experiment(whole, LORA, AlgorithmConfig(micro_batch_size=64)).path)
        shutil.copytree(v0, v0.parent.parent / split / "v000000")  # the same starting weights for all three
        trainer.add_experiment(split, LORA, AlgorithmConfig(micro_batch_size=1))
    finally:
        trainer.config.zero_stage = 2
    reference = PeftModel.from_pretrained(_fresh_base(tiny_model_dir), str(v0), is_trainable=True).train()
    ref_params = {n.replace(".default.", "."): p for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(ref_params.values(), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                                  eps=ADAM.eps, weight_decay=ADAM.weight_decay)
    data = _offpolicy_batch(trainer, whole)
    for step in (1, 2):  # the second step moves lora_A too (B != 0 after the first)
        first = trainer.forward_backward(_fb(split, data[:2], "ppo"))
        second = trainer.forward_backward(_fb(split, data[2:], "ppo"))
        once = trainer.forward_backward(_fb(whole, data, "ppo"))
        assert rel_within(SAME_STEP_METRICS, first.metrics["loss:sum"] + second.metrics["loss:sum"],
                          once.metrics["loss:sum"])
        assert once.metrics["clipped_fraction:mean"] > 0  # the clip is exercised
        m_split = trainer.optim_step(OptimStepRequest(name=split, adam_params=ADAM))
        m_whole = trainer.optim_step(OptimStepRequest(name=whole, adam_params=ADAM))
        ref_norm = _reference_step(reference, list(ref_params.values()), optimizer, data)
        assert step > 1 or ref_norm > ADAM.grad_clip_norm  # so is the gradient clipping
        for m in (m_split, m_whole):
            assert rel_within(SAME_STEP_METRICS, m.metrics["grad_norm:mean"], ref_norm), (m, ref_norm)
        w_split, w_whole = _adapter_weights(trainer, split), _adapter_weights(trainer, whole)
        assert w_split.keys() == ref_params.keys()
        for key, ref in ref_params.items():
            assert same_adam_update(w_split[key], w_whole[key]), key
            assert same_adam_update(w_split[key], ref.detach()), key
    # The step's hyperparameters were for that step only: the experiment's own are back for its native steps.
    group = trainer.experiments[split].engine.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (AlgorithmConfig().learning_rate, 0.0, (0.9, 0.999))


def test_lora_ranks_4_and_8_step_apart(trainer):
    trainer.add_experiment("rank4", LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]), AlgorithmConfig())
    trainer.add_experiment("rank8", LORA, AlgorithmConfig())
    for moved, still in (("rank4", "rank8"), ("rank8", "rank4")):
        before_moved, before_still = _adapter_weights(trainer, moved), _adapter_weights(trainer, still)
        for _ in range(2):
            trainer.forward_backward(_fb(moved, [_sft()]))
            trainer.optim_step(OptimStepRequest(name=moved, adam_params=AdamParams(learning_rate=1e-2)))
        after_moved, after_still = _adapter_weights(trainer, moved), _adapter_weights(trainer, still)
        assert any(not torch.equal(before_moved[k], after_moved[k]) for k in before_moved)
        assert all(torch.equal(before_still[k], after_still[k]) for k in before_still)
    shapes = {k: v.shape for k, v in _adapter_weights(trainer, "rank4").items() if "q_proj.lora_A" in k}
    assert all(shape[0] == 4 for shape in shapes.values()) and shapes


def test_a_saved_state_loads_with_its_optimizer_into_another_experiment(trainer):
    from learner import checkpoint

    for name in ("st-a", "st-b", "st-c"):
        trainer.add_experiment(name, LORA, AlgorithmConfig())
    data = _offpolicy_batch(trainer, "st-a")
    for _ in range(2):  # AdamW moments worth keeping
        trainer.forward_backward(_fb("st-a", data, "ppo"))
        trainer.optim_step(OptimStepRequest(name="st-a", adam_params=ADAM))
    saved = trainer.save_state(SaveStateRequest(name="st-a", label="s1"))
    trainer.save_state(SaveStateRequest(name="st-a", label="w1", with_optimizer=False))
    assert saved.step == 2 and saved.with_optimizer and Path(saved.path).parent.parent == \
        checkpoint.checkpoint_root(trainer.config.run_dir, "st-a").resolve()  # archived with the experiment
    assert saved.lora == LORA.model_dump(mode="json")  # what an experiment to load it into is created with
    _refused(lambda: trainer.save_state(SaveStateRequest(name="st-a", label="s1")), 409, "state_exists")
    assert trainer.save_state(SaveStateRequest(name="st-a", label="s1", overwrite=True)).step == 2
    listed = trainer.list_states(StatesRequest(name="st-a")).states
    assert [(s.label, s.with_optimizer) for s in listed] == [("w1", False), ("s1", True)]  # oldest first
    trainer.load_state(LoadStateRequest(name="st-b", label="s1", source="st-a", with_optimizer=True))
    trainer.load_state(LoadStateRequest(name="st-c", label="s1", source="st-a"))  # weights only: AdamW afresh
    a, b = _adapter_weights(trainer, "st-a"), _adapter_weights(trainer, "st-b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("st-a", "st-b", "st-c"):
        trainer.forward_backward(_fb(name, data, "ppo"))
        trainer.optim_step(OptimStepRequest(name=name, adam_params=ADAM))
    a, b, c = (_adapter_weights(trainer, name) for name in ("st-a", "st-b", "st-c"))
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in a)  # the same next step
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-4  # without the moments, another step
    _refused(lambda: trainer.load_state(LoadStateRequest(name="st-b", label="w1", source="st-a", with_optimizer=True)),
             409, "no_optimizer_state")
    trainer.add_experiment("st-r4", LoraConfig(r=4, alpha=16, target_modules=TARGETS), AlgorithmConfig())
    mismatch = _refused(lambda: trainer.load_state(LoadStateRequest(name="st-r4", label="s1", source="st-a")), 409,
                        "adapter_mismatch")
    assert "'r': 4" in mismatch.message
    assert trainer.delete_state(DeleteStateRequest(name="st-a", label="w1")).label == "w1"
    assert [s.label for s in trainer.list_states(StatesRequest(name="st-a")).states] == ["s1"]
    _refused(lambda: trainer.delete_state(DeleteStateRequest(name="st-a", label="w1")), 404, "state_not_found")


def test_pending_gradients_keep_native_steps_out_and_a_step_needs_them(trainer):
    trainer.add_experiment("mixed", LORA, AlgorithmConfig())
    _refused(lambda: trainer.optim_step(OptimStepRequest(name="mixed")), 409, "no_gradients")
    trainer.forward_backward(_fb("mixed", [_sft()]))
    native = TrainRequest(name="mixed", samples=[_sample(PROMPT, COMPLETION, _lp(trainer, "mixed")[0], 1.0)])
    _refused(lambda: trainer.train(native), 409, "gradients_pending")
    trainer.optim_step(OptimStepRequest(name="mixed"))
    assert trainer.train(TrainRequest(name="mixed", samples=[
        _sample(PROMPT, COMPLETION, _lp(trainer, "mixed")[0], 1.0)])).step == 2


def test_several_ranks_refuse_the_verbs_that_move_weights_before_any_collective(trainer, monkeypatch):
    """With N ranks rank 0 answers every Tinker verb alone (learner/lockstep.py): forward and the listing work, the
    others are a 409 before anything is published to the followers (none here: one asked to join would hang)."""
    from learner.lockstep import LockstepTrainer

    trainer.add_experiment("ranks", LORA, AlgorithmConfig())
    lockstep = LockstepTrainer(trainer, channel=None, followers=None, on_broken=lambda reason: None,
                               outcome_timeout_s=1.0)
    monkeypatch.setattr(trainer, "world_size", 2)
    assert lockstep.forward(_fb("ranks", [_sft()])).metrics["num_tokens:sum"] == len(COMPLETION)
    assert lockstep.list_states(StatesRequest(name="ranks")).states == []
    for call in (lambda: lockstep.forward_backward(_fb("ranks", [_sft()])),
                 lambda: lockstep.optim_step(OptimStepRequest(name="ranks")),
                 lambda: lockstep.save_state(SaveStateRequest(name="ranks", label="x")),
                 lambda: lockstep.load_state(LoadStateRequest(name="ranks", label="x"))):
        _refused(call, 409, "multi_rank_unsupported")
    assert trainer.experiments["ranks"].pending_backwards == 0


# --- over HTTP: the learner's app, LearnerClient and the front end's transport ------------------------------------


@pytest.fixture
async def learner(trainer):
    """The learner's real app on the module's trainer, through LearnerClient over the front end's transport."""
    import aiohttp
    from aiohttp import web

    from grpo_server.protocol.verbs import LearnerClient
    from grpo_server.protocol.worker_auth import auth_headers
    from grpo_server.workers.pool import WorkerConnection
    from learner.app import create_app
    from tests.serving import WORKER_SECRET

    runner = web.AppRunner(create_app(trainer, trainer.config.run_dir, WORKER_SECRET))
    await runner.setup()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    process = SimpleNamespace(name="learner", url=f"http://127.0.0.1:{port}", ready=True, state="ready")
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        yield LearnerClient(WorkerConnection(process, session, timeout_s=120))
    await runner.cleanup()


async def test_the_verbs_over_http_and_their_4xx_answers(trainer, learner):
    trainer.add_experiment("web", LORA, AlgorithmConfig())
    out = await learner.forward_backward(_fb("web", [good := _sft()]))
    assert len(out.loss_fn_outputs[0]["logprobs"]) == len(good.tokens) and out.metrics["loss:sum"] > 0
    assert (await learner.optim_step("web", AdamParams(learning_rate=1e-3))).step == 1
    assert (await learner.save_state("web", "http-1")).with_optimizer
    assert [s.label for s in (await learner.list_states("web")).states] == ["http-1"]
    assert (await learner.load_state("web", "http-1", with_optimizer=True)).step == 1

    def bad(**inputs) -> Datum:
        return Datum(tokens=inputs.pop("tokens", good.tokens), loss_fn_inputs={**good.loss_fn_inputs, **inputs})

    n, vocab = len(good.tokens), trainer.vocab_size
    targets_only = Datum(tokens=good.tokens, loss_fn_inputs={"target_tokens": good.loss_fn_inputs["target_tokens"]})
    cases = [
        (_fb("nobody", [good]), 404, "nobody"),
        (_fb("web", [good], "dpo"), 400, "cross_entropy"),  # names the table's losses
        (_fb("web", [targets_only]), 400, "weights"),
        (_fb("web", [bad(weights=[1.0] * (n - 1))]), 400, "values for"),
        (_fb("web", [bad(tokens=[vocab] + good.tokens[1:])]), 400, "token id"),
        (_fb("web", [bad(target_tokens=[0] * (n - 1) + [-1])]), 400, "token id"),
        (_fb("web", [bad(tokens=[5] * 65, target_tokens=[5] * 65, weights=[1.0] * 65)]), 400, "max_model_len"),
        (_fb("web", [bad(advantages=[1.0] * n)]), 400, "advantages"),  # not cross_entropy's
        (_fb("web", [good], config={"beta": 1.0}), 400, "loss_fn_config"),
        (_fb("web", [_rl(PROMPT, COMPLETION, [-1.0] * 5, [1.0] * 5)], "ppo", {"clip_low_threshold": 1.5}), 400, "1.5"),
        (_fb("web", [_rl(PROMPT, COMPLETION, [-1.0] * 5, [1.0, 2.0, 1.0, 1.0, 1.0])], "grpo"), 400, "one advantage"),
    ]
    for request, status, words in cases:
        for verb in (learner.forward, learner.forward_backward):
            with pytest.raises(ApiError) as refused:
                await verb(request)
            assert refused.value.status == status and words in refused.value.message, (request, refused.value.message)
    # None of them left a gradient behind.
    with pytest.raises(ApiError, match="no gradients"):
        await learner.optim_step("web")
    with pytest.raises(ApiError, match="no saved state 'no-such-state'"):  # a 404 state_not_found
        await learner.load_state("web", "no-such-state")
    with pytest.raises(ApiError) as path:  # a label is a folder name, never a path
        await learner.transport.request(LearnerVerbs.save_state, SaveStateRequest.model_construct(
            name="web", label="../escape", with_optimizer=True))
    assert path.value.status == 400
    assert (await learner.delete_state("web", "http-1")).label == "http-1"
