"""The learner's adapters and experiments on disk, in-process (the module-scoped `trainer` fixture,
tests/conftest.py: peft multi-adapter, DeepSpeed ZeRO-2 on CPU, the tiny Llama).

Covers the adapter files (v0 is the base model in plain peft format; a saved version bumps the number and
loads in peft with the trainer's logprobs), re-adding a removed experiment and resuming a checkpoint
(weights, optimizer and step exactly), and the error codes of bad requests. Training steps:
tests/test_learner.py; the learner process over HTTP: tests/test_learner_http.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from grpo_server.protocol.worker_config import AlgorithmConfig, LoraConfig
from grpo_server.protocol.wire import LogprobsRequest, TrainRequest
from tests.learner_helpers import (COMPLETION, LORA, PROMPT, TARGETS, _adapter_weights, _fresh_base,
                                   _logprobs_unpadded, _lp, _sample)
from tests.tolerances import LEARNER_VS_PEFT, ZERO_ADAPTER, within


def test_v0_adapter_is_the_base_model_in_plain_peft_format(trainer, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file

    version = trainer.add_experiment("zero", LORA, AlgorithmConfig())
    assert version.version == 0 and Path(version.path).name == "v000000"
    folder = Path(version.path)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    # Exactly lora_A / lora_B of the target modules, named as peft and vLLM expect: no adapter name, no embeddings.
    pattern = re.compile(r"base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.(q_proj|v_proj|down_proj)"
                         r"\.lora_[AB]\.weight")
    assert all(pattern.fullmatch(k) for k in tensors), [k for k in tensors if not pattern.fullmatch(k)]
    assert len(tensors) == 2 * len(TARGETS) * 2  # 2 layers x 3 modules x (A, B)
    assert all(torch.count_nonzero(v) == 0 for k, v in tensors.items() if ".lora_B." in k)
    assert all(torch.count_nonzero(v) > 0 for k, v in tensors.items() if ".lora_A." in k)

    base = _fresh_base(tiny_model_dir)
    with torch.no_grad():
        base_lp = _logprobs_unpadded(base, PROMPT, COMPLETION, 0.7)
        peft_lp = _logprobs_unpadded(PeftModel.from_pretrained(base, str(folder)).eval(), PROMPT, COMPLETION, 0.7)
    trainer_lp = torch.tensor(_lp(trainer, "zero", temperature=0.7)[0])
    assert within(ZERO_ADAPTER, peft_lp, base_lp), (peft_lp, base_lp)
    assert within(ZERO_ADAPTER, trainer_lp, base_lp), (trainer_lp, base_lp)

def test_save_adapter_bumps_version_and_loads_in_peft_with_the_same_logprobs(trainer, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file

    trainer.add_experiment("saved", LORA, AlgorithmConfig(learning_rate=1e-2))
    for _ in range(2):
        trainer.train(TrainRequest(name="saved", samples=[_sample(PROMPT, COMPLETION, _lp(trainer, "saved")[0], 1.0)]))
    version = trainer.save_adapter("saved")
    assert version.version == 1 and Path(version.path).name == "v000001"
    tensors = load_file(str(Path(version.path) / "adapter_model.safetensors"))
    assert set(tensors) == set(load_file(str(Path(version.path).parent / "v000000" / "adapter_model.safetensors")))
    assert any(torch.count_nonzero(v) for k, v in tensors.items() if ".lora_B." in k)
    completions = [COMPLETION, COMPLETION[:2], [42, 43, 44, 45, 46, 47, 48]]
    expected = _lp(trainer, "saved", completions=completions)
    model = PeftModel.from_pretrained(_fresh_base(tiny_model_dir), version.path).eval()
    with torch.no_grad():
        for completion, row in zip(completions, expected):
            got = _logprobs_unpadded(model, PROMPT, completion)
            assert len(row) == len(completion)
            assert within(LEARNER_VS_PEFT, got, row), (got, row)
    assert trainer.save_adapter("saved").version == 2
    assert trainer.status()["saved"] == {"step": 2, "version": 2, "resident": True,
                                         "path": str(Path(version.path).parent / "v000002")}


def test_readding_a_removed_experiment_resumes_its_latest_version(trainer):
    from grpo_server.protocol.errors import ApiError

    trainer.add_experiment("resume", LORA, AlgorithmConfig(learning_rate=1e-2))
    trainer.train(TrainRequest(name="resume", samples=[_sample(PROMPT, COMPLETION, _lp(trainer, "resume")[0], 1.0)]))
    saved = trainer.save_adapter("resume")
    trained_lp = _lp(trainer, "resume")
    trainer.remove_experiment("resume")
    assert "resume" not in trainer.status() and "exp_resume" not in trainer.model.peft_config
    assert (Path(saved.path) / "adapter_model.safetensors").is_file()  # the files stay
    with pytest.raises(ApiError) as err:
        _lp(trainer, "resume")
    assert err.value.status == 404
    with pytest.raises(ApiError) as err:  # another shape than the adapter on disk
        trainer.add_experiment("resume", LoraConfig(r=4, alpha=16, target_modules=TARGETS), AlgorithmConfig())
    assert (err.value.code, err.value.status) == ("adapter_mismatch", 409)

    again = trainer.add_experiment("resume", LORA, AlgorithmConfig(learning_rate=1e-2))
    assert again.version == 1 and again.path == saved.path
    assert trainer.status()["resume"]["step"] == 1
    assert _lp(trainer, "resume") == trained_lp
    metrics = trainer.train(TrainRequest(name="resume", samples=[_sample(PROMPT, COMPLETION, trained_lp[0], 1.0)]))
    assert metrics.step == 2 and trainer.save_adapter("resume").version == 2


def test_bad_requests_get_the_right_error_codes(trainer):
    from grpo_server.protocol.errors import ApiError

    def code_of(fn, *args):
        with pytest.raises(ApiError) as err:
            fn(*args)
        return err.value.code, err.value.status

    ok = [-1.0] * len(COMPLETION)
    assert code_of(trainer.train, TrainRequest(name="nope", samples=[_sample(PROMPT, COMPLETION, ok, 1.0)])) == (
        "not_found", 404)
    assert code_of(trainer.save_adapter, "nope") == ("not_found", 404)
    assert code_of(trainer.remove_experiment, "nope") == ("not_found", 404)
    trainer.add_experiment("bad", LORA, AlgorithmConfig())
    assert code_of(trainer.add_experiment, "bad", LORA, AlgorithmConfig()) == ("exists", 409)
    assert code_of(trainer.add_experiment, "../x", LORA, AlgorithmConfig()) == ("bad_request", 400)
    assert code_of(trainer.add_experiment, "bad-target", LoraConfig(target_modules=["q_proj", "nope_proj"]),
                   AlgorithmConfig()) == ("bad_request", 400)
    assert "exp_bad-target" not in trainer.model.peft_config
    vocab = trainer.vocab_size
    cases = {
        "out of vocab": _sample(PROMPT, [5, vocab], [-1.0, -1.0], 1.0),
        "negative id": _sample([-1] + PROMPT, COMPLETION, ok, 1.0),
        "too long": _sample(PROMPT * 10, COMPLETION, ok, 1.0),  # max_model_len is 64
        "logprob count": _sample(PROMPT, COMPLETION, ok[:-1], 1.0),
        "empty prompt": _sample([], COMPLETION, ok, 1.0),
        "nan advantage": _sample(PROMPT, COMPLETION, ok, float("nan")),
    }
    before = _adapter_weights(trainer, "bad")
    for label, sample in cases.items():
        assert code_of(trainer.train, TrainRequest(name="bad", samples=[sample])) == ("bad_request", 400), label
    assert code_of(trainer.logprobs, LogprobsRequest(name="bad", prompt_token_ids=PROMPT,
                                                     completions_token_ids=[[vocab + 3]])) == ("bad_request", 400)
    assert code_of(trainer.train, TrainRequest(name="bad", samples=[
        _sample(PROMPT, COMPLETION, ok, 1.0, temperature=0.0)])) == ("bad_request", 400)
    after = _adapter_weights(trainer, "bad")
    assert all(torch.equal(before[k], after[k]) for k in before)  # rejected before any step
    assert trainer.train(TrainRequest(name="bad", samples=[_sample(PROMPT, COMPLETION, ok, 1.0)])).step == 1

def test_a_resync_tried_again_gets_the_experiment_it_added_as_it_stands(trainer):
    """The front end's re-sync after a learner restart may be tried again (its disk was full for a later experiment,
    or an answer was lost to a timeout): an experiment the first try added is answered with its state, not 409, and
    is not added a second time. A plain add of a loaded name is still refused."""
    from grpo_server.protocol.errors import ApiError

    first = trainer.add_experiment("resynced", LORA, AlgorithmConfig(), True)
    ok = _lp(trainer, "resynced")[0]
    trainer.train(TrainRequest(name="resynced", samples=[_sample(PROMPT, COMPLETION, ok, 1.0)], journal_seq=3))
    again = trainer.add_experiment("resynced", LORA, AlgorithmConfig(), True)
    assert (again.version, again.step, again.journal_seq) == (first.version, 1, 3), again  # as it stands
    assert [a for a in trainer.model.peft_config if a == "exp_resynced"] == ["exp_resynced"]
    with pytest.raises(ApiError) as refused:
        trainer.add_experiment("resynced", LORA, AlgorithmConfig())
    assert refused.value.code == "exists"


def _optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state (ZeRO's flat fp32 partition and AdamW's moments), copied."""
    state = engine.optimizer.state_dict()
    out = {f"fp32.{i}": t.clone() for i, t in enumerate(state["single_partition_of_fp32_groups"])}
    for index, slots in state["base_optimizer_state"]["state"].items():
        out.update({f"{index}.{k}": torch.as_tensor(v).clone() for k, v in slots.items()})
    return out


