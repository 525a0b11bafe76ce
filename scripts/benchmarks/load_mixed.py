"""Load, mixed round (`python -m scripts.benchmarks.load --mix`): load.py's C clients split into four kinds
(load_kinds.py: plain completions + feedback, streaming chat completions, agent episodes, tool calls), at once.

Recorded per kind and endpoint: answers by status and latency percentiles (and a stream's first chunk); the
front end's RSS (before / peak / right after / after the TTL), the event-loop lag (GET /v1/health every
LAG_EVERY_S during the load: its `event_loop_lag_p99_s` and `event_loop_lag_max_s`, each over the server's last
minute, and the health call's own latency) and after the TTL the tokens still held (`grpo_held_tokens` of
/metrics). The verdict is 0 answers of 5xx (or a stream failed after its headers); RSS is judged flat when the
RSS after the TTL is within RSS_FLAT_MIB of the RSS before (the groups and episodes have expired or trained by
then, so the held tokens are back to 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .load import EXPIRY_INTERVAL_S, experiment_config, get_json, percentiles, rss_kib, watch_rss
from .host import loadavg
from .load_kinds import CLIENTS, DEFAULT_MIX, TOOL_MAX_TOKENS, WEATHER, Round, split_clients

LAG_EVERY_S = 1.0
RSS_FLAT_MIB = 32


class LagWatch:
    """GET /v1/health every `every_s` until `done`: the server's event-loop lag fields and the call's latency."""

    def __init__(self) -> None:
        self.p99: list[float] = []
        self.max: list[float] = []
        self.health_s: list[float] = []
        self.failures = 0

    async def run(self, session: aiohttp.ClientSession, url: str, done: asyncio.Event, every_s: float) -> None:
        while not done.is_set():
            await self.sample(session, url)
            try:
                await asyncio.wait_for(done.wait(), every_s)
            except asyncio.TimeoutError:
                pass

    async def sample(self, session: aiohttp.ClientSession, url: str) -> None:
        asked = time.perf_counter()
        try:
            async with session.get(url + "/v1/health", timeout=aiohttp.ClientTimeout(total=10)) as response:
                body = await response.json()
            self.health_s.append(time.perf_counter() - asked)
            self.p99.append(body["event_loop_lag_p99_s"])
            self.max.append(body["event_loop_lag_max_s"])
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError, KeyError):
            self.failures += 1

    def summary(self) -> dict:
        return {"samples": len(self.p99), "failures": self.failures,
                "lag_p99_s": round(max(self.p99), 4) if self.p99 else None,
                "lag_p99_median_s": round(statistics.median(self.p99), 4) if self.p99 else None,
                "lag_max_s": round(max(self.max), 4) if self.max else None,
                "health_latency_s": percentiles(self.health_s)}


@dataclass
class MixedResult:
    clients: dict[str, int]
    duration_s: float
    timeout_s: float
    round: Round
    rss_kib: dict[str, int | None]
    lag: LagWatch
    cpu_s: float | None = None  # the front end's CPU seconds during the load

    def server_errors(self) -> int:
        """5xx answers, and streams that failed after their headers (a 5xx hidden behind a 200)."""
        return sum(v for kind in self.round.stats.values() for s in kind.values() for k, v in s.by_status.items()
                   if k.startswith("5") or k in ("stream_error", "stream_cut"))

    def summary(self) -> dict:
        kinds = {kind: {endpoint: s.summary(self.duration_s) for endpoint, s in endpoints.items()}
                 for kind, endpoints in self.round.stats.items()}
        errors = sum(s.errors for endpoints in self.round.stats.values() for s in endpoints.values())
        return {"clients": sum(self.clients.values()), "clients_by_kind": self.clients,
                "duration_s": round(self.duration_s, 2), "timeout_s": self.timeout_s, "kinds": kinds,
                "stream_first_chunk_s": percentiles(self.round.first_chunk_s), "tool_calls": self.round.tool_calls,
                "left_unrated": self.round.left_unrated, "errors": errors, "server_errors": self.server_errors(),
                "kinds_without_2xx": [kind for kind, endpoints in self.round.stats.items()
                                      if self.clients.get(kind) and not all(s.ok for s in endpoints.values())],
                "rss_kib": self.rss_kib, "loop_lag": self.lag.summary(), "front_end_cpu_s": self.cpu_s,
                "front_end_cpu_share": None if self.cpu_s is None else round(self.cpu_s / self.duration_s, 3)}


async def run_mixed(url: str, api_key: str, experiment: str, *, clients: int = 200, mix: str = DEFAULT_MIX,
                    duration_s: float = 60.0, n: int = 4, max_tokens: int = 4, timeout_s: float = 30.0,
                    abandon: float = 0.1, pid: int | None = None, seed: int = 0) -> MixedResult:
    """The mixed round against an existing experiment: `clients` split by `mix`, each kind looping its calls
    for `duration_s`; with `pid`, that process's RSS every 0.25 s; /v1/health every LAG_EVERY_S."""
    rng = random.Random(seed)
    split = split_clients(clients, mix)
    rss = {"before": rss_kib(pid), "peak": rss_kib(pid), "after_load": None}
    done, lag, cpu0 = asyncio.Event(), LagWatch(), cpu_s(pid)

    async def start(kind: str, index: int, r: Round, client_rng: random.Random) -> None:
        await asyncio.sleep(client_rng.random() * 0.5)  # spread the first wave a little
        await CLIENTS[kind](r, index, client_rng)

    connector = aiohttp.TCPConnector(limit=clients + 16, limit_per_host=clients + 16)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        r = Round(session, url.rstrip("/"), experiment, {"Authorization": f"Bearer {api_key}"},
                  aiohttp.ClientTimeout(total=timeout_s), started + duration_s, n, max_tokens, abandon)
        watchers = [asyncio.create_task(watch_rss(pid, rss, done)),
                    asyncio.create_task(lag.run(session, r.url, done, LAG_EVERY_S))]
        jobs, index = [], 0
        for kind, count in split.items():
            for _ in range(count):
                jobs.append(start(kind, index, r, random.Random(rng.random())))
                index += 1
        try:
            await asyncio.gather(*jobs)
        finally:
            elapsed = time.monotonic() - started
            done.set()
            await asyncio.gather(*watchers)
    rss["after_load"], cpu1 = rss_kib(pid), cpu_s(pid)
    result = MixedResult(split, elapsed, timeout_s, r, rss, lag)
    result.cpu_s = None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 1)
    return result


