"""Load: answers by status, latency percentiles and front-end RSS with C concurrent clients for D seconds.

    .venv/bin/python -m scripts.benchmarks.load [--clients 200 --duration 60 --ttl 20 --n 4 --max-tokens 4]
    .venv/bin/python -m scripts.benchmarks.load --url http://127.0.0.1:8000 --api-key KEY [--pid PID] ...
    .venv/bin/python -m scripts.benchmarks.load --mix [plain=2,stream=1,episode=1,tools=1] ...  # load_mixed.py

Without --url it starts `grpo-server serve` (tests/serving.py's start_server) on the tiny random Llama of
tests/tiny_model.py, with `group_ttl_s` (and `episode_ttl_s`) set to --ttl. It creates an experiment (n,
max_tokens, a small `batch_groups`, so the learner trains and pushes versions during the load), then runs C
clients, each looping: `completions`, then `feedback` with random rewards, except for a fraction of groups
(--abandon) left without feedback, to exercise the TTL expiry. A client that gets a 429 waits out its
Retry-After (capped at 2 s) as a well-behaved client does.

Every request has a timeout (--timeout); a request that runs past it counts as an error. An error is any
answer other than 2xx or 429, a timeout, or a connection error. Recorded: answers by status, errors,
latency percentiles of completions and feedback, throughput, the front end's RSS (VmRSS of the server
process: before, peak during the load, right after, and after the TTL has passed) and the experiment's
`pending_groups` after the TTL (groups without feedback expire, so it must fall to 0).

Prints a table and writes the JSON results to --out. Exit status: 1 if there was any error other than
429, 2 if pending groups did not expire, else 0. The load generator runs in this process, beside the
server on the same cores: on a small machine the figures measure the whole box, not the front end alone.
`run_load` is the importable core (tests/test_load.py uses it against the test session's server); only
`main` imports from scripts/benchmarks (load_mixed.py, for `--mix`: plain, streaming, episode and tool-call
clients at once; server.py, for the sampler a user gets), so the rest can be loaded by its path too.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

# grpo_server.runtime.orchestrator.EXPIRY_INTERVAL_S: how often the server drops expired groups
EXPIRY_INTERVAL_S = 5.0
RETRY_AFTER_CAP_S = 2.0
WORDS = ["river", "chess", "bread", "owl", "train", "tea", "glass", "map", "bee", "clock", "salt", "kite",
         "moss", "ink", "snow", "fern"]


@dataclass
class EndpointStats:
    """Answers of one endpoint: counts by status and latencies (seconds) of the 2xx and 429 ones."""

    by_status: dict[str, int] = field(default_factory=dict)
    timeouts: int = 0
    connection_errors: int = 0
    ok_latencies: list[float] = field(default_factory=list)
    throttled_latencies: list[float] = field(default_factory=list)
    max_latency_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)  # the first few error answers, for the report

    def record(self, status: int, seconds: float, detail: str = "") -> None:
        self.by_status[str(status)] = self.by_status.get(str(status), 0) + 1
        self.max_latency_s = max(self.max_latency_s, seconds)
        if 200 <= status < 300:
            self.ok_latencies.append(seconds)
        elif status == 429:
            self.throttled_latencies.append(seconds)
        elif len(self.error_samples) < 5:
            self.error_samples.append(f"{status}: {detail[:300]}")

    def record_failure(self, kind: str, seconds: float, detail: str) -> None:
        if kind == "timeout":
            self.timeouts += 1
        else:
            self.connection_errors += 1
        self.max_latency_s = max(self.max_latency_s, seconds)
        if len(self.error_samples) < 5:
            self.error_samples.append(f"{kind}: {detail[:300]}")

    @property
    def ok(self) -> int:
        return sum(v for k, v in self.by_status.items() if k.startswith("2"))

    @property
    def throttled(self) -> int:
        return self.by_status.get("429", 0)

    @property
    def errors(self) -> int:
        """Everything but 2xx and 429: other statuses, timeouts, connection errors."""
        other = sum(v for k, v in self.by_status.items() if not k.startswith("2") and k != "429")
        return other + self.timeouts + self.connection_errors

    def summary(self, duration_s: float) -> dict:
        classes = {"2xx": self.ok, "429": self.throttled, "503": self.by_status.get("503", 0),
                   "other": sum(v for k, v in self.by_status.items()
                                if not k.startswith("2") and k not in ("429", "503"))}
        return {
            "by_status": dict(sorted(self.by_status.items())), "by_class": classes,
            "timeouts": self.timeouts, "connection_errors": self.connection_errors, "errors": self.errors,
            "requests": sum(self.by_status.values()) + self.timeouts + self.connection_errors,
            "ok_per_s": round(self.ok / duration_s, 2) if duration_s > 0 else None,
            "latency_ok_s": percentiles(self.ok_latencies),
            "latency_429_s": percentiles(self.throttled_latencies),
            "max_latency_s": round(self.max_latency_s, 4), "error_samples": self.error_samples,
        }


def percentiles(values: list[float]) -> dict | None:
    """p50/p95/p99 (nearest rank) and the mean, in seconds."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(round(p / 100 * len(ordered) + 0.5)) - 1))]

    return {"p50": round(rank(50), 4), "p95": round(rank(95), 4), "p99": round(rank(99), 4),
            "mean": round(sum(ordered) / len(ordered), 4), "count": len(ordered)}


