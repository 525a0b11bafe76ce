"""grpo_server/workers/turns.py (through pool.py): sampling and training take turns (schedule: alternate) or
overlap; a train step beside another experiment's sampling takes a solo turn, bounded in length and share."""

from __future__ import annotations

import asyncio

import pytest

from grpo_server.workers import pool
from grpo_server.workers import turns
from grpo_server.workers.pool import ComputeTurns, resolve_schedule
from grpo_server.workers.turns import OTHERS_SHARE


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
    monkeypatch.setattr(pool, "NVIDIA_GPUS", driver)
    assert resolve_schedule("auto", remote_workers=remote) == expected
    assert resolve_schedule("overlap", remote_workers=False) == "overlap"
    assert resolve_schedule("alternate", remote_workers=True) == "alternate"


# --- solo turns: a train step beside another experiment's sampling (tests/test_fairness_learning.py: on a server)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_train_step_beside_anothers_sampling_takes_a_solo_turn():
    """b samples; a's step waits for b's call in flight and holds b's new one until the step ends."""
    t = ComputeTurns(alternate=True, clock=Clock())
    log: list[str] = []
    b1, train_a, b2 = (asyncio.Event() for _ in range(3))
    tasks = [asyncio.create_task(hold(t.sampling("b"), log, "b1", b1))]
    await settle()
    tasks.append(asyncio.create_task(hold(t.training("a"), log, "train a", train_a)))
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b2", b2)))
    await settle()
    assert log == ["b1 in"]  # the step waits for b1, and b2 waits behind the step
    b1.set()
    await settle()
    assert log == ["b1 in", "b1 out", "train a in"] and t.solo_turns == 1
    train_a.set()
    await settle()
    assert log[-2:] == ["train a out", "b2 in"]
    b2.set()
    await asyncio.gather(*tasks)


async def test_a_call_that_comes_during_a_step_waits_for_it():
    """A step begun with nobody else sampling holds the first call of another experiment that comes meanwhile
    (beside it the step would run at what the sampler leaves of the cores)."""
    t = ComputeTurns(alternate=True, clock=Clock())
    log: list[str] = []
    train_a, b1 = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(t.training("a"), log, "train a", train_a))]
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b1", b1)))
    await settle()
    assert log == ["train a in"] and t.solo_turns == 1
    train_a.set()
    await settle()
    assert log[-2:] == ["train a out", "b1 in"]
    b1.set()
    await asyncio.gather(*tasks)


async def test_solo_turns_leave_the_others_their_share_of_the_time():
    """Once b was held d seconds, the next step that would hold it waits until b has sampled OTHERS_SHARE x d
    (not beside it: that made a step 7x slower); a step begun while b does not sample lets b run beside it
    until then."""
    clock = Clock()
    t = ComputeTurns(alternate=True, clock=clock)
    log: list[str] = []
    first, b1 = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(t.training("a"), log, "train a", first))]
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b1", b1)))
    await settle()
    clock.now += 2.0  # b1 held for 2 s
    first.set()
    b1.set()
    await asyncio.gather(*tasks)
    free_at = clock.now + OTHERS_SHARE * 2.0

    async with t.sampling("b"):  # b samples on
        pass
    second = asyncio.Event()
    task = asyncio.create_task(hold(t.training("a"), log, "train a 2", second))
    await asyncio.sleep(3 * turns.SOLO_POLL_S)
    assert "train a 2 in" not in log  # b's share is not over: a waits rather than step beside b
    clock.now = free_at
    async with t.sampling("b"):  # b sampled just now: the step may take its turn
        pass
    await asyncio.sleep(3 * turns.SOLO_POLL_S)
    assert log[-1] == "train a 2 in"
    b2 = asyncio.Event()
    task_b = asyncio.create_task(hold(t.sampling("b"), log, "b2", b2))
    await settle()
    assert log[-1] == "train a 2 in"  # b's share was over: held again
    clock.now += 1.0  # for 1 s: b is owed 2 s from the step's end
    second.set()
    await task
    b2.set()
    await task_b
    assert log[-2:] == ["b2 in", "b2 out"]

    clock.now += 1.5 * turns.RECENT_SAMPLING_S  # b pauses: a's next step begins at once
    third = asyncio.Event()
    task = asyncio.create_task(hold(t.training("a"), log, "train a 3", third))
    await settle()
    assert log[-1] == "train a 3 in"
    async with t.sampling("b"):  # b comes back during it, owed time: it runs beside the step
        log.append("b beside")
    assert log[-1] == "b beside" and t.solo_turns == 2
    third.set()
    await task