def test_checkpoint_resumes_weights_optimizer_and_step_exactly(trainer):
    name = "ckpt"
    algorithm = AlgorithmConfig(learning_rate=5e-3, checkpoint_every=2, checkpoint_interval_s=0)  # by steps alone
    trainer.add_experiment(name, LORA, algorithm)

    def request(seq: int) -> TrainRequest:
        return TrainRequest(name=name, journal_seq=seq, num_groups=1,
                            samples=[_sample(PROMPT, COMPLETION, _lp(trainer, name)[0], 1.0)])

    assert trainer.train(request(1)).checkpointed_journal_seq is None
    second = trainer.train(request(2))  # checkpoint_every=2: copied now, written beside what follows
    trainer.wait_for_checkpoints()  # as the push after a step gives it time to
    at_checkpoint = _optimizer_tensors(trainer.experiments[name].engine)
    trainer.save_adapter(name)  # v1, step 2
    third = request(3)
    third_metrics = trainer.train(third)
    assert third_metrics.step == 3
    # The step that finds the checkpoint on disk reports its journal position (the front end then compacts its
    # journal up to it): the second, if the write was that quick, else the third.
    assert [m.checkpointed_journal_seq for m in (second, third_metrics) if m.checkpointed_journal_seq] == [2]
    after_third = _adapter_weights(trainer, name)
    assert trainer.save_adapter(name).version == 2  # step 3: pushed, not checkpointed

    trainer.remove_experiment(name)  # as a crashed learner: only the disk is left
    resumed = trainer.add_experiment(name, LORA, algorithm)
    # Back at step 2 with its optimizer; v2 (step 3) is not these weights, so they get a new number.
    assert (resumed.step, resumed.journal_seq, resumed.groups_trained, resumed.version) == (2, 2, 2, 3)
    restored = _optimizer_tensors(trainer.experiments[name].engine)
    assert restored.keys() == at_checkpoint.keys() and len(restored) > 2
    assert all(torch.equal(restored[k], at_checkpoint[k]) for k in restored), "optimizer state differs"
    # Retraining the lost step gives exactly the weights it gave before the "crash".
    assert trainer.train(third).step == 3
    again = _adapter_weights(trainer, name)
    assert all(torch.equal(again[k], after_third[k]) for k in again)
    trainer.remove_experiment(name)


