"""What the front end makes of an experiment's algorithm (issue 14, items 2, 3, 4, 8), with hand-set numbers:
each loss's clip defaults, Dr. GRPO's constant normaliser, staleness counted in optimizer steps, and
`mask_truncated`. The learner and the samplers are the recorders of tests/test_training.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from grpo_server.config import ExperimentConfig
from grpo_server.protocol.wire import Completion
from grpo_server.protocol.worker_config import AlgorithmConfig
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.groups import Group
from grpo_server.runtime.journal import ExperimentRegistry, FeedbackJournal, group_from_record
from grpo_server.runtime.metrics_log import MetricsLog
from grpo_server.runtime.status import experiment_status
from grpo_server.runtime.training import TrainingLoop, train_samples
from tests.test_training import FakeWorkers, wait_until

# --- 2. clip defaults per loss -------------------------------------------------------------------------


@pytest.mark.parametrize("loss, low, high", [
    ("grpo", 0.2, 0.2),  # DeepSeekMath: symmetric
    ("dr_grpo", 0.2, 0.2),  # as grpo
    ("dapo", 0.2, 0.28),  # clip-higher
    ("gspo", 3e-4, 4e-4),  # GSPO paper (v2) 5.1: a sequence-level ratio
])
def test_each_loss_gets_its_clip(loss, low, high):
    config = ExperimentConfig.model_validate({"name": "x", "algorithm": {"loss": loss}})
    assert (config.algorithm.clip_low, config.algorithm.clip_high) == (low, high)
    # Explicit null is the default too.
    nulls = AlgorithmConfig.model_validate({"loss": loss, "clip_low": None, "clip_high": None})
    assert (nulls.clip_low, nulls.clip_high) == (low, high)


def test_explicit_clips_win_one_by_one():
    algorithm = AlgorithmConfig(loss="gspo", clip_high=0.5)
    assert (algorithm.clip_low, algorithm.clip_high) == (3e-4, 0.5)
    algorithm = AlgorithmConfig(loss="dapo", clip_low=0.1)
    assert (algorithm.clip_low, algorithm.clip_high) == (0.1, 0.28)
    algorithm = AlgorithmConfig(loss="grpo", clip_low=0.0, clip_high=0.0)  # 0 is a value, not "unset"
    assert (algorithm.clip_low, algorithm.clip_high) == (0.0, 0.0)


def test_resolved_clips_are_what_the_learner_the_status_and_the_registry_see(tmp_path):
    config = ExperimentConfig.model_validate({"name": "x", "algorithm": {"loss": "gspo"}})
    # The learner gets the algorithm through the wire: resolved numbers, not None.
    sent = json.loads(config.algorithm.model_dump_json())
    assert (sent["clip_low"], sent["clip_high"]) == (3e-4, 4e-4)
    shown = experiment_status(Experiment(config=config), 0, 0).config["algorithm"]
    assert (shown["clip_low"], shown["clip_high"]) == (3e-4, 4e-4)
    registry = ExperimentRegistry(tmp_path)
    registry.save(config)
    assert registry.load_all()[0].algorithm == config.algorithm
    # Set once: a later None assignment resolves again rather than reach the learner.
    config.algorithm.clip_high = None
    assert config.algorithm.clip_high == 4e-4


@pytest.mark.parametrize("field, value", [
    ("clip_low", 1.0), ("clip_low", -0.1), ("clip_high", -0.1), ("clip_high", 10.5), ("clip_low", "a lot"),
])
def test_clips_out_of_range_name_the_field(field, value):
    with pytest.raises(ValidationError) as info:
        ExperimentConfig.model_validate({"name": "x", "algorithm": {field: value}})
    assert {".".join(str(p) for p in e["loc"]) for e in info.value.errors()} == {f"algorithm.{field}"}


# --- fixtures of the training side ---------------------------------------------------------------------


def completion(ids: list[int], finish_reason: str = "stop") -> Completion:
    return Completion(text="t", token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish_reason)


def group(seq: int, completions: list[Completion], policy_version: int = 0, max_tokens: int = 2) -> Group:
    n = len(completions)
    return Group(group_id=f"g{seq}", experiment="exp", prompt_token_ids=[1, 2, 3], completions=completions,
                 policy_version=policy_version, temperature=1.0, max_tokens=max_tokens,
                 rewards=[float(i) for i in range(n)],
                 advantages=[float(i) - (n - 1) / 2 for i in range(n)], journal_seq=seq)


def episode_group(seq: int, finish_reason: str) -> Group:
    """Two episodes' sequences of 6 tokens each (two turns, a tool result between: mask 0 there)."""
    sequences = [completion([5, 6, 40, 41, 7, 8], finish_reason), completion([5, 6, 40, 41, 9, 9])]
    return Group(group_id=f"e{seq}", experiment="exp", prompt_token_ids=[1, 2], completions=sequences,
                 policy_version=0, temperature=1.0, max_tokens=6, rewards=[1.0, 0.0], advantages=[0.5, -0.5],
                 journal_seq=seq, episode_of=[0, 1], sequence_prompts=[[1, 2], [1, 2]],
                 loss_masks=[[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]])