async def held_tokens(session: aiohttp.ClientSession, url: str, api_key: str) -> dict[str, float]:
    """`grpo_held_tokens` of /metrics by experiment ("" is the whole server)."""
    async with session.get(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"}) as response:
        text = await response.text()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("grpo_held_tokens{")}


async def benchmark(url: str, api_key: str, pid: int | None, args: argparse.Namespace) -> dict:
    """load.py's benchmark with the mixed round: create, warm each kind up, run, wait out the TTL, delete."""
    name, admin = args.experiment, {"Authorization": f"Bearer {api_key}"}
    long = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/experiments", headers=admin, timeout=long,
                                json=experiment_config(name, args.n, args.max_tokens, args.batch_groups)) as response:
            if response.status != 201:
                raise RuntimeError(f"create experiment: {response.status} {await response.text()}")
        # Warm-up, not counted: the first request under an adapter, the first forced tool call (its grammar).
        for body in ({"model": name, "messages": [{"role": "user", "content": "Warm up"}], "n": 1, "max_tokens": 4},
                     {"model": name, "messages": [{"role": "user", "content": "Weather?"}], "n": 1, "tools": [WEATHER],
                      "tool_choice": "required", "parallel_tool_calls": False,
                      "max_tokens": TOOL_MAX_TOKENS}):
            async with session.post(f"{url}/v1/chat/completions", headers=admin, json=body, timeout=long) as response:
                if response.status != 200:
                    raise RuntimeError(f"warm-up: {response.status} {await response.text()}")
        await asyncio.sleep(2)  # let the server settle before the 'before' RSS
        load_before = loadavg()
        try:
            result = await run_mixed(url, api_key, name, clients=args.clients, mix=args.mix, duration_s=args.duration,
                                     n=args.n, max_tokens=args.max_tokens, timeout_s=args.timeout,
                                     abandon=args.abandon, pid=pid, seed=args.seed)
            after_load = await get_json(session, f"{url}/v1/experiments/{name}", api_key)
            load_after = loadavg()
            lag_after_load = LagWatch()  # the last minute: the load's
            await lag_after_load.sample(session, url)
            wait_s = args.ttl + EXPIRY_INTERVAL_S + 3
            print(f"load done; waiting {wait_s:.0f} s for the group and episode TTL ...", flush=True)
            await asyncio.sleep(wait_s)
            after_ttl = await get_json(session, f"{url}/v1/experiments/{name}", api_key)
            result.rss_kib["after_ttl"] = rss_kib(pid)
            held = await held_tokens(session, url, api_key)
            health = await get_json(session, f"{url}/v1/health", api_key)
        finally:
            if not args.keep_experiment:
                async with session.delete(f"{url}/v1/experiments/{name}", headers=admin,
                                          timeout=aiohttp.ClientTimeout(total=120)) as response:
                    await response.read()

    def brief(status: dict) -> dict:
        keys = ("policy_version", "step", "queued_groups", "pending_groups", "pending_episodes", "state")
        return {**{k: status[k] for k in keys}, "counters": status["counters"], "errors": status["errors"][-3:]}

    rss = result.rss_kib
    growth = (rss["after_ttl"] - rss["before"]) / 1024 if rss.get("after_ttl") and rss["before"] else None
    load = result.summary()
    load["loop_lag_after_load"] = lag_after_load.summary()
    return {"mode": "mixed", "load_average": [load_before, load_after], "load": load,
            "status_after_load": brief(after_load), "status_after_ttl": brief(after_ttl),
            "pending_groups_after_ttl": after_ttl["pending_groups"] + after_ttl["pending_episodes"],
            "held_tokens_after_ttl": held, "rss_growth_mib": None if growth is None else round(growth, 1),
            "rss_flat": None if growth is None else growth <= RSS_FLAT_MIB, "health_after": health}


def cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (None without a pid or once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, ValueError, IndexError):
        return None


def _ms(stats: dict | None) -> str:
    if not stats:
        return "-"
    return f"{stats['p50'] * 1000:.0f} / {stats['p95'] * 1000:.0f} / {stats['p99'] * 1000:.0f}"


def print_table(result: dict) -> None:
    load = result["load"]
    print(f"\nload average (1 min) {result['load_average'][0]} before, {result['load_average'][1]} after the load")
    print(f"{load['clients']} clients ({', '.join(f'{k} {v}' for k, v in load['clients_by_kind'].items())}), "
          f"{load['duration_s']:.1f} s, request timeout {load['timeout_s']:.0f} s")
    print(f"{'kind':<8} {'endpoint':<12} {'2xx':>6} {'429':>6} {'5xx':>5} {'other':>6} {'timeout':>8} {'conn':>5} "
          f"{'2xx/s':>7}  {'2xx p50/p95/p99 ms':>20}  {'max s':>6}")
    for kind, endpoints in load["kinds"].items():
        for endpoint, s in endpoints.items():
            fives = sum(v for k, v in s["by_status"].items() if k.startswith(("5", "stream_")))
            other = s["by_class"]["other"] + s["by_class"]["503"] - fives
            print(f"{kind:<8} {endpoint:<12} {s['by_class']['2xx']:>6} {s['by_class']['429']:>6} {fives:>5} "
                  f"{other:>6} {s['timeouts']:>8} {s['connection_errors']:>5} {s['ok_per_s']:>7}  "
                  f"{_ms(s['latency_ok_s']):>20}  {s['max_latency_s']:>6.2f}")
    print(f"stream first chunk p50/p95/p99 ms: {_ms(load['stream_first_chunk_s'])}; tool calls: {load['tool_calls']}")
    rss = {k: (f"{v / 1024:.1f} MiB" if v else "-") for k, v in load["rss_kib"].items()}
    print("front-end RSS: " + ", ".join(f"{k} {v}" for k, v in rss.items())
          + f" (after the TTL - before: {result['rss_growth_mib']} MiB; flat if <= {RSS_FLAT_MIB}: "
          f"{result['rss_flat']})")
    lag, after = load["loop_lag"], load["loop_lag_after_load"]
    print(f"event-loop lag during the load ({lag['samples']} health samples, {lag['failures']} failed): p99 max "
          f"{lag['lag_p99_s']} s (median of samples {lag['lag_p99_median_s']} s), max {lag['lag_max_s']} s; health "
          f"p50/p95/p99 ms {_ms(lag['health_latency_s'])}; right after the load: p99 {after['lag_p99_s']} s, "
          f"max {after['lag_max_s']} s; front end CPU {load['front_end_cpu_s']} s "
          f"({load['front_end_cpu_share']} of a core)")
    a, t = result["status_after_load"], result["status_after_ttl"]
    print(f"left unrated: {load['left_unrated']}; pending groups / episodes after load {a['pending_groups']} / "
          f"{a['pending_episodes']}, after the TTL {t['pending_groups']} / {t['pending_episodes']}; held tokens "
          f"after the TTL {result['held_tokens_after_ttl']}")
    c = t["counters"]
    print(f"learner: policy_version {a['policy_version']} after load ({t['policy_version']} after TTL), groups trained "
          f"{c['groups_trained']}, dropped stale {c['groups_dropped_stale']}, episodes rated {c['episodes_rated']}, "
          f"expired {c['episodes_expired']}; status errors {t['errors']}; health after: "
          f"{result['health_after']['status']}")
    print(f"5xx (and failed streams): {load['server_errors']}; errors other than 429: {load['errors']}; kinds "
          f"without 2xx on every endpoint: {load['kinds_without_2xx'] or 'none'}")
    for kind, endpoints in load["kinds"].items():
        for endpoint, s in endpoints.items():
            for sample in s["error_samples"]:
                print(f"  {kind} {endpoint} error: {sample}")
