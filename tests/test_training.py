"""The front end's training loop (grpo_server/runtime/training.py) and its checks of pushed versions
(grpo_server/runtime/verification.py) on their own: when the learner and the samplers are called, and in what
order. The workers here are recorders with controllable timing; the real learner and vLLM sampler run the
same loop in tests/test_learning.py and tests/test_faults.py, and the learner's side of the free check is
tested in tests/test_learner.py.
"""

from __future__ import annotations

import asyncio
import contextlib

from grpo_server.config import ExperimentConfig
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.groups import Group
from grpo_server.runtime.metrics_log import MetricsLog
from grpo_server.runtime.status import experiment_status
from grpo_server.runtime.training import TrainingLoop
from grpo_server.workers.pool import ComputeTurns
from grpo_server.protocol.wire import (AdapterVersion, Completion, SaveAdapterRequest, ScoredVersion, ScoreResponse,
                                       ScoreVersionRequest, TrainMetrics)

LOGPROBS = [[-0.5, -1.0], [-0.25, -2.0]]


class FakeLearner:
    """Answers like the learner: a step's free check covers the samples of the version its weights are at."""

    def __init__(self, calls: list[str]):
        self.calls, self.step, self.version, self.weights_version = calls, 0, 0, 0
        self.pruned: list[list[int]] = []  # each prune_versions' in_use (not in `calls`: it is not ordered work)

    async def train(self, request, timeout_s=None):
        return await self.call("train", request)

    async def prune_versions(self, name, in_use):
        self.pruned.append(in_use)

    async def save_adapter(self, name):
        return await self.call("save_adapter", SaveAdapterRequest(name=name))

    async def score_version(self, name, version, probe, previous=False):
        return await self.call("score_version", ScoreVersionRequest(name=name, version=version, previous=previous,
                                                                    **probe.model_dump()))

    async def call(self, verb, request):
        self.calls.append(verb)
        if verb == "train":
            self.step += 1
            checked = [s for s in request.samples if s.policy_version == self.weights_version]
            metrics = TrainMetrics(step=self.step, loss=0.0, reward_mean=0.5, reward_std=0.5, kl=0.0,
                                   clipped_fraction=0.0, ratio_mean=1.0, ratio_std=0.0, ratio_min=1.0, ratio_max=1.0,
                                   grad_norm=1.0, tokens=4, seconds=0.01, checked_version=self.weights_version,
                                   sampler_gap_tokens=sum(len(s.completion_token_ids) for s in checked))
            self.weights_version = None
            return metrics
        if verb == "save_adapter":
            self.version += 1
            self.weights_version = self.version
            return AdapterVersion(name=request.name, version=self.version, path=f"/adapters/v{self.version}",
                                  step=self.step)
        if verb == "score_version":  # as the learner: only under the version just saved (else 409 weights_moved)
            assert request.version == self.weights_version, (request.version, self.weights_version)
            assert request.completions_token_ids == [[5, 6], [7, 8]]
            return ScoredVersion(version=request.version, logprobs=LOGPROBS)
        raise AssertionError(verb)


class FakeSampler:
    """Scores are held until `release_scores` is set, as a sampler busy with other requests holds them."""

    def __init__(self, calls: list[str], score_offset: float = 0.0):
        self.calls, self.offset = calls, score_offset
        self.release_scores = asyncio.Event()

    async def score(self, request):
        self.calls.append(f"score v{request.adapter.version}")
        await self.release_scores.wait()
        return ScoreResponse(logprobs=[[x + self.offset for x in row] for row in LOGPROBS])


class FakeWorkers:
    def __init__(self, score_offset: float = 0.0):
        self.calls: list[str] = []
        self.learner = FakeLearner(self.calls)
        self.the_sampler = FakeSampler(self.calls, score_offset)
        self.loaded: set[int] = {0}
        self.turns = ComputeTurns(alternate=False)

    async def wait_learner_ready(self, timeout_s):
        return None

    async def load_everywhere(self, ref, path, fingerprint=None):
        self.loaded.add(ref.version)

    async def unload_everywhere(self, ref):
        self.loaded.discard(ref.version)

    @contextlib.asynccontextmanager
    async def sampler(self, take_turn: bool = True, experiment: str | None = None):
        yield self.the_sampler


def rated_group(seq: int, policy_version: int = 0) -> Group:
    completions = [Completion(text="a", token_ids=[5, 6], logprobs=[-0.5, -1.0], finish_reason="stop"),
                   Completion(text="b", token_ids=[7, 8], logprobs=[-0.25, -2.0], finish_reason="stop")]
    return Group(group_id=f"g{seq}", experiment="exp", prompt_token_ids=[1, 2, 3], completions=completions,
                 policy_version=policy_version, temperature=1.0, max_tokens=2, rewards=[1.0, 0.0], advantages=[1.0, -1.0],
                 journal_seq=seq)


