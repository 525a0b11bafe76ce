"""grpo_server/workers/pool.py: sampling and training take turns (schedule: alternate) or overlap."""

from __future__ import annotations

import asyncio

import pytest

from grpo_server.workers import pool as turns
from grpo_server.workers.pool import ComputeTurns, resolve_schedule


async def hold(cm, log: list[str], name: str, release: asyncio.Event) -> None:
    async with cm:
        log.append(f"{name} in")
        await release.wait()
    log.append(f"{name} out")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_train_step_waits_for_sampling_and_holds_new_sampling_back():
    t = ComputeTurns(alternate=True)
    log: list[str] = []
    s1_done, s2_done, train_done, s3_done = (asyncio.Event() for _ in range(4))
    tasks = [asyncio.create_task(hold(t.sampling(), log, "s1", s1_done)),
             asyncio.create_task(hold(t.sampling(), log, "s2", s2_done))]
    await settle()
    assert log == ["s1 in", "s2 in"]  # sampler calls share their turn
    tasks.append(asyncio.create_task(hold(t.training(), log, "train", train_done)))
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling(), log, "s3", s3_done)))
    await settle()
    assert log == ["s1 in", "s2 in"]  # the train step waits, and the new call waits behind it
    s1_done.set()
    await settle()
    assert "train in" not in log
    s2_done.set()
    await settle()
    assert log[-1] == "train in" and "s3 in" not in log
    train_done.set()
    await settle()
    assert log[-2:] == ["train out", "s3 in"]
    s3_done.set()
    await asyncio.gather(*tasks)


async def test_a_train_step_holds_back_its_own_experiments_sampling_not_anothers():
    """Turns by experiment: while `a` trains, `a`'s new sampling waits and `b`'s starts; `b`'s train step waits
    only for `b`'s sampling, not for `a`'s, and holds back only `b`'s new calls. Here the others are owed their
    share of the time, so no step takes a solo turn (tests/test_fairness_learning.py has those)."""
    t = ComputeTurns(alternate=True)
    t._solo_free_at = float("inf")  # noqa: SLF001 - the state after a solo turn, without running one
    log: list[str] = []
    train_a, a1, b1, train_b, b2, a2 = (asyncio.Event() for _ in range(6))
    tasks = [asyncio.create_task(hold(t.training("a"), log, "train a", train_a))]
    await settle()
    tasks += [asyncio.create_task(hold(t.sampling("a"), log, "a1", a1)),
              asyncio.create_task(hold(t.sampling("b"), log, "b1", b1))]
    await settle()
    assert log == ["train a in", "b1 in"]  # b samples beside a's step; a's own sampling waits for it
    tasks.append(asyncio.create_task(hold(t.training("b"), log, "train b", train_b)))
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b2", b2)))
    await settle()
    assert log == ["train a in", "b1 in"]  # b's step waits for b1; b's new call waits behind it
    b1.set()
    await settle()
    assert log[-2:] == ["b1 out", "train b in"]
    tasks.append(asyncio.create_task(hold(t.sampling("a"), log, "a2", a2)))
    await settle()
    assert "a2 in" not in log  # a's step still holds a's calls back, whoever else trains
    train_a.set()
    await settle()
    assert {"a1 in", "a2 in"} <= set(log) and "b2 in" not in log
    for event in (a1, a2, train_b, b2):
        event.set()
    await asyncio.gather(*tasks)
    assert log[-2:] == ["b2 in", "b2 out"]


async def test_alternate_all_holds_every_experiments_sampling_back():
    t = ComputeTurns(alternate=True, by_experiment=False)
    log: list[str] = []
    train_a, b1 = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(t.training("a"), log, "train a", train_a))]
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b1", b1)))
    await settle()
    assert log == ["train a in"]
    train_a.set()
    b1.set()
    await asyncio.gather(*tasks)
    assert log == ["train a in", "train a out", "b1 in", "b1 out"]


async def test_a_cancelled_train_step_lets_sampling_go():
    t = ComputeTurns(alternate=True)
    log: list[str] = []
    s1_done, never, s2_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(hold(t.sampling(), log, "s1", s1_done))
    await settle()
    trainer = asyncio.create_task(hold(t.training(), log, "train", never))
    await settle()
    second = asyncio.create_task(hold(t.sampling(), log, "s2", s2_done))
    await settle()
    assert log == ["s1 in"]
    trainer.cancel()
    await settle()
    assert log == ["s1 in", "s2 in"]
    s1_done.set()
    s2_done.set()
    await asyncio.gather(first, second)
    await asyncio.gather(trainer, return_exceptions=True)


async def test_overlap_lets_both_run_at_once():
    t = ComputeTurns(alternate=False)
    log: list[str] = []
    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(t.sampling(), log, "s1", release)),
             asyncio.create_task(hold(t.training(), log, "train", release)),
             asyncio.create_task(hold(t.sampling(), log, "s2", release))]
    await settle()
    assert log == ["s1 in", "train in", "s2 in"]
    assert t.sampling_calls == 2  # counted in both modes: an idle-time probe looks at it
    release.set()
    await asyncio.gather(*tasks)


@pytest.mark.parametrize("gpus, remote, expected", [
    (0, False, "alternate"), (1, False, "overlap"), (0, True, "overlap")])
def test_auto_schedule_alternates_only_on_a_cpu_host_running_its_workers(tmp_path, monkeypatch, gpus, remote,
                                                                        expected):
    driver = tmp_path / "gpus"
    driver.mkdir()
    for i in range(gpus):
        (driver / f"0000:0{i}:00.0").mkdir()
    monkeypatch.setattr(turns, "NVIDIA_GPUS", driver)
    assert resolve_schedule("auto", remote_workers=remote) == expected
    assert resolve_schedule("overlap", remote_workers=False) == "overlap"
    assert resolve_schedule("alternate", remote_workers=True) == "alternate"