async def test_a_claim_outlasted_by_long_calls_shares_the_cores(monkeypatch):
    """Others' calls in flight past SOLO_CLAIM_S: the step stops holding their new calls and runs beside them."""
    monkeypatch.setattr(turns, "SOLO_CLAIM_S", 0.05)
    t = ComputeTurns(alternate=True)
    log: list[str] = []
    b1, train_a, b2 = (asyncio.Event() for _ in range(3))
    tasks = [asyncio.create_task(hold(t.sampling("b"), log, "b1", b1))]
    await settle()
    tasks.append(asyncio.create_task(hold(t.training("a"), log, "train a", train_a)))
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b2", b2)))
    await asyncio.sleep(0.2)
    assert log == ["b1 in", "train a in", "b2 in"] and t.solo_turns == 0
    for event in (b1, train_a, b2):
        event.set()
    await asyncio.gather(*tasks)


async def test_a_step_cancelled_while_claiming_holds_no_one():
    t = ComputeTurns(alternate=True)
    log: list[str] = []
    b1, b2 = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(t.sampling("b"), log, "b1", b1))]
    await settle()
    training = asyncio.create_task(hold(t.training("a"), log, "train a", asyncio.Event()))
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b2", b2)))
    await settle()
    assert log == ["b1 in"]
    training.cancel()  # the experiment was deleted meanwhile
    await settle()
    assert log == ["b1 in", "b2 in"]
    b1.set()
    b2.set()
    await asyncio.gather(*tasks)
    assert training.cancelled()


async def test_the_gate_is_phase_fair():
    """A stream of exclusive holders (one tenant's prompt-logprob scores or train steps) no longer holds shared
    calls back for as long as it lasts: a shared waiter waits out one exclusive hold, and an exclusive waiter
    still goes before shared calls that come after it."""
    from grpo_server.protocol.gate import Gate

    gate, order = Gate(), []

    async def exclusive(tag: str) -> None:
        async with gate.exclusive():
            order.append(tag)
            await asyncio.sleep(0.02)

    async def shared(tag: str) -> None:
        async with gate.shared():
            order.append(tag)
            await asyncio.sleep(0.02)

    first = asyncio.create_task(exclusive("x1"))
    await asyncio.sleep(0.005)
    queued = [asyncio.create_task(exclusive(f"x{i}")) for i in (2, 3, 4)]
    await asyncio.sleep(0.005)
    reader = asyncio.create_task(shared("s1"))  # arrives while x1 holds and x2..x4 wait
    await asyncio.gather(first, *queued, reader)
    assert order.index("s1") == 1, order  # after x1, before x2: one exclusive hold waited out

    order.clear()
    reading = asyncio.create_task(shared("s2"))
    await asyncio.sleep(0.005)
    writer = asyncio.create_task(exclusive("x5"))
    await asyncio.sleep(0.005)
    late = asyncio.create_task(shared("s3"))  # came after x5 began to wait: after it
    await asyncio.gather(reading, writer, late)
    assert order == ["s2", "x5", "s3"], order


class FakePause:
    def __init__(self, works: bool = True) -> None:
        self.works = works
        self.calls: list[str] = []

    async def pause_samplers(self, lease_s: float) -> bool:
        self.calls.append(f"pause {lease_s:g}")
        return self.works

    async def resume_samplers(self) -> None:
        self.calls.append("resume")


async def test_a_solo_turn_pauses_the_others_calls_in_flight_instead_of_waiting_for_them():
    """With samplers that pause, a's step does not wait for b's call in flight to end (b's request could run for
    minutes): the samplers freeze it, the step runs, they resume once the step is done; b's new call still waits."""
    pauser = FakePause()
    t = ComputeTurns(alternate=True, clock=Clock(), pauser=pauser)
    log: list[str] = []
    b1, train_a, b2 = (asyncio.Event() for _ in range(3))
    tasks = [asyncio.create_task(hold(t.sampling("b"), log, "b1", b1))]
    await settle()
    tasks.append(asyncio.create_task(hold(t.training("a"), log, "train a", train_a)))
    await settle()
    tasks.append(asyncio.create_task(hold(t.sampling("b"), log, "b2", b2)))
    await settle()
    assert log == ["b1 in", "train a in"] and t.solo_turns == 1  # at once, b1 still in flight (frozen)
    assert pauser.calls == [f"pause {turns.PAUSE_LEASE_S:g}"]
    train_a.set()
    await settle()
    assert pauser.calls[-1] == "resume" and log[-2:] == ["train a out", "b2 in"]
    b1.set()
    b2.set()
    await asyncio.gather(*tasks)
    assert pauser.calls.count("resume") == 1  # b's calls end no pause of their own


async def test_samplers_that_cannot_pause_leave_the_solo_turn_as_it_was():
    pauser = FakePause(works=False)
    t = ComputeTurns(alternate=True, clock=Clock(), pauser=pauser)
    log: list[str] = []
    b1, train_a = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold(t.sampling("b"), log, "b1", b1))]
    await settle()
    tasks.append(asyncio.create_task(hold(t.training("a"), log, "train a", train_a)))
    await settle()
    assert log == ["b1 in"]  # waits for b1, as without a pauser
    b1.set()
    await settle()
    assert log == ["b1 in", "b1 out", "train a in"]
    train_a.set()
    await asyncio.gather(*tasks)
    assert "resume" not in pauser.calls[1:]  # nothing was paused for it to resume