def rss_kib(pid: int | None) -> int | None:
    """VmRSS of a process in KiB (None without a pid or once it is gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


async def watch_rss(pid: int | None, rss: dict[str, int | None], done: asyncio.Event) -> None:
    """Keep `rss["peak"]` at the largest VmRSS of `pid` seen every 0.25 s, until `done` is set."""
    while not done.is_set():
        value = rss_kib(pid)
        if value is not None and (rss["peak"] is None or value > rss["peak"]):
            rss["peak"] = value
        try:
            await asyncio.wait_for(done.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


@dataclass
class LoadResult:
    clients: int
    duration_s: float  # the load's wall time, from the first request to the last answer
    timeout_s: float
    completions: EndpointStats
    feedback: EndpointStats
    groups_abandoned: int
    rss_kib: dict[str, int | None]

    @property
    def errors(self) -> int:
        return self.completions.errors + self.feedback.errors

    def summary(self) -> dict:
        return {"clients": self.clients, "duration_s": round(self.duration_s, 2), "timeout_s": self.timeout_s,
                "completions": self.completions.summary(self.duration_s),
                "feedback": self.feedback.summary(self.duration_s),
                "groups_abandoned": self.groups_abandoned, "errors": self.errors, "rss_kib": self.rss_kib}


async def _post(session: aiohttp.ClientSession, stats: EndpointStats, url: str, body: dict, headers: dict,
                timeout: aiohttp.ClientTimeout) -> tuple[int | None, dict | None, float | None]:
    """One POST with its timeout; recorded in `stats`. Returns (status, JSON body, Retry-After)."""
    started = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers, timeout=timeout) as response:
            raw = await response.read()
            seconds = time.perf_counter() - started
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None
            retry = response.headers.get("Retry-After")
            stats.record(response.status, seconds, raw.decode(errors="replace"))
            return response.status, payload, float(retry) if retry else None
    except asyncio.TimeoutError:
        stats.record_failure("timeout", time.perf_counter() - started, f"no answer within {timeout.total} s")
    except aiohttp.ClientError as exc:
        stats.record_failure("connection", time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
    return None, None, None


async def run_load(url: str, api_key: str, experiment: str, *, clients: int = 200, duration_s: float = 60.0,
                   n: int = 4, max_tokens: int = 4, timeout_s: float = 30.0, abandon: float = 0.1,
                   pid: int | None = None, seed: int = 0) -> LoadResult:
    """C clients loop `completions` then `feedback` (random rewards; a fraction `abandon` of groups gets
    none) against an existing experiment for `duration_s`; no client starts a completion after that, and
    every request gives up after `timeout_s` (counted as an error). With `pid`, samples that process's
    RSS every 0.25 s (before / peak / right after)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    completions, feedback = EndpointStats(), EndpointStats()
    abandoned = 0
    base = url.rstrip("/") + f"/v1/experiments/{experiment}"
    rss = {"before": rss_kib(pid), "peak": rss_kib(pid), "after_load": None}
    done = asyncio.Event()

    async def one_client(index: int, session: aiohttp.ClientSession, deadline: float) -> None:
        nonlocal abandoned
        client_rng = random.Random(rng.random())
        await asyncio.sleep(client_rng.random() * 0.5)  # spread the first wave a little
        while time.monotonic() < deadline:
            words = " ".join(client_rng.choice(WORDS) for _ in range(3))
            status, body, retry_after = await _post(session, completions, base + "/completions", {
                "messages": [{"role": "user", "content": f"Client {index}: say something about {words}."}],
                "n": n, "max_tokens": max_tokens, "temperature": 1.0}, headers, timeout)
            if status == 429:
                await asyncio.sleep(min(retry_after or 1.0, RETRY_AFTER_CAP_S) * (0.5 + client_rng.random()))
                continue
            if status is None or not 200 <= status < 300 or not body:
                await asyncio.sleep(0.2)  # an error: already counted; do not spin on it
                continue
            if client_rng.random() < abandon:
                abandoned += 1
                continue
            rewards = [client_rng.random() for _ in body["completions"]]
            await _post(session, feedback, base + "/feedback", {"group_id": body["group_id"], "rewards": rewards},
                        headers, timeout)

    connector = aiohttp.TCPConnector(limit=clients + 16, limit_per_host=clients + 16)
    async with aiohttp.ClientSession(connector=connector) as session:
        watcher = asyncio.create_task(watch_rss(pid, rss, done))
        started = time.monotonic()
        deadline = started + duration_s
        try:
            await asyncio.gather(*(one_client(i, session, deadline) for i in range(clients)))
        finally:
            elapsed = time.monotonic() - started
            done.set()
            await watcher
    rss["after_load"] = rss_kib(pid)
    return LoadResult(clients=clients, duration_s=elapsed, timeout_s=timeout_s, completions=completions,
                      feedback=feedback, groups_abandoned=abandoned, rss_kib=rss)