def test_a_checkpoint_follows_the_first_step_then_waits_for_its_interval(trainer):
    """By default (checkpoint_interval_s 30) the first step writes one (without it a restart would train the
    journal's groups twice over the newest version); the steps of the next 30 s write none, the first step after
    them does."""
    from learner import checkpoint

    name = "interval"
    trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=5e-3))
    exp, folder = trainer.experiments[name], checkpoint.checkpoint_root(trainer.config.run_dir, name)

    def step() -> int:
        trainer.train(TrainRequest(name=name, samples=[_sample(PROMPT, COMPLETION, _lp(trainer, name)[0], 1.0)]))
        trainer.wait_for_checkpoints()
        return exp.step

    assert step() == 1 and exp.checkpointed_step == 1
    assert step() == 2 and exp.checkpointed_step == 1  # within 30 s of the last one
    assert [p.name for p in folder.glob("step*")] == ["step00000001"]
    exp.checkpoint_started_s -= 30  # as if the steps had taken 30 s since that one
    assert step() == 3 and exp.checkpointed_step == 3
    assert sorted(p.name for p in folder.glob("step*")) == ["step00000001", "step00000003"]
    assert step() == 4 and exp.checkpointed_step == 3
    trainer.remove_experiment(name)


def test_a_learner_stopped_before_its_first_checkpoint_resumes_the_newest_versions_journal_position(trainer):
    """The first checkpoint is written beside the push of v1: a learner that dies before it reaches the disk
    leaves versions and no checkpoint. It resumes from the newest version and the journal position that version
    records, so the front end does not queue the groups its weights already hold again."""
    import shutil

    from learner import checkpoint

    name, run_dir = "first_ckpt_lost", trainer.config.run_dir
    trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=5e-3))
    for seq in (3, 7):  # two batches, journal entries up to 3 and up to 7, each pushed: v1, v2
        trainer.train(TrainRequest(name=name, samples=[_sample(PROMPT, COMPLETION, _lp(trainer, name)[0], 1.0)],
                                   journal_seq=seq, num_groups=2))
        trainer.save_adapter(name)
    pushed = _adapter_weights(trainer, name)
    trainer.remove_experiment(name)  # as a crashed learner: only the disk is left ...
    shutil.rmtree(checkpoint.checkpoint_root(run_dir, name))  # ... and its first checkpoint never reached it
    resumed = trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=5e-3))
    assert (resumed.version, resumed.step, resumed.journal_seq, resumed.groups_trained) == (2, 2, 7, 4)
    again = _adapter_weights(trainer, name)
    assert all(torch.equal(again[k], pushed[k]) for k in again)
    trainer.remove_experiment(name)