def setup(tmp_path, **algorithm) -> tuple[Experiment, TrainingLoop, FakeWorkers, list]:
    workers = FakeWorkers()
    config = ExperimentConfig.model_validate({
        "name": "exp", "sampling": {"max_tokens": 64},
        "algorithm": {"batch_groups": 1, "max_staleness": 100, "push_every": 1000, **algorithm}})
    exp = Experiment(config=config, workers=workers, journal=FeedbackJournal(tmp_path / "journal" / "exp.jsonl"))
    exp.adapter_paths[0] = "/adapters/v0"
    training = TrainingLoop(exp, workers, verify_tolerance=0.05, train_timeout_s=5.0, max_loaded_versions=8,
                            metrics_log=MetricsLog(tmp_path / "metrics" / "exp.jsonl"))
    requests = []
    learner_train = workers.learner.train

    async def recording_train(request, timeout_s=None):
        requests.append(request)
        return await learner_train(request, timeout_s)

    workers.learner.train = recording_train
    return exp, training, workers, requests


# --- 3. Dr. GRPO's normaliser ----------------------------------------------------------------------------


async def test_the_dr_grpo_normaliser_is_sampling_max_tokens_whatever_the_batch(tmp_path):
    exp, training, _, requests = setup(tmp_path, loss="dr_grpo", batch_groups=2)
    # A group sampled with its own max_tokens 2, one with an external completion of 100 tokens (its group's
    # max_tokens raised to 100, as feedback did before), and an episode group of 6-token sequences.
    await training.train([group(1, [completion([5, 6]), completion([7, 8])], max_tokens=2),
                         group(2, [completion([5] * 100, "external"), completion([7, 8])], max_tokens=100)],
                        exp.queue_generation)
    await training.train([episode_group(3, "episode")], exp.queue_generation)
    assert [r.max_tokens for r in requests] == [64, 64]  # sampling.max_tokens, for every batch
    assert [len(r.samples) for r in requests] == [4, 2]
    # A sequence longer than the constant still trains whole: dr_grpo divides its summed token losses by
    # (sequences x 64), 4 x 64 = 256 for the first batch.
    assert max(len(s.completion_token_ids) for s in requests[0].samples) == 100


# --- 4. staleness in optimizer steps ---------------------------------------------------------------------


