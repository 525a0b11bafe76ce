"""sampler/weight_turns.py: the weight states take turns (FIFO, budgeted, never starving, never idle turns),
and every request runs on the weights it needs; sampler/merged_serving.py's choice of weights for several
experiments at once. Fake switches and a fake clock, no vLLM."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from grpo_server.protocol.gate import Gate
from grpo_server.protocol.wire import AdapterRef
from sampler import weight_turns
from sampler.merged_serving import ExperimentsSampling, MergedServing
from sampler.weight_turns import WeightTurns


class FakeEngine:
    """The weights a fake engine holds, its running requests, and what every switch did."""

    def __init__(self, switch_s: float = 0.0) -> None:
        self.now = 0.0
        self.held: str | None = None
        self.running = 0
        self.switches: list[str | None] = []
        self.waiting_needs: list[str | None] = []  # what the requests not yet let in need, for the checks
        self.switch_s = switch_s
        self.fail: set[str | None] = set()
        self.turns = WeightTurns(lambda: self.held, self.switch, clock=lambda: self.now)

    async def switch(self, state: str | None) -> None:
        assert self.running == 0, "weights changed under a running request"
        assert state in self.waiting_needs, f"a turn for {state!r}, which nobody waits for"
        self.switches.append(state)
        await asyncio.sleep(0)
        self.now += self.switch_s
        if state in self.fail:
            raise RuntimeError(f"cannot merge {state}")
        self.held = state

    async def request(self, need: str | None, log: list[str], name: str, release: asyncio.Event | None = None,
                      steps: int = 3, need_fn=None) -> str | None:
        """One request: checks the weights on entering, while it runs, and on leaving. `need_fn`: a need
        that changes while it waits (`need` is then only what it first asked for)."""
        self.waiting_needs.append(need)
        entered = False
        try:
            async with self.turns.turn(need_fn or (lambda: need)) as held:
                entered = True
                self.waiting_needs.remove(need)
                need = need_fn() if need_fn else need
                assert held == need == self.held
                self.running += 1
                log.append(f"{name} in")
                try:
                    if release is not None:
                        await release.wait()
                    for _ in range(steps):
                        await asyncio.sleep(0)
                        assert self.held == need
                finally:
                    self.running -= 1
                log.append(f"{name} out")
                return held
        finally:
            if not entered:
                self.waiting_needs.remove(need)


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def holding(e: FakeEngine, log: list[str], need: str | None, name: str) -> tuple[asyncio.Task, asyncio.Event]:
    """A request let into the current turn, running until the returned event is set."""
    release = asyncio.Event()
    running = asyncio.create_task(e.request(need, log, name, release))
    await settle()
    return running, release


async def test_requests_for_the_held_state_run_together() -> None:
    e, log = FakeEngine(), []
    release = asyncio.Event()
    tasks = [asyncio.create_task(e.request(None, log, f"r{i}", release)) for i in range(3)]
    await settle()
    assert log == ["r0 in", "r1 in", "r2 in"] and e.switches == []
    release.set()
    assert await asyncio.gather(*tasks) == [None, None, None]


async def test_states_take_turns_in_the_order_their_oldest_waiter_came() -> None:
    e, log = FakeEngine(), []
    release = asyncio.Event()
    first = asyncio.create_task(e.request(None, log, "base", release))
    await settle()
    tasks = [asyncio.create_task(e.request(need, log, name))
             for need, name in [("B", "b1"), ("C", "c1"), ("B", "b2"), ("A", "a1"), (None, "base2")]]
    await settle()
    # base2 arrived after others waited, but within the turn's budget: it joins the running turn.
    assert log[:2] == ["base in", "base2 in"] and e.switches == []
    release.set()
    await asyncio.gather(first, *tasks)
    assert e.switches == ["B", "C", "A"]
    assert log.index("b2 in") < log.index("b1 out")  # B's two requests ran in one turn, together
    assert log.index("c1 in") > log.index("b2 out") and log.index("a1 in") > log.index("c1 out")


async def test_past_the_budget_a_stream_for_the_held_state_cannot_starve_another() -> None:
    e, log = FakeEngine(), []
    budget = e.turns.budget()
    assert budget == weight_turns.MIN_TURN_S
    stop = asyncio.Event()

    async def stream() -> None:  # requests for A, one after another, each running a while
        i = 0
        while not stop.is_set():
            await e.request("A", log, f"a{i}", steps=5)
            e.now += 0.5
            i += 1

    streams = [asyncio.create_task(stream()) for _ in range(2)]
    await settle(50)
    assert e.held == "A" and e.switches == ["A"]
    e.now += budget  # A's turn has run its budget, B has not come yet: A keeps going
    await settle(50)
    assert e.switches == ["A"]
    b = asyncio.create_task(e.request("B", log, "b"))
    await settle(200)
    # Past the budget with B waiting: A's running requests finish, the next A's wait, B gets its turn.
    assert b.done() and e.switches[:2] == ["A", "B"]
    assert await b == "B"
    await settle(100)
    assert e.switches[:3] == ["A", "B", "A"]  # and the waiting A's get theirs back
    stop.set()
    await asyncio.gather(*streams)


async def test_within_the_budget_the_held_state_still_lets_its_requests_in() -> None:
    e, log = FakeEngine(), []
    running, release = await holding(e, log, None, "r0")
    waiting_b = asyncio.create_task(e.request("B", log, "b"))
    e.now += e.turns.budget() - 0.1
    joined = asyncio.create_task(e.request(None, log, "r1", release))
    await settle()
    assert log == ["r0 in", "r1 in"]
    # Now spent. (Past the cap: the holds that end meanwhile, as long as the clock's jump, raise the budget.)
    e.now = weight_turns.MAX_TURN_S + 1
    late = asyncio.create_task(e.request(None, log, "r2", release))
    await settle()
    assert log == ["r0 in", "r1 in"]
    release.set()
    await asyncio.gather(running, joined, waiting_b, late)
    assert e.switches == ["B", None]
    assert log.index("b out") < log.index("r2 in")


async def test_a_state_nobody_waits_for_gets_no_turn() -> None:
    e, log = FakeEngine(), []  # FakeEngine.switch asserts someone waits for every switch's state
    running, release = await holding(e, log, None, "r0")
    gone = asyncio.create_task(e.request("C", log, "c"))
    b = asyncio.create_task(e.request("B", log, "b"))
    await settle()
    gone.cancel()  # the client went away: C's only waiter
    await settle()
    release.set()
    await asyncio.gather(running, b)
    assert e.switches == ["B"]
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert e.turns._running == 0 and e.turns._waiting == []


async def test_a_request_cancelled_while_running_frees_its_turn() -> None:
    e, log = FakeEngine(), []
    never = asyncio.Event()
    stuck = asyncio.create_task(e.request(None, log, "stuck", never))
    await settle()
    b = asyncio.create_task(e.request("B", log, "b"))
    await settle()
    stuck.cancel()
    assert await b == "B"


async def test_the_need_is_asked_again_while_waiting() -> None:
    """A request for an experiment's newest version needs it merged; a newer version loaded while the request
    waits makes it an older one: the base weights (LoRA), and no turn for the version it first named."""
    e, log = FakeEngine(), []
    running, release = await holding(e, log, "A@v2", "a")
    newest = {"B": "B@v1"}
    b = asyncio.create_task(e.request("B@v1", log, "b",
                                      need_fn=lambda: "B@v1" if newest["B"] == "B@v1" else None))
    base = asyncio.create_task(e.request(None, log, "base"))
    await settle()
    newest["B"] = "B@v2"
    release.set()
    assert await b is None and await base is None
    await running
    assert e.switches == ["A@v2", None]


async def test_a_failed_switch_fails_that_states_waiters_and_the_others_go_on() -> None:
    e, log = FakeEngine(), []
    e.fail.add("B")
    running, release = await holding(e, log, None, "r0")
    b = asyncio.create_task(e.request("B", log, "b"))
    c = asyncio.create_task(e.request("C", log, "c"))
    await settle()
    release.set()
    await running
    with pytest.raises(RuntimeError, match="cannot merge B"):
        await b
    assert await c == "C" and e.switches == ["B", "C"]


def test_the_budget_follows_the_measured_switch_and_hold_times() -> None:
    turns = WeightTurns(lambda: None, None, clock=lambda: 0.0)  # type: ignore[arg-type]
    assert turns.budget() == weight_turns.MIN_TURN_S
    turns._switch_s = 0.5
    assert turns.budget() == 0.5 * weight_turns.SWITCH_MULTIPLE
    turns._hold_s = 4.0
    assert turns.budget() == 4.0 * weight_turns.HOLD_MULTIPLE
    turns._switch_s = 100.0
    assert turns.budget() == weight_turns.MAX_TURN_S


async def test_the_budget_is_measured() -> None:
    e, log = FakeEngine(switch_s=0.4), []
    await e.request("A", log, "a")
    assert e.turns._switch_s == pytest.approx(0.4)
    assert e.turns.budget() == pytest.approx(0.4 * weight_turns.SWITCH_MULTIPLE)


@pytest.mark.parametrize("seed", range(5))
async def test_many_requests_for_random_states_each_run_on_their_own_weights(seed: int) -> None:
    rng = random.Random(seed)
    e, log = FakeEngine(switch_s=0.3), []
    states = [None, "A", "B", "C"]
    served: list[tuple[str | None, str | None]] = []

    async def one(i: int) -> None:
        await asyncio.sleep(0)
        for _ in range(rng.randrange(0, 40)):
            await asyncio.sleep(0)
        need = rng.choice(states)
        held = await e.request(need, log, f"r{i}", steps=rng.randrange(1, 15))
        e.now += 0.05
        served.append((need, held))

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(300))), timeout=30)
    assert len(served) == 300 and all(need == held for need, held in served)
    assert e.turns._running == 0 and e.turns._waiting == [] and e.running == 0
    # Turns, not ping-pong: far fewer switches than requests.
    assert len(e.switches) < 100, len(e.switches)


class FakeSampler(MergedServing):
    """sampler/merged_serving.py's policy on a fake engine: merges are recorded, not made."""

    def __init__(self, several_experiments: str, lone_after_s: float = 0.0, dtype: str = "float32") -> None:
        self.config = SimpleNamespace(several_experiments=several_experiments, lone_after_s=lone_after_s, dtype=dtype)
        self._gate = Gate()
        self.merged: str | None = None
        self.merge_unsupported: str | None = None
        self.merges: list[str | None] = []
        refs = [AdapterRef(name=name, version=1) for name in ("a", "b")]
        self._adapters = {ref.key: SimpleNamespace(ref=ref, path=ref.key) for ref in refs}
        self._llm = SimpleNamespace(collective_rpc=self._merge, reset_prefix_cache=self._reset)

    async def _merge(self, method: str, args: tuple) -> list[float]:
        self.merges.append(args[0])
        return [0.0]

    async def _reset(self) -> bool:
        return True

    async def sample(self, name: str) -> str:
        async with self._serving(AdapterRef(name=name, version=1)) as served_as:
            await asyncio.sleep(0.01)
            return served_as