def experiment_config(name: str, n: int, max_tokens: int, batch_groups: int) -> dict:
    return {"name": name, "sampling": {"n": n, "max_tokens": max_tokens, "temperature": 1.0},
            "lora": {"r": 8, "alpha": 16},
            "algorithm": {"batch_groups": batch_groups, "micro_batch_size": 32, "max_staleness": 2}}


async def get_json(session: aiohttp.ClientSession, url: str, api_key: str, timeout_s: float = 30.0) -> dict:
    async with session.get(url, headers={"Authorization": f"Bearer {api_key}"},
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        response.raise_for_status()
        return await response.json()


async def benchmark(url: str, api_key: str, pid: int | None, args: argparse.Namespace) -> dict:
    name = args.experiment
    admin = {"Authorization": f"Bearer {api_key}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/experiments", headers=admin,
                                json=experiment_config(name, args.n, args.max_tokens, args.batch_groups),
                                timeout=aiohttp.ClientTimeout(total=300)) as response:
            if response.status != 201:
                raise RuntimeError(f"create experiment: {response.status} {await response.text()}")
        # Warm-up, not counted: the sampler's first request under an adapter is slow (engine warm-up).
        # Its group is left without feedback and expires with the others.
        async with session.post(f"{url}/v1/experiments/{name}/completions", headers=admin,
                                json={"prompt": "Warm up", "n": args.n, "max_tokens": args.max_tokens},
                                timeout=aiohttp.ClientTimeout(total=300)) as response:
            if response.status != 200:
                raise RuntimeError(f"warm-up completion: {response.status} {await response.text()}")
        await asyncio.sleep(2)  # let the server settle before the 'before' RSS
        try:
            load = await run_load(url, api_key, name, clients=args.clients, duration_s=args.duration, n=args.n,
                                  max_tokens=args.max_tokens, timeout_s=args.timeout, abandon=args.abandon,
                                  pid=pid, seed=args.seed)
            status_after_load = await get_json(session, f"{url}/v1/experiments/{name}", api_key)
            # Expiry runs every EXPIRY_INTERVAL_S; a group expires ttl after it was sampled.
            wait_s = args.ttl + EXPIRY_INTERVAL_S + 3
            print(f"load done; waiting {wait_s:.0f} s for the group TTL ...", flush=True)
            await asyncio.sleep(wait_s)
            status_after_ttl = await get_json(session, f"{url}/v1/experiments/{name}", api_key)
            load.rss_kib["after_ttl"] = rss_kib(pid)
            health = await get_json(session, f"{url}/v1/health", api_key)
        finally:
            if not args.keep_experiment:
                async with session.delete(f"{url}/v1/experiments/{name}", headers=admin,
                                          timeout=aiohttp.ClientTimeout(total=120)) as response:
                    await response.read()

    def brief(status: dict) -> dict:
        keys = ("policy_version", "step", "queued_groups", "pending_groups", "state")
        return {**{k: status[k] for k in keys}, "counters": status["counters"], "errors": status["errors"][-3:]}

    return {"load": load.summary(), "status_after_load": brief(status_after_load),
            "status_after_ttl": brief(status_after_ttl), "pending_groups_after_ttl":
            status_after_ttl["pending_groups"], "health_after": health}


def print_table(result: dict) -> None:
    load = result["load"]

    def lat(stats: dict | None) -> str:
        if not stats:
            return "-"
        return f"{stats['p50'] * 1000:.0f} / {stats['p95'] * 1000:.0f} / {stats['p99'] * 1000:.0f}"

    print(f"\n{load['clients']} clients, {load['duration_s']:.1f} s, request timeout {load['timeout_s']:.0f} s")
    print(f"{'endpoint':<12} {'2xx':>7} {'429':>7} {'503':>5} {'other':>6} {'timeout':>8} {'conn':>5} "
          f"{'2xx/s':>7}  {'2xx p50/p95/p99 ms':>20}  {'429 p50/p95/p99 ms':>20}  {'max s':>6}")
    for endpoint in ("completions", "feedback"):
        s = load[endpoint]
        c = s["by_class"]
        print(f"{endpoint:<12} {c['2xx']:>7} {c['429']:>7} {c['503']:>5} {c['other']:>6} {s['timeouts']:>8} "
              f"{s['connection_errors']:>5} {s['ok_per_s']:>7}  {lat(s['latency_ok_s']):>20}  "
              f"{lat(s['latency_429_s']):>20}  {s['max_latency_s']:>6.2f}")
    rss = {k: (f"{v / 1024:.1f} MiB" if v else "-") for k, v in load["rss_kib"].items()}
    print("front-end RSS: " + ", ".join(f"{k} {v}" for k, v in rss.items()))
    after, ttl = result["status_after_load"], result["status_after_ttl"]
    print(f"groups abandoned (no feedback): {load['groups_abandoned']}; pending after load "
          f"{after['pending_groups']}, after TTL {ttl['pending_groups']}; expired {ttl['counters']['groups_expired']}")
    print(f"learner: policy_version {after['policy_version']} after load ({ttl['policy_version']} after TTL), "
          f"groups trained {ttl['counters']['groups_trained']}, dropped stale "
          f"{ttl['counters']['groups_dropped_stale']}; health after: {result['health_after']['status']}")
    print(f"errors other than 429: {load['errors']}")
    for endpoint in ("completions", "feedback"):
        for sample in load[endpoint]["error_samples"]:
            print(f"  {endpoint} error: {sample}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--ttl", type=float, default=20.0,
                        help="group TTL (s): the server's group_ttl_s when this script starts it; with --url, "
                             "the running server's, which this script then waits out")
    parser.add_argument("--n", type=int, default=4, help="completions per group")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--batch-groups", type=int, default=4, help="the experiment's algorithm.batch_groups")
    parser.add_argument("--abandon", type=float, default=0.1, help="share of groups left without feedback")
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experiment", default="load")
    parser.add_argument("--keep-experiment", action="store_true", help="do not delete the experiment at the end")
    parser.add_argument("--url", help="a running server (else one is started on the tiny test model)")
    parser.add_argument("--api-key", default=os.environ.get("GRPO_SERVER_API_KEY"), help="admin key (with --url)")
    parser.add_argument("--pid", type=int, help="the running server's front-end pid, for its RSS (with --url)")
    parser.add_argument("--model-dir", type=Path, help="tiny model folder to reuse (built there if missing)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_load.json"), help="JSON results")
    parser.add_argument("--mix", nargs="?", const="plain=2,stream=1,episode=1,tools=1", help="the mixed round "
                        "(load_mixed.py), the clients split by these weights (default: %(const)s)")
    args = parser.parse_args()
    from scripts.benchmarks import load_mixed  # here: loaded by its path, the rest needs no package
    bench, table = (load_mixed.benchmark, load_mixed.print_table) if args.mix else (benchmark, print_table)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for signum in (signal.SIGINT, signal.SIGTERM):  # KeyboardInterrupt: the server started below is stopped
        signal.signal(signum, signal.default_int_handler)

    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()
                                                         if k != "api_key"}}
    if args.url:
        if not args.api_key:
            parser.error("--url needs --api-key (or GRPO_SERVER_API_KEY)")
        result = asyncio.run(bench(args.url.rstrip("/"), args.api_key, args.pid, args))
    else:
        from scripts.benchmarks.server import users_sampler_compiles
        from tests.serving import start_server, stop_server
        from tests.tiny_model import build_tiny_model

        work = Path(tempfile.mkdtemp(prefix="bench-load-"))
        model_dir = build_tiny_model(args.model_dir or work / "tiny-llama")
        handle = start_server(work / "run", model_dir, compile_sampler=users_sampler_compiles(), group_ttl_s=args.ttl,
                              episode_ttl_s=args.ttl)
        print(f"server up at {handle.url} (front end pid {handle.process.pid}, run dir {work / 'run'})", flush=True)
        try:
            result = asyncio.run(bench(handle.url, handle.api_key, handle.process.pid, args))
        finally:
            code = stop_server(handle)
            meta["server_exit_code"] = code
            meta["server_log"] = str(handle.log_path)
    result = {**meta, **result}
    table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out}")
    if result["load"]["errors"]:
        return 1
    if result["pending_groups_after_ttl"] != 0:
        print("pending groups did not expire after the TTL")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