async def test_with_push_every_2_staleness_counts_steps_not_versions(tmp_path):
    exp, training, workers, requests = setup(tmp_path, push_every=2, max_staleness=1)
    for seq in range(1, 5):  # four groups sampled by v0 (step 0), accepted as feedback does
        g = group(seq, [completion([5, 6]), completion([7, 8])])
        await exp._accept(g, g.rewards, g.advantages, skipped=None)
    assert [g.sampled_step for g in exp.queue] == [0, 0, 0, 0]
    task = asyncio.create_task(training.run())
    try:
        # Step 1 trains g1 (lag 0), step 2 trains g2 (lag 1) and pushes v1 (push_every 2). Then the learner
        # is 2 steps past g3 and g4 but only 1 version: max_staleness 1 drops them (by versions, both trained).
        await wait_until(lambda: exp.serving_version == 1 and not exp.queue)
        await asyncio.sleep(0.05)
        assert exp.step == 2 and workers.calls.count("train") == 2
        assert [r.samples[0].policy_version for r in requests] == [0, 0]
        assert exp.counters.groups_dropped_stale == 2 and exp.counters.groups_trained == 2
        assert exp.version_steps == {0: 0, 1: 2}
        assert dict(exp.staleness) == {0: 1, 1: 1}  # /metrics' histogram: steps behind, per trained group
        # A group sampled by v1 records step 2; at step 4 it is 2 steps behind, though still at version 1.
        fresh = group(5, [completion([5, 6]), completion([7, 8])], policy_version=1)
        late = group(6, [completion([5, 6]), completion([7, 8])], policy_version=1)
        await exp._accept(fresh, fresh.rewards, fresh.advantages, skipped=None)
        await wait_until(lambda: exp.step == 3)
        await exp._accept(late, late.rewards, late.advantages, skipped=None)
        await wait_until(lambda: exp.step == 4)  # late: lag 1 at step 3, trained
        assert (fresh.sampled_step, late.sampled_step) == (2, 2)
        assert exp.counters.groups_dropped_stale == 2 and dict(exp.staleness) == {0: 2, 1: 2}
        assert exp.serving_version == 2 and exp.version_steps[2] == 4
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_pushes_that_failed_are_caught_up_once_every_new_group_would_be_stale(tmp_path):
    """A push that fails (a full disk) leaves the served version behind the learner's steps. Past max_staleness,
    every group sampled from it is dropped as stale, so no step comes to push again: the chaos soak saw two
    experiments drop every group for good. The loop pushes the weights as they are, tried again while it fails."""
    from grpo_server.protocol.errors import Unavailable
    from grpo_server.runtime import training as training_module

    exp, training, workers, requests = setup(tmp_path, push_every=1, max_staleness=1)
    training_module.CATCH_UP_RETRY_S = 0.05
    save_adapter, disk = workers.learner.save_adapter, {"full": True}

    async def save_on_a_disk(name):
        if disk["full"]:
            raise Unavailable("learner: the run directory's disk is full", code="disk_full")
        return await save_adapter(name)

    workers.learner.save_adapter = save_on_a_disk
    task = asyncio.create_task(training.run())
    try:
        for seq in (1, 2):  # sampled by v0 at step 0: each trains a step whose push fails
            g = group(seq, [completion([5, 6]), completion([7, 8])])
            await exp._accept(g, g.rewards, g.advantages, skipped=None)
            await wait_until(lambda: exp.step == seq)
        assert exp.serving_version == 0 and any("push failed" in e for e in exp.errors)
        late = group(3, [completion([5, 6]), completion([7, 8])])  # sampled by v0 now: 2 steps behind, stale
        await exp._accept(late, late.rewards, late.advantages, skipped=None)
        await wait_until(lambda: exp.counters.groups_dropped_stale == 1)
        await asyncio.sleep(0.2)  # tries while the disk is full: no version, no step
        assert exp.serving_version == 0 and exp.step == 2
        disk["full"] = False
        await wait_until(lambda: exp.serving_version == 1)
        assert exp.version_steps[1] == 2 and not training._served_too_old()
        fresh = group(4, [completion([5, 6]), completion([7, 8])], policy_version=1)  # from the caught-up version
        await exp._accept(fresh, fresh.rewards, fresh.advantages, skipped=None)
        await wait_until(lambda: exp.step == 3)
        assert [r.group_ids for r in requests] == [["g1"], ["g2"], ["g4"]] and exp.counters.groups_trained == 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        training_module.CATCH_UP_RETRY_S = 5.0