def training_for(tmp_path, workers: FakeWorkers, idle_check_s: float = 5.0) -> tuple[Experiment, TrainingLoop]:
    exp = Experiment(config=ExperimentConfig.model_validate(
        {"name": "exp", "algorithm": {"batch_groups": 1, "max_staleness": 100}}), workers=workers)
    exp.adapter_paths[0] = "/adapters/v0"
    log = MetricsLog(tmp_path / "metrics" / "exp.jsonl")
    return exp, TrainingLoop(exp, workers, verify_tolerance=0.05, train_timeout_s=5.0, max_loaded_versions=8,
                             metrics_log=log, idle_check_s=idle_check_s)


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def queue(exp: Experiment, group: Group) -> None:
    exp.queue.append(group)
    exp.queue_changed.set()


def push_lines(training: TrainingLoop) -> list[tuple]:
    return [(r["version"], r["verified"], r["checked_on"]) for r in training.metrics_log.records("push")]


async def test_the_batch_a_version_sampled_checks_it_without_the_sampler(tmp_path):
    workers = FakeWorkers()
    exp, training = training_for(tmp_path, workers)
    task = asyncio.create_task(training.run())
    try:
        for version in range(3):  # each batch sampled by the version served when it was made
            queue(exp, rated_group(version + 1, policy_version=exp.serving_version))
            await wait_until(lambda: exp.step == version + 1)
        await wait_until(lambda: exp.last_verification is not None and exp.last_verification.version == 2)
        assert exp.last_verification.checked_on == "trained_batch" and exp.last_verification.tokens == 4
        assert not [call for call in workers.calls if call.startswith("score v")]  # no sampler pass
        # v1 and v2 were checked by the next step; v3 waits for a step (or for the idle probe).
        assert push_lines(training) == [(1, True, "trained_batch"), (2, True, "trained_batch")]
        # The push's check is scored by the learner before the next step moves the weights.
        assert workers.calls[:4] == ["train", "save_adapter", "score_version", "train"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_version_no_batch_checks_is_probed_while_training_goes_on(tmp_path):
    workers = FakeWorkers()
    exp, training = training_for(tmp_path, workers, idle_check_s=0.2)
    task = asyncio.create_task(training.run())
    try:
        queue(exp, rated_group(1))  # sampled by v0, and the learner is at v0: checked free
        await wait_until(lambda: exp.serving_version == 1)
        queue(exp, rated_group(2))  # still v0's groups: v1 is not in this batch, so a probe checks it
        await wait_until(lambda: "score v1" in workers.calls)
        # The learner's side was scored right after each push, before the next step (under the saved weights).
        assert workers.calls[:6] == ["train", "save_adapter", "score_version", "train", "save_adapter",
                                     "score_version"]
        queue(exp, rated_group(3))  # the sampler holds v1's probe; training goes on regardless
        await wait_until(lambda: exp.serving_version == 3)
        assert workers.calls.count("score v1") == 1 and "score v2" not in workers.calls  # one probe at a time
        assert 1 in workers.loaded and 2 not in workers.loaded  # a version being checked stays loaded
        # After each push the learner hears which versions are in use (learner.keep_versions keeps them): the
        # served one, and v1, loaded while its probe runs; v2, given up unchecked, is not any more.
        await wait_until(lambda: len(workers.learner.pruned) == 3)
        assert workers.learner.pruned == [[1], [1, 2], [1, 3]]
        assert push_lines(training) == [(2, None, None)]  # v2: the next push came while v1's probe ran
        workers.the_sampler.release_scores.set()
        await wait_until(lambda: exp.last_verification.version == 1)
        assert exp.last_verification.checked_on == "probe" and exp.last_verification.ok
        await wait_until(lambda: 1 not in workers.loaded)  # retired once checked
        # Training idle: the newest version is probed after idle_check_s.
        await wait_until(lambda: exp.last_verification.version == 3)
        assert push_lines(training) == [(2, None, None), (1, True, "probe"), (3, True, "probe")]
        assert list(exp.errors) == [] and experiment_status(exp, 0, 0).state == "active"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_sampler_that_serves_other_weights_fails_the_check(tmp_path):
    workers = FakeWorkers(score_offset=0.2)
    workers.the_sampler.release_scores.set()
    exp, training = training_for(tmp_path, workers)
    task = asyncio.create_task(training.run())
    try:
        queue(exp, rated_group(1))
        await wait_until(lambda: exp.serving_version == 1)
        queue(exp, rated_group(2))  # v1 is not in this batch: probed
        await wait_until(lambda: exp.last_verification is not None and exp.last_verification.version == 1)
        assert not exp.last_verification.ok and abs(exp.last_verification.mean_abs_diff - 0.2) < 1e-9
        assert experiment_status(exp, 0, 0).state == "error"
        assert "differ by 0.2000 nats" in exp.errors[-1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_crashed_training_task_is_reported(tmp_path):
    workers = FakeWorkers()
    exp, training = training_for(tmp_path, workers)

    async def broken_train(batch, generation):
        raise KeyError("boom")

    training.train = broken_train
    exp.start_training(training)
    exp.queue.append(rated_group(1))
    exp.queue_changed.set()
    await asyncio.gather(exp.training_task, return_exceptions=True)
    await asyncio.sleep(0)  # done-callbacks run on the next loop turn
    assert experiment_status(exp, 0, 0).state == "error"
    assert "training stopped by an internal error (KeyError" in exp.errors[-1]