@pytest.mark.parametrize("policy, dtype, served_as", [
    ("lora_batch", "float32", "lora"), ("turns", "float32", "merged"), ("lora_batch", "bfloat16", "lora"),
    ("auto", "float32", "lora"), ("auto", "auto", "lora"), ("auto", "bfloat16", "merged")])
async def test_several_experiments_at_once_batch_through_lora_or_take_turns(policy: str, dtype: str,
                                                                             served_as: str) -> None:
    # auto: turns where the sampler computes in bf16 (its LoRA path applies small updates only in part), else
    # lora_batch; a resolved CPU sampler's dtype is bfloat16, float32 or auto (float32 on a CPU).
    sampler = FakeSampler(policy, dtype=dtype)
    assert await asyncio.gather(sampler.sample("a"), sampler.sample("b"), sampler.sample("a")) == [served_as] * 3
    assert await sampler.sample("b") == "merged"  # alone: merged either way
    assert sampler.merges[-1] == "b@v1" and sum(sampler._sampling_now.requests.values()) == 0
    # While a request of a runs merged, one of b waits for it; a's next one meets b's and both go through LoRA.
    sampler = FakeSampler("lora_batch")
    assert await sampler.sample("a") == "merged"
    assert await asyncio.gather(sampler.sample("a"), sampler.sample("b"), sampler.sample("a")) == [
        "merged", "lora", "lora"]
    # Within lone_after_s of b's last request, a does not count as alone: no merge between b's groups.
    sampler = FakeSampler("lora_batch", lone_after_s=60.0)
    assert [await sampler.sample(name) for name in ("a", "b", "a")] == ["merged", "lora", "lora"]
    assert sampler.merges == ["a@v1", None]


def test_experiments_gone_quiet_are_forgotten(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr("sampler.merged_serving.time.monotonic", lambda: now[0])
    sampling = ExperimentsSampling()
    a, b = sampling.started("a"), sampling.started("b")
    assert sampling.others_than("a", within_s=5.0)
    b.end()
    b.end()  # idempotent
    now[0] += 4.0
    assert sampling.others_than("a", within_s=5.0)  # b ended 4 s ago: still counts
    now[0] += 2.0
    assert not sampling.others_than("a", within_s=5.0)
    assert dict(sampling.requests) == {"a": 1} and "b" not in sampling.last_end
    a.end()
    now[0] += 6.0
    assert not sampling.others_than("c", within_s=5.0) and not sampling.requests and not sampling.last_end
