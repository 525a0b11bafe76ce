"""The learner pages idle experiments out of memory and back in, exactly (learner/paging.py): a learner that holds
one experiment at a time trains, pages out, pages in and trains on, and its weights, AdamW moments and ZeRO's fp32
copy equal bit for bit those of a learner that never paged, as do the push check's two versions."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from grpo_server.protocol.wire import LogprobsRequest, ScoreVersionRequest, TrainRequest
from grpo_server.protocol.worker_config import AlgorithmConfig
from tests.learner_helpers import COMPLETION, LORA, PROMPT, _sample


def _learner(model_dir, run_dir, resident: int):
    from grpo_server.protocol.worker_config import LearnerConfig

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0", "DS_ACCELERATOR": "cpu"}.items():
        os.environ.setdefault(key, value)
    from learner.trainer import MultiAdapterTrainer

    return MultiAdapterTrainer(LearnerConfig(model_path=model_dir, run_dir=run_dir, port=1, max_model_len=64,
                                             dtype="float32", resident_experiments=resident))


def _batch(trainer, name: str, advantage: float) -> TrainRequest:
    logprobs = trainer.logprobs(LogprobsRequest(name=name, prompt_token_ids=PROMPT,
                                                completions_token_ids=[COMPLETION]))[0]
    return TrainRequest(name=name, samples=[_sample(PROMPT, COMPLETION, logprobs, advantage),
                                            _sample(PROMPT[:3], COMPLETION[:2], [-3.0, -4.0], -advantage)])


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def _state(trainer, name: str) -> dict[str, torch.Tensor]:
    exp = trainer._get(name)
    weights = {f"param{i}": p.detach().clone() for i, p in enumerate(exp.params)}
    return weights | {f"optimizer{k}": v.clone() for k, v in _tensors(exp.engine.optimizer.state_dict()).items()}


@pytest.fixture(scope="module")
def learners(tiny_model_dir, tmp_path_factory):
    """A learner that holds one experiment at a time, and one that holds all."""
    return (_learner(tiny_model_dir, tmp_path_factory.mktemp("paging"), resident=1),
            _learner(tiny_model_dir, tmp_path_factory.mktemp("steady"), resident=32))


def test_a_paged_out_experiment_comes_back_bit_exact(learners):
    paging, steady = learners
    algorithm = AlgorithmConfig(learning_rate=1e-2)
    for trainer in learners:
        trainer.add_experiment("kept", LORA, algorithm)
        for advantage in (1.0, -0.5):
            trainer.train(_batch(trainer, "kept", advantage))
        trainer.save_adapter("kept")
        trainer.train(_batch(trainer, "kept", 0.7))
        trainer.save_adapter("kept")
    before = _state(paging, "kept")
    assert any(k.endswith("exp_avg_sq") for k in before), "no AdamW moment to compare"

    paging.add_experiment("other", LORA, algorithm)  # holds one: "kept" is paged out to its checkpoint
    paging.train(_batch(paging, "other", 1.0))
    assert paging.status()["kept"]["resident"] is False and paging.status()["other"]["resident"] is True
    assert "kept" not in paging.experiments and "kept" not in paging._saved
    assert paging.residency() | {"last_page_in_s": None, "last_page_out_s": None} == {
        "resident": 1, "paged_out": 1, "limit": 1, "page_ins": 0, "page_outs": 1,
        "last_page_in_s": None, "last_page_out_s": None}

    after = _state(paging, "kept")  # its next verb pages it in, and "other" out
    assert paging.page_ins == 1 and paging.status()["other"]["resident"] is False
    assert after.keys() == before.keys()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []

    # The push check's versions came back from their folders: the previous one scores as the learner never paged.
    probe = ScoreVersionRequest(name="kept", version=2, prompt_token_ids=PROMPT, completions_token_ids=[COMPLETION],
                                previous=True)
    scored = [trainer.score_version(probe) for trainer in learners]
    assert scored[0].previous_version == scored[1].previous_version == 1
    assert scored[0].previous_logprobs == scored[1].previous_logprobs and scored[0].logprobs == scored[1].logprobs

    for trainer in learners:  # and it trains on as if it had never left
        trainer.train(_batch(trainer, "kept", -1.0))
    a, b = _state(paging, "kept"), _state(steady, "kept")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_page_in_into_another_experiments_spare_adapter_is_bit_exact(learners):
    """A page-in takes a spare peft adapter that another experiment left at its page-out (learner/paging.py
    `_keep_spare`): every weight and AdamW moment is the experiment's own, as in the learner that never paged."""
    paging, steady = learners
    for trainer in learners:
        for name, advantage in (("cross_x", 1.0), ("cross_y", -0.5), ("cross_z", 0.3)):
            trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=1e-2))  # the one before goes out
            trainer.train(_batch(trainer, name, advantage))
    assert paging.status()["cross_x"]["resident"] is False and len(paging._spares[LORA.model_dump_json()]) == 2
    for name in ("cross_x", "cross_y"):
        a, b = _state(paging, name), _state(steady, name)
        assert paging.experiments[name].adapter != f"exp_{name}"  # in a spare: not its own adapter any more
        assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    for trainer in learners:  # and it trains on in it as if it had never left
        trainer.train(_batch(trainer, "cross_y", 0.8))
    a, b = _state(paging, "cross_y"), _state(steady, "cross_y")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_an_experiment_never_trained_pages_out_without_a_checkpoint_and_back_exactly(learners):
    """Created and not yet used (most page-outs on the tenants benchmark): its state is its v0 folder and an AdamW
    with no state yet, so its page-out writes no checkpoint, and its page-in reads them back."""
    from learner import checkpoint

    paging, steady = learners
    for trainer in learners:
        trainer.add_experiment("fresh", LORA, AlgorithmConfig(learning_rate=1e-2))
    paging.add_experiment("after_fresh", LORA, AlgorithmConfig())  # holds one: "fresh" is paged out
    assert paging._paged["fresh"].from_version == 0
    assert checkpoint.read_latest(paging.config.run_dir, "fresh", 0, 1) is None  # none written
    a, b = _state(paging, "fresh"), _state(steady, "fresh")  # paged in from v0
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    for trainer in learners:
        trainer.train(_batch(trainer, "fresh", 1.0))
    a, b = _state(paging, "fresh"), _state(steady, "fresh")
    assert any(k.endswith("exp_avg_sq") for k in a) and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_what_a_page_out_left_is_freed_by_the_idle_pagers_round(learners):
    """A released DeepSpeed engine is in a reference cycle: its optimizer state went only at the interpreter's next
    full collection. The idle pager's round (`page_out_idle`, every 10 s) frees it, whether or not anything was
    idle (learner/paging.py `release_freed_memory`)."""
    paging, _ = learners
    paging.add_experiment("freed", LORA, AlgorithmConfig())
    engine, optimizer = weakref.ref(paging.experiments["freed"].engine), weakref.ref(
        paging.experiments["freed"].engine.optimizer)
    paging.add_experiment("after_freed", LORA, AlgorithmConfig())  # holds one: "freed" is paged out
    assert paging.status()["freed"]["resident"] is False
    assert paging.page_out_idle() == 0  # nothing idle for 60 s
    assert engine() is None and optimizer() is None