async def test_prune_keeps_the_newest_the_used_and_the_checkpoints_versions_and_resume_goes_on(trainer):
    """learner.keep_versions through the verb's handler (learner/app.py, learner/retention.py): with 2 kept, the
    versions the front end names, those of both kept checkpoints and the newest 2 stay; a crashed learner then
    resumes from its checkpoint, and numbering goes on past the newest."""
    from grpo_server.protocol.errors import ApiError
    from grpo_server.protocol.wire import PruneVersionsRequest
    from learner import adapter_io
    from learner.app import LearnerHandler

    name, run_dir = "pruned", trainer.config.run_dir
    algorithm = AlgorithmConfig(learning_rate=5e-3, checkpoint_every=3, checkpoint_interval_s=0)
    trainer.add_experiment(name, LORA, algorithm)
    for _ in range(7):  # steps 1..7, each pushed: v1..v7; checkpoints at steps 3 (at v2) and 6 (at v5)
        trainer.train(TrainRequest(name=name, samples=[_sample(PROMPT, COMPLETION, _lp(trainer, name)[0], 1.0)]))
        trainer.save_adapter(name)
    handler = LearnerHandler(trainer, run_dir, keep_versions=2)
    pruned = await handler.prune_versions(PruneVersionsRequest(name=name, in_use=[1, 7]))
    assert (pruned.kept, pruned.removed) == ([1, 2, 5, 6, 7], [0, 3, 4])
    assert adapter_io.list_versions(run_dir, name) == [1, 2, 5, 6, 7]
    assert [p.name for p in adapter_io.adapter_root(run_dir, name).iterdir() if p.name.startswith(".")] == []

    trainer.remove_experiment(name)  # as a crashed learner: only the disk is left
    with pytest.raises(ApiError) as err:  # a removed experiment's files are not pruned
        await handler.prune_versions(PruneVersionsRequest(name=name, in_use=[]))
    assert err.value.status == 404
    resumed = trainer.add_experiment(name, LORA, algorithm)
    # The checkpoint at step 6; v7 (step 7) is not these weights, so they are served under a new number.
    assert (resumed.step, resumed.version) == (6, 8)
    pruned = await handler.prune_versions(PruneVersionsRequest(name=name, in_use=[8]))
    assert (pruned.kept, pruned.removed) == ([2, 5, 7, 8], [1, 6])
    assert trainer.train(TrainRequest(name=name, samples=[_sample(PROMPT, COMPLETION, _lp(trainer, name)[0],
                                                                  1.0)])).step == 7
    assert trainer.save_adapter(name).version == 9
    everything = await LearnerHandler(trainer, run_dir, keep_versions=0).prune_versions(
        PruneVersionsRequest(name=name, in_use=[]))
    assert (everything.kept, everything.removed) == ([2, 5, 7, 8, 9], [])  # 0: keep all
    trainer.remove_experiment(name)
