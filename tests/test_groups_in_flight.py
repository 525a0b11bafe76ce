"""How many groups a client keeps in flight: the server's suggestion (runtime/status.py) and the task runner
following it (examples/task_runner.py's GroupsInFlight)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from examples.task_runner import GroupsInFlight
from grpo_server.client import GrpoServerError
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.orchestrator import Orchestrator
from grpo_server.runtime.status import SAMPLING_WINDOW_S, is_sampling


def _orchestrator(tmp_path, names: list[str], batch_groups: int = 2, max_queued_batches: int = 2) -> Orchestrator:
    config = ServerConfig(run_dir=tmp_path, max_queued_batches=max_queued_batches)
    orchestrator = Orchestrator(config, workers=None, prompts=None)
    for name in names:  # the status side only: no worker is asked
        orchestrator.experiments[name] = Experiment(
            ExperimentConfig(name=name, algorithm={"batch_groups": batch_groups}), server=config)
    return orchestrator


def test_one_batch_in_flight_while_an_experiment_samples_alone(tmp_path):
    orchestrator = _orchestrator(tmp_path, ["a", "b"], batch_groups=3)
    assert orchestrator.status("a").suggested_groups_in_flight == 3  # nothing samples: a's client would be alone
    with orchestrator.experiments["a"].sampling_request():
        assert orchestrator.status("a").suggested_groups_in_flight == 3  # itself does not count twice
        assert orchestrator.status("b").suggested_groups_in_flight == 6  # a samples beside it


def test_more_while_others_sample_up_to_the_admitted_backlog(tmp_path):
    names = ["a", "b", "c", "d"]
    orchestrator = _orchestrator(tmp_path, names, batch_groups=2, max_queued_batches=3)
    exps = orchestrator.experiments
    with exps["b"].sampling_request(), exps["c"].sampling_request(0.25):  # an episode's turn counts too
        assert orchestrator.status("a").suggested_groups_in_flight == 6  # 3 sampling: 3 batches
    with exps["b"].sampling_request(), exps["c"].sampling_request(), exps["d"].sampling_request():
        assert orchestrator.status("a").suggested_groups_in_flight == 6  # 4 sampling, but 429 past 3 batches


def test_an_experiment_counts_as_sampling_for_a_while_after_its_last_request(tmp_path):
    orchestrator = _orchestrator(tmp_path, ["a", "b"])
    b = orchestrator.experiments["b"]
    with b.sampling_request():
        pass
    now = time.monotonic()
    assert is_sampling(b, now) and orchestrator.status("a").suggested_groups_in_flight == 4
    assert not is_sampling(b, now + SAMPLING_WINDOW_S + 1)  # a client that stopped no longer counts
    b.last_sampling_at -= SAMPLING_WINDOW_S + 1
    assert orchestrator.status("a").suggested_groups_in_flight == 2


class FakeClient:
    """`status(name)` answers the suggestions in turn (the last one again), or raises an error given there."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    async def status(self, name: str):
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return SimpleNamespace(suggested_groups_in_flight=answer)


async def test_a_fixed_number_is_kept_without_asking():
    client = FakeClient(1)
    async with GroupsInFlight(client, "a", fixed=3) as in_flight:
        assert in_flight.workers == 3
        assert all([await in_flight.turn(i, lambda: False) for i in range(3)])
    assert client.calls == 0


async def test_the_task_runner_follows_the_servers_suggestion(monkeypatch):
    monkeypatch.setattr(GroupsInFlight, "POLL_S", 0.01)
    client = FakeClient(2, 2, 4)
    async with GroupsInFlight(client, "a") as in_flight:
        assert in_flight.workers == GroupsInFlight.MAX_FOLLOWED
        third = asyncio.create_task(in_flight.turn(2, lambda: False))
        assert await asyncio.wait_for(third, 5) is True  # waited until the suggestion grew to 4
        assert in_flight.limit == 4
        assert await in_flight.turn(7, lambda: True) is False  # told to stop: no turn
    assert client.calls >= 3


async def test_a_server_without_the_suggestion_gets_the_former_fixed_number(monkeypatch):
    monkeypatch.setattr(GroupsInFlight, "POLL_S", 0.01)
    async with GroupsInFlight(FakeClient(None), "a") as in_flight:  # older servers leave the field out
        assert await asyncio.wait_for(in_flight.turn(GroupsInFlight.WITHOUT_SUGGESTION - 1, lambda: False), 5)
        assert in_flight.limit == GroupsInFlight.WITHOUT_SUGGESTION == 4


async def test_a_failure_to_follow_the_server_is_raised_not_hidden(monkeypatch):
    monkeypatch.setattr(GroupsInFlight, "POLL_S", 0.01)
    async with GroupsInFlight(FakeClient(1, GrpoServerError(403, "forbidden", "no")), "a") as in_flight:
        with pytest.raises(GrpoServerError, match="no"):
            await asyncio.wait_for(in_flight.turn(5, lambda: False), 5)


async def test_the_server_suggests_more_while_another_experiment_samples(client):
    """Over real HTTP: b's client is told to keep two batches in flight once a has sampled (the shared server's
    max_queued_batches is 2, so the other experiments sampling there cannot make it more)."""
    names = ["inflight-a", "inflight-b"]
    for name in names:
        await client.create_experiment({"name": name, "algorithm": {"batch_groups": 2},
                                        "sampling": {"n": 2, "max_tokens": 4}})
    try:
        await client.complete(names[0], prompt="Say hi.")
        assert (await client.status(names[1])).suggested_groups_in_flight == 4
    finally:
        for name in names:
            await client.delete_experiment(name)