def test_a_paged_out_experiment_is_removed_and_added_again(learners):
    paging, _ = learners
    paging.add_experiment("gone", LORA, AlgorithmConfig())
    paging.train(_batch(paging, "gone", 1.0))
    paging.add_experiment("next", LORA, AlgorithmConfig())  # "gone" is paged out
    assert paging.status()["gone"]["resident"] is False
    paging.remove_experiment("gone")
    assert "gone" not in paging.status()
    # Added again, it resumes from the checkpoint its page-out wrote, at its step.
    assert paging.add_experiment("gone", LORA, AlgorithmConfig()).step == 1


def test_an_experiment_holding_tinker_gradients_stays_in_memory(learners):
    from grpo_server.protocol.wire import Datum, ForwardBackwardRequest

    paging, _ = learners
    paging.add_experiment("grads", LORA, AlgorithmConfig())
    full = PROMPT + COMPLETION
    datum = Datum(tokens=full[:-1], loss_fn_inputs={"target_tokens": full[1:],
                                                    "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * len(COMPLETION)})
    paging.forward_backward(ForwardBackwardRequest(name="grads", loss_fn="cross_entropy", data=[datum]))
    paging.add_experiment("beside", LORA, AlgorithmConfig())  # one over the limit: "grads" cannot go
    assert paging.status()["grads"]["resident"] is True and len(paging.experiments) == 2


def test_the_idle_rule_counts_the_learners_spare_time_only(learners):
    """`page_out_idle`: an experiment whose latest verb began two minutes ago, while the learner ran other verbs for
    100 s of them (its step waiting its turn in the front end's queue), is not idle; with 90 s of them spare it is
    (page_out_idle_s 60). The learner's HTTP handler sums its verbs' seconds (tests/test_learner_http.py runs the
    pager on a real process)."""
    _, steady = learners
    assert steady.config.page_out_idle_s == 60
    steady.add_experiment("waiting", LORA, AlgorithmConfig())
    exp = steady.experiments["waiting"]
    steady.verb_seconds += 500.0  # what the handler would have counted since the learner started
    exp.used_at_s -= 120.0
    exp.busy_at_use_s = steady.verb_seconds - 100.0
    steady.page_out_idle()
    assert steady.status()["waiting"]["resident"] is True
    exp.busy_at_use_s = steady.verb_seconds - 30.0
    steady.page_out_idle()
    assert steady.status()["waiting"]["resident"] is False