async def test_a_group_left_behind_by_steps_at_the_same_version_is_dropped(tmp_path):
    exp, _, _, _ = setup(tmp_path, push_every=2, max_staleness=1)
    exp.learned(1, 2)
    g = group(1, [completion([5, 6]), completion([7, 8])], policy_version=1)
    await exp._accept(g, g.rewards, g.advantages, skipped=None)
    exp.step = 3  # one step past v1: kept
    assert exp.drop_stale() == 1
    exp.step = 4  # two steps past v1, no push since (a skipped one, or push_every 2): dropped
    assert exp.learner_version == 1 and exp.drop_stale() == 0 and exp.counters.groups_dropped_stale == 1


async def test_the_sampled_step_survives_a_restart_in_the_journal(tmp_path):
    exp, _, _, _ = setup(tmp_path)
    exp.learned(3, 7)
    g = group(1, [completion([5, 6]), completion([7, 8])], policy_version=3)
    await exp._accept(g, g.rewards, g.advantages, skipped=None)
    exp.journal.close()
    [back] = FeedbackJournal(tmp_path / "journal" / "exp.jsonl").pending(after_seq=0)
    assert (back.policy_version, back.sampled_step) == (3, 7)
    # A journal written before steps were recorded: counted from step 0 (dropped rather than trained stale).
    record = json.loads((tmp_path / "journal" / "exp.jsonl").read_text())
    del record["sampled_step"]
    assert group_from_record(record).sampled_step == 0


# --- 8. mask_truncated -------------------------------------------------------------------------------------


async def test_mask_truncated_leaves_length_cut_completions_out_and_counts_them(tmp_path):
    exp, training, _, requests = setup(tmp_path, mask_truncated=True)
    cut = group(1, [completion([5, 6]), completion([7, 8], "length"), completion([9, 9], "tool_calls")])
    await training.train([cut], exp.queue_generation)
    assert [s.completion_token_ids for s in requests[0].samples] == [[5, 6], [9, 9]]
    # Advantages stay those of the whole group: -1 and +1 (rewards 0, 1, 2; mean 1).
    assert [s.advantage for s in requests[0].samples] == [-1.0, 1.0]
    assert exp.counters.completions_masked_truncated == 1 and exp.counters.groups_trained == 1
    # A group whose every completion was cut trains nothing: counted, no learner call.
    await training.train([group(2, [completion([5, 6], "length"), completion([7, 8], "length")])],
                        exp.queue_generation)
    assert len(requests) == 1 and exp.step == 1
    assert exp.counters.completions_masked_truncated == 3 and exp.counters.groups_trained == 1
    # An episode's sequence whose last turn was cut (runtime/episodes.py marks it "length") is left out too.
    await training.train([episode_group(3, "length")], exp.queue_generation)
    assert [s.completion_token_ids for s in requests[1].samples] == [[5, 6, 40, 41, 9, 9]]
    assert requests[1].samples[0].loss_mask == [1, 1, 0, 0, 1, 1]
    assert exp.counters.completions_masked_truncated == 4


async def test_without_mask_truncated_cut_completions_train(tmp_path):
    exp, training, _, requests = setup(tmp_path)
    assert exp.config.algorithm.mask_truncated is False  # opt-in, as DAPO's overlong filtering
    await training.train([group(1, [completion([5, 6]), completion([7, 8], "length")])], exp.queue_generation)
    assert len(requests[0].samples) == 2 and exp.counters.completions_masked_truncated == 0
    assert len(train_samples([episode_group(2, "length")])) == 2
