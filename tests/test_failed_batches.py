"""A batch the learner always fails on is dropped after MAX_BATCH_FAILURES tries in a row, counted and reported,
and training goes on past it (grpo_server/runtime/training.py); a learner that is merely unavailable (503)
costs the batch no try. The real training loop and Experiment, with tests/test_training.py's recording
workers; the learner's answers are the ones its HTTP client raises (WorkerFailed for a 5xx, Unavailable)."""

from __future__ import annotations

import asyncio

from grpo_server.protocol.errors import Unavailable, WorkerFailed
from grpo_server.runtime import training as training_module
from tests.test_training import FakeWorkers, queue, rated_group, training_for, wait_until


class FailingLearnerWorkers(FakeWorkers):
    """The learner fails every step whose batch holds group `poison`: `error()` raised each time, `times` times
    (forever by default)."""

    def __init__(self, poison: str, error, times: int = 10**9):
        super().__init__()
        self.poison, self.error, self.left = poison, error, times
        self.sent: list[tuple[int, int]] = []  # each train request: (num_groups, journal_seq)
        real_train = self.learner.train

        async def train(request, timeout_s=None):
            self.sent.append((request.num_groups, request.journal_seq))
            if request.journal_seq == int(self.poison.removeprefix("g")) and self.left > 0:
                self.left -= 1
                raise self.error()
            return await real_train(request, timeout_s)
        self.learner.train = train


async def _run(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(training_module, "FAILED_STEP_PAUSE_S", 0.0)
    exp, training = training_for(tmp_path, workers)
    task = asyncio.create_task(training.run())
    return exp, task


async def test_a_batch_that_always_fails_is_dropped_with_its_reason_and_training_goes_on(tmp_path, monkeypatch):
    workers = FailingLearnerWorkers("g1", lambda: WorkerFailed("learner failed on train; see the server log"))
    exp, task = await _run(tmp_path, monkeypatch, workers)
    try:
        queue(exp, rated_group(1))
        queue(exp, rated_group(2))
        await wait_until(lambda: exp.counters.groups_trained == 1)
        limit = training_module.MAX_BATCH_FAILURES
        # Tried MAX_BATCH_FAILURES times, no more; then the next batch, whose journal position passes the dropped
        # one, so the learner's checkpoint (and the journal's compaction) never brings it back.
        assert workers.sent == [(1, 1)] * limit + [(1, 2)]
        assert exp.counters.groups_dropped_failed == 1 and exp.queue == []
        dropped = [e for e in exp.errors if "dropped" in e]
        assert len(dropped) == 1 and f"failed {limit} times in a row" in dropped[0] and "see the server log" in dropped[0]
        assert len(exp.errors) == limit  # each failed try is shown too
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_batch_that_fails_fewer_times_is_trained(tmp_path, monkeypatch):
    limit = training_module.MAX_BATCH_FAILURES
    workers = FailingLearnerWorkers("g1", lambda: WorkerFailed("learner failed on train"), times=limit - 1)
    exp, task = await _run(tmp_path, monkeypatch, workers)
    try:
        queue(exp, rated_group(1))
        await wait_until(lambda: exp.counters.groups_trained == 1)
        assert workers.sent == [(1, 1)] * limit and exp.counters.groups_dropped_failed == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_unavailable_learner_costs_the_batch_no_try(tmp_path, monkeypatch):
    limit = training_module.MAX_BATCH_FAILURES
    workers = FailingLearnerWorkers("g1", lambda: Unavailable("learner is restarting", code="worker_unavailable"),
                                    times=2 * limit)
    exp, task = await _run(tmp_path, monkeypatch, workers)
    try:
        queue(exp, rated_group(1))
        await wait_until(lambda: exp.counters.groups_trained == 1)
        assert len(workers.sent) == 2 * limit + 1 and exp.counters.groups_dropped_failed == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
