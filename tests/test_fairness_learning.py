"""A busy neighbour must not stop another experiment's learning (grpo_server/workers/turns.py, solo turns).

On 2 CPU cores a train step beside another experiment's sampling took 1.5-4x (tiny model, by the box's load)
to 7x (SmolLM2: 19 s, not 2.7 s) its time alone, so while `quiet` sampled back to back, flooded `noisy` made 0
steps in the fairness figure's 30 s window (scripts/benchmarks/fairness.py). A train step is now a solo turn
(other experiments' calls wait for it), bounded in length and in share of the time. tests/test_turns.py pins
down the turns in-process; this test checks both sides of the trade on a real server (the tiny model): noisy's
steps beside quiet's continuous sampling come within a bounded time, and none of quiet's requests runs within one
of them (on the tiny model the slowdown alone is too small, next to a loaded box's noise, to tell the two apart).
quiet's latency beside the flood against alone is printed, not asserted: the 2x is the fairness benchmark's.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp

from grpo_server.client import AsyncClient, GrpoServerError
from tests.serving import headers, wait_for

NOISY_CLIENTS = 8
STEPS_BESIDE = 4  # noisy's train steps measured while quiet samples
STEPS_WITHIN_S = 90.0  # ... all of them within this (about 12 s here with solo turns; a loaded box is slower)


# The session's real server (tests/conftest.py `server`): the test's two experiments are its own, and deleted at
# the end; another test's experiment that trains meanwhile takes turns as these do.


async def train_records(server, name: str, after_step: int) -> list[dict]:
    """The experiment's `train` lines after `after_step` (its metrics log: `time` when the front end had the
    answer, epoch seconds; `step_seconds` the learner's own time for the step)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/v1/experiments/{name}/metrics", params={"kind": "train"},
                               headers=headers()) as response:
            records = (await response.json())["records"]
    return [r for r in records if r["step"] > after_step]


def inside(requests: list[tuple[float, float]], steps: list[dict], margin_s: float = 0.02) -> int:
    """How many of quiet's requests (asked, answered) ran from start to end within one of the learner's steps."""
    spans = [(r["time"] - r["step_seconds"] + margin_s, r["time"] - margin_s) for r in steps]
    return sum(any(lo < asked and answered < hi for lo, hi in spans) for asked, answered in requests)


async def test_a_flooded_experiment_keeps_learning_beside_one_sampling_continuously(server):
    async with AsyncClient(server.url, server.api_key, timeout_s=120) as client:
        for name in ("quiet", "noisy"):
            await client.create_experiment({"name": name, "sampling": {"n": 4, "max_tokens": 8},
                                            "algorithm": {"batch_groups": 2}})
        beside: list[tuple[float, float]] = []  # quiet's requests beside the flood: (asked, answered), epoch s

        async def one_quiet_request(i: int) -> float:
            asked = time.time()
            await client.complete("quiet", prompt=f"Say a word about {i}", n=4, max_tokens=8)
            beside.append((asked, time.time()))
            return beside[-1][1] - asked

        for i in range(2):  # warm-up: the first requests under an adapter are slow
            await one_quiet_request(i)
        alone = statistics.median([await one_quiet_request(i) for i in range(16)])
        beside.clear()
        stop_noisy, stop_quiet = asyncio.Event(), asyncio.Event()
        answered: dict[str, int] = {}

        async def noisy_client(seed: int) -> None:  # a tenant pushing as hard as it can: 429s retried at once
            while not stop_noisy.is_set():
                try:
                    group = await client.complete("noisy", prompt=f"Count to {seed}", n=4, max_tokens=8)
                    await client.feedback("noisy", group.group_id, [float(len(c.text) % 3) for c in group.completions])
                    answered["ok"] = answered.get("ok", 0) + 1
                except GrpoServerError as exc:
                    assert exc.status == 429, exc  # held back, never failed
                    answered[exc.code] = answered.get(exc.code, 0) + 1
                    await asyncio.sleep(0.05)

        async def quiet_client() -> None:  # one request after another, no pause
            i = 0
            while not stop_quiet.is_set():
                i += 1
                await one_quiet_request(i)

        flood = [asyncio.create_task(noisy_client(i)) for i in range(NOISY_CLIENTS)]
        try:
            # noisy alone first: its learner seconds per step with nobody beside it (step 1 warms up).
            await wait_for(lambda: _step_at_least(client, "noisy", 3), timeout_s=120, interval_s=0.2)
            alone_steps = [r["step_seconds"] for r in await train_records(server, "noisy", after_step=1)]
            quiet = asyncio.create_task(quiet_client())
            try:
                await wait_for(lambda: _ready(beside), timeout_s=60, interval_s=0.05)  # quiet is sampling
                # The step under way may have begun before quiet did: the measured ones begin after it.
                step_now = (await client.status("noisy")).step
                await wait_for(lambda: _step_at_least(client, "noisy", step_now + 1), timeout_s=60, interval_s=0.1)
                steps_before, started, quiet_from = (await client.status("noisy")).step, time.monotonic(), len(beside)
                await wait_for(lambda: _step_at_least(client, "noisy", steps_before + STEPS_BESIDE),
                               timeout_s=STEPS_WITHIN_S, interval_s=0.1)
                took = time.monotonic() - started
            finally:
                stop_quiet.set()
                await quiet
        finally:
            stop_noisy.set()
            await asyncio.gather(*flood)
        steps = (await train_records(server, "noisy", after_step=steps_before))[:STEPS_BESIDE]
        during = beside[quiet_from:]
        within_steps = inside(during, steps)
        status = await client.status("noisy")
        step_s = [r["step_seconds"] for r in steps]
        flooded = statistics.median(b - a for a, b in beside)
        step_alone, step_beside = statistics.median(alone_steps), statistics.median(step_s)
        print(f"noisy: {STEPS_BESIDE} steps in {took:.1f} s beside quiet ({len(during)} requests meanwhile, "
              f"{within_steps} of them within a step); learner seconds per step {step_alone:.2f} alone, "
              f"{step_beside:.2f} beside ({step_beside / step_alone:.2f}x); answers {answered}. quiet's median "
              f"latency: alone {alone * 1e3:.0f} ms, beside the flood {flooded * 1e3:.0f} ms ({flooded / alone:.2f}x)")
        assert not status.errors, status.errors
        assert answered.get("learner_behind"), answered  # it did flood: held back by its own learner, not failed
        assert len(during) >= 2 * STEPS_BESIDE, len(during)  # quiet sampled throughout, not only between steps
        # The cause: beside quiet's calls a step ran on what the sampler left of the cores (4-7x slower). In a
        # solo turn none of quiet's calls runs from start to end within a step.
        assert within_steps == 0, (within_steps, len(during), step_s)
        # What the neighbour paid (quiet's median beside the flood vs alone, printed above) is not asserted: a timing
        # bound on a shared box failed on its load (2.15x in a clean-clone run); the 2x is the fairness benchmark's.
        for name in ("quiet", "noisy"):
            await client.delete_experiment(name)


async def _step_at_least(client: AsyncClient, name: str, step: int) -> bool:
    return (await client.status(name)).step >= step


async def _ready(beside: list) -> bool:
    return bool(beside)
