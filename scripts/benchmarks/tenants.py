"""Many tenants on one server: what registered experiments cost against active ones, and `vllm serve` beside it.

    scripts/bench --only tenants --out runs/bench-tenants.json            # 1, 16, 64, 256 registered, 32 active
    scripts/bench --quick --only tenants --out runs/bench-tenants.json    # 1, 16, 64 registered, 16 active
    .venv/bin/python -m scripts.benchmarks.tenants --out /tmp/t.json [--levels 1,4 --active 2 --window 20]

One server on the defaults a user gets: configs/server.yaml as scripts/demo serves it (the embedded SmolLM2-135M,
dtype auto, sampler max_loras 4 and the SamplerOptions defaults beside it, max_cpu_loras 16 included; learner
resident_experiments 32, keep_versions 8), started by scripts/benchmarks/server.py's `start` (tests/serving.py's
start_server) with the settings that function sets for the tests put back to the server's defaults
(TEST_SETTINGS: group_ttl_s, worker_timeout_s, the push check's tolerance and idle wait, lone_after_s), and the
sampler compiled as a user's is. Two things differ from the file, both in the result's `server`: `max_experiments`
is raised to the largest level when that is above the default (64), and no experiment tracker runs (trackers
`default: []`, as in every other figure: a tracker's cost is not this figure's).

Levels of registered experiments (LEVELS), reached on the same running server by creating more (each with its own
key, `algorithm.batch_groups: 1`, `sampling: {n: 4, max_tokens: 16}`). At each level A = min(R, ACTIVE) of them
are active for WINDOW_S: each active tenant's client (an AsyncClient with its key) loops: completion (n=4,
max_tokens=16, a chat prompt of its own), then feedback with 4 distinct rewards, so each group trains (a learner
step and a push per group). A 429 is waited out (its Retry-After) and sent again; the wait counts in that
completion's latency, not as an error. No completion starts after the window; the ones under way finish.

Which experiments are active rotates (`pick_active`): half the set from those active at an earlier level but not
the last one (the least recently active first), the rest from those never active (in order of creation), then
from the others. So at 256 the active set holds experiments that trained two levels before and have been idle
since (the learner pages them back in, the sampler reads their adapters again: its LRU holds max_cpu_loras), and
experiments never sampled.

After the window, once the active experiments have settled (every group trained, the newest version pushed and its
push check done; at most DRAIN_S: in the smoke run a probe sent earlier waited seconds behind the last steps' pushes
and checks), at each level with R > A: COLD_PROBES registered experiments that have been idle the longest (not
sampled at this level) are asked for one completion each (cold: its adapter evicted from the sampler's LRU, its
state paged out of the learner's memory) and a second right after (warm), one after another.

Reported per level: completion tok/s in total over the window (completion tokens / seconds from the window's start
until the last tenant's loop ended), each tenant's p50 and p95 completion latency (nearest rank; the median tenant's
and the worst tenant's p95), push seconds (status `last_push_seconds`) and learner step seconds (status
`last_metrics.seconds`), medians over the active experiments that pushed or stepped at this level, the learner's
page-ins and page-outs (its log, `<run_dir>/logs/learner.log`: "NAME: paged in at step S after T s out (X s)",
"NAME: paged out at step S (X s; ...)"), RSS of the front end, the sampler's process tree (vLLM's engine core
included) and the learner's at the end of the window (VmRSS, and VmHWM), disk per experiment (du of
`adapters/<name>` + `checkpoints/<name>`), each experiment's status `learner_memory` counted, and errors: answers
other than 2xx and 429 (and calls that got no answer), experiments whose last push check failed
(`last_verification.ok` false) or not `active`, and `too_many_adapters` in the server's logs.

The anchor: after the levels the server stops, and `vllm serve --enable-lora` (scripts/benchmarks/vllm_serve.py:
the sampler's engine arguments, dtype and environment) starts with the last level's A active experiments' newest
adapter versions (copied out of the run directory first) as `--lora-modules`, `--max-loras` and `--max-cpu-loras`
as the sampler's, and the seats of the sampler's engine (max_num_seqs + reserved_seqs). The same load for the same
window: A concurrent clients, each looping `POST /v1/completions` on its own adapter with its tenant's prompt (the
token ids this server sampled from), n=4, max_tokens=16, the experiments' temperature and top_p; an answer other
than 200 is a failure. If it cannot start, the error is recorded and the figure goes on.

Targets (`checks`; `met` when every one holds): completion tok/s at the last level (the largest A) >= TARGET_TOK_S
of that at the first level with A = 16; at every level, the worst tenant's p95 <= TARGET_P95_SPREAD x the median
tenant's; at every level with probes, the median cold first completion <= the median warm one + TARGET_COLD_EXTRA_S;
the learner's and the sampler's RSS at the largest level <= TARGET_RSS_RATIO x at the one before (the same A: memory
must grow with active experiments, not registered ones); this server's tok/s at the last level >= TARGET_VS_VLLM x
`vllm serve`'s; no errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import yaml

from grpo_server.client import AsyncClient, GrpoServerError

from . import REPO
from .tenants_anchor import anchor_figure
from .tenants_load import (MAX_TOKENS, N, REQUEST_TIMEOUT_S, Record, Tenant, load_summary, log_text,
                           rounded_median)

LEVELS = (1, 16, 64, 256)  # registered experiments (scripts/bench's quick mode: QUICK_LEVELS)
QUICK_LEVELS = (1, 16, 64)
ACTIVE = 32  # active experiments at most (quick: QUICK_ACTIVE): A = min(R, ACTIVE)
QUICK_ACTIVE = 16
WINDOW_S = 120.0  # each level's window of load (quick: QUICK_WINDOW_S)
QUICK_WINDOW_S = 45.0
BATCH_GROUPS = 1
COLD_PROBES = 4
DRAIN_S = 120.0  # after the window, the active experiments' queued groups are waited for at most this long
SERVER_CONFIG = REPO / "configs" / "server.yaml"
# What tests/serving.py's start_server sets for the tests, put back to the server's defaults here.
TEST_SETTINGS = ("group_ttl_s", "worker_timeout_s", "verify_tolerance", "verify_idle_s", "auth_limit_exempt")
TARGET_TOK_S = 0.9  # tok/s at the largest A over tok/s at A = 16
BASELINE_ACTIVE = 16
TARGET_P95_SPREAD = 2.0  # the worst tenant's p95 over the median tenant's
TARGET_COLD_EXTRA_S = 1.0  # median cold first completion - median warm one
TARGET_RSS_RATIO = 1.15  # learner's and sampler's RSS, the largest level over the one before
TARGET_VS_VLLM = 2.0  # this server's tok/s over `vllm serve`'s at the last level's A
PAGED_IN = re.compile(r"(\S+): paged in at step (\d+) after (\d+) s out \(([\d.]+) s\)")
PAGED_OUT = re.compile(r"(\S+): paged out at step (\d+) \(([\d.]+) s;")
CHECK_FAILED = re.compile(r": verification failed: (.*?)(?: \[experiment=.*)?$", re.MULTILINE)
CHECK_INCONCLUSIVE = re.compile(r": verification of v\d+ inconclusive")


# --- the server ------------------------------------------------------------------------------------------------

def server_settings(sampler_settings: dict | None, levels) -> tuple[dict, dict]:
    """The overrides of tests/serving.py's start_server that make configs/server.yaml's server (module doc), and
    what differs from that file (to be said in the result)."""
    from grpo_server.config import ServerConfig
    from grpo_server.protocol.worker_config import SamplerOptions

    user = yaml.safe_load(SERVER_CONFIG.read_text())
    for key in ("model", "host", "port", "run_dir", "experiments"):
        user.pop(key, None)
    for key in TEST_SETTINGS:
        user.setdefault(key, ServerConfig.model_fields[key].get_default(call_default_factory=True))
    # start_server's sampler has the tests' lone_after_s (5 s) unless the settings give one: the default's here.
    user["sampler"] = {"lone_after_s": SamplerOptions.model_fields["lone_after_s"].default,
                       **user.get("sampler", {}), **(sampler_settings or {})}
    changed: dict = {"trackers": "none (trackers.default [], as in the other figures)"}
    default_max = ServerConfig.model_fields["max_experiments"].default
    if max(levels) > user.get("max_experiments", default_max):
        user["max_experiments"] = max(levels)
        changed["max_experiments"] = {"from": default_max, "to": max(levels)}
    if sampler_settings:
        changed["sampler"] = dict(sampler_settings)
    return user, changed


def sampler_options(server: dict) -> dict:
    """The sampler's options as the server resolves them: the config's, else SamplerOptions' defaults."""
    from grpo_server.protocol.worker_config import SamplerOptions

    return {k: server["sampler"].get(k, f.default) for k, f in SamplerOptions.model_fields.items()}


def pick_active(tenants: list[Tenant], count: int, last: set[str]) -> list[Tenant]:
    """Half from those active at an earlier level but not the last (least recently active first), the rest from
    those never active (oldest first), then from the earlier ones left and the last level's."""
    earlier = sorted((t for t in tenants if t.last_active_level is not None and t.name not in last),
                     key=lambda t: (t.last_active_level, t.index))
    never = [t for t in tenants if t.last_active_level is None]
    last_ones = [t for t in tenants if t.name in last]
    chosen = earlier[:count // 2]
    for pool in (never, earlier[count // 2:], last_ones):
        chosen += pool[:count - len(chosen)]
    return sorted(chosen, key=lambda t: t.index)


async def complete(client: AsyncClient, tenant: Tenant, record: Record, give_up_at: float):
    """One completion of the tenant's prompt; 429s waited out (their Retry-After) and counted in its latency. The
    group, or None when it failed (counted) or the 429s lasted past `give_up_at`."""
    asked = time.perf_counter()
    while True:
        try:
            group = await client.complete(tenant.name, messages=tenant.messages, n=N, max_tokens=MAX_TOKENS)
        except GrpoServerError as exc:
            if exc.status == 429:
                wait = exc.retry_after or 1.0
                if time.monotonic() + wait > give_up_at:
                    record.errors["429 past the drain"] += 1
                    return None
                record.backoffs += 1
                record.backoff_s += wait
                await asyncio.sleep(wait)
                continue
            record.errors[f"{exc.status} {exc.code}"] += 1
            return None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # no answer
            record.errors[type(exc).__name__] += 1
            return None
        record.latencies.append(time.perf_counter() - asked)
        record.tokens += sum(len(c.token_ids) for c in group.completions)
        tenant.last_sampled = time.monotonic()
        tenant.prompt_ids = tenant.prompt_ids or list(group.prompt_token_ids)
        return group


async def tenant_loop(client: AsyncClient, tenant: Tenant, record: Record, deadline: float) -> None:
    """Completion, then feedback with N distinct rewards, until `deadline` (none started after it)."""
    rng = random.Random(tenant.index)
    rewards = [i / (N - 1) for i in range(N)]
    while time.monotonic() < deadline:
        group = await complete(client, tenant, record, deadline + DRAIN_S)
        if group is None:
            await asyncio.sleep(0.5)  # a failure is not retried at once
            continue
        rng.shuffle(rewards)
        while True:
            try:
                await client.feedback(tenant.name, group.group_id, rewards[:len(group.completions)])
                record.feedback += 1
            except GrpoServerError as exc:
                if exc.status == 429 and time.monotonic() < deadline + DRAIN_S:
                    await asyncio.sleep(exc.retry_after or 1.0)
                    continue
                record.errors[f"feedback {exc.status} {exc.code}"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                record.errors[f"feedback {type(exc).__name__}"] += 1
            break


def du_mib(*folders: Path) -> float:
    """Disk used by the files under `folders` (du: allocated blocks), MiB."""
    total = 0
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total / 2**20


def paging(text: str) -> dict:
    """The learner log's page-ins and page-outs in `text`."""
    ins = [float(m.group(4)) for m in PAGED_IN.finditer(text)]
    outs = [float(m.group(3)) for m in PAGED_OUT.finditer(text)]
    return {"page_ins": len(ins), "page_in_median_s": rounded_median(ins), "page_in_max_s": max(ins, default=None),
            "page_outs": len(outs), "page_out_median_s": rounded_median(outs),
            "page_out_max_s": max(outs, default=None)}


def too_many_adapters(run_dir: Path) -> int:
    """`too_many_adapters` in the server's log and its workers' logs, so far."""
    return sum(log_text(p).count("too_many_adapters") for p in [run_dir / "server.log",
                                                                 *sorted((run_dir / "logs").glob("*.log"))])


def process_memory(front_end_pid: int) -> dict:
    """VmRSS and VmHWM (MiB) of the front end, the sampler's tree and the learner's (memory.py's `peak_rss`)."""
    from .memory import peak_rss

    roles = peak_rss(front_end_pid)
    return {"rss_mib": {r: roles.get(r, {}).get("rss_mib") for r in ("front_end", "sampler", "learner")},
            "hwm_mib": {r: roles.get(r, {}).get("hwm_mib") for r in ("front_end", "sampler", "learner")},
            "processes": {r: len(roles.get(r, {}).get("processes", [])) for r in ("front_end", "sampler", "learner")}}


def settled(status) -> bool:
    """Every group it received trained (or dropped), its newest version pushed, and that version's push check done
    (a run's last version is checked once training has been idle verify_idle_s)."""
    c = status.counters
    owed = c.groups_received - c.groups_zero_variance - c.groups_dropped_stale - c.groups_dropped_failed
    checked = status.policy_version == 0 or (status.last_verification is not None
                                             and status.last_verification.version >= status.policy_version)
    return not status.queued_groups and c.groups_trained >= owed and status.policy_version >= status.learner_version \
        and checked


async def wait_settled(admin: AsyncClient, names: set[str]) -> tuple[float, bool]:
    """Until the active experiments are `settled` (at most DRAIN_S): the seconds waited, and whether they were."""
    started = time.monotonic()
    while time.monotonic() - started < DRAIN_S:
        if all(settled(s) for s in await admin.list_experiments() if s.name in names):
            return round(time.monotonic() - started, 1), True
        await asyncio.sleep(1.0)
    return round(time.monotonic() - started, 1), False


async def cold_probes(clients: dict[str, AsyncClient], candidates: list[Tenant], statuses: dict) -> dict | None:
    """The first completion of experiments idle the longest (cold) and a second right after (warm)."""
    if not candidates:
        return None
    probes = []
    for tenant in candidates:
        record = Record(tenant.name)
        idle, never = time.monotonic() - (tenant.last_sampled or tenant.created_at), tenant.last_sampled is None
        times = []
        for _ in range(2):
            before = len(record.latencies)
            await complete(clients[tenant.name], tenant, record, time.monotonic() + DRAIN_S)
            times.append(round(record.latencies[-1], 3) if len(record.latencies) > before else None)
        status = statuses.get(tenant.name)
        probes.append({"name": tenant.name, "cold_s": times[0], "warm_s": times[1], "idle_s": round(idle, 1),
                       "never_sampled_before": never,
                       "learner_memory_before": status.learner_memory if status else None,
                       "backoffs_429": record.backoffs, "errors": dict(record.errors)})
    cold, warm = rounded_median(p["cold_s"] for p in probes), rounded_median(p["warm_s"] for p in probes)
    return {"probes": probes, "cold_median_s": cold, "warm_median_s": warm,
            "extra_s": None if cold is None or warm is None else round(cold - warm, 3),
            "errors": sum(sum(p["errors"].values()) for p in probes)}


async def level_figure(handle, admin: AsyncClient, clients: dict[str, AsyncClient], tenants: list[Tenant],
                       index: int, registered: int, active_max: int, window_s: float, last: set[str]) -> dict:
    run_dir, pid = handle.run_dir, handle.process.pid
    learner_log = run_dir / "logs" / "learner.log"
    log_offset = learner_log.stat().st_size if learner_log.exists() else 0
    server_log = run_dir / "server.log"
    server_offset = server_log.stat().st_size if server_log.exists() else 0
    adapters_before = too_many_adapters(run_dir)
    creation_s = []
    while len(tenants) < registered:  # one after another, as a user's script would
        i = len(tenants)
        tenant = Tenant(i, f"tenant-{i:03d}", f"tenant-key-{i:03d}-{secrets.token_hex(6)}", time.monotonic())
        asked = time.perf_counter()
        await admin.create_experiment({"name": tenant.name, "api_key": tenant.key,
                                       "algorithm": {"batch_groups": BATCH_GROUPS},
                                       "sampling": {"n": N, "max_tokens": MAX_TOKENS}})
        creation_s.append(time.perf_counter() - asked)
        tenant.created_at = time.monotonic()
        tenants.append(tenant)
        clients[tenant.name] = AsyncClient(handle.url, tenant.key, timeout_s=REQUEST_TIMEOUT_S)
    if index == 0:  # the server's first completion (the sampler's first LoRA request), untimed
        await complete(clients[tenants[0].name], tenants[0], Record("warm-up"), time.monotonic() + DRAIN_S)
    count = min(registered, active_max)
    active = pick_active(tenants, count, last)
    names = {t.name for t in active}
    newly = sum(t.last_active_level is None for t in active)
    before = {s.name: s for s in await admin.list_experiments()}
    records = [Record(t.name) for t in active]
    started, wall_start = time.monotonic(), time.time()
    await asyncio.gather(*(tenant_loop(clients[t.name], t, r, started + window_s) for t, r in zip(active, records)))
    seconds = time.monotonic() - started
    memory = process_memory(pid)  # at the end of the window
    for t in active:
        t.last_active_level = index
    load = load_summary(records, seconds)
    drain_s, drained = await wait_settled(admin, names)  # the cold probes run on a quiet server
    statuses = {s.name: s for s in await admin.list_experiments()}
    idle = sorted((t for t in tenants if t.name not in names), key=lambda t: t.last_sampled or t.created_at)
    cold = await cold_probes(clients, idle[:COLD_PROBES], statuses) if registered > count else None
    await asyncio.sleep(3.0)  # the front end reads the learner's residency every few seconds
    statuses = {s.name: s for s in await admin.list_experiments()}
    pushes = [s.last_push_seconds for n, s in statuses.items()
              if n in names and s.last_push_at is not None and s.last_push_at >= wall_start]
    steps = [(s.last_metrics or {}).get("seconds") for n, s in statuses.items()
             if n in names and s.step > before[n].step]
    disk = [du_mib(run_dir / "adapters" / t.name, run_dir / "checkpoints" / t.name) for t in tenants]
    failed_checks = sorted(n for n, s in statuses.items() if s.last_verification is not None
                           and s.last_verification.ok is False)
    # A failed push check that a later one superseded is no longer in `last_verification`: the front end's log and
    # the experiments' `errors` still hold it.
    server_text = log_text(server_log, server_offset)
    failed_logged = CHECK_FAILED.findall(server_text)
    new_errors = [e for n, s in statuses.items() for e in s.errors if n not in before or e not in before[n].errors]
    states = Counter(s.state for s in statuses.values())
    adapters_errors = too_many_adapters(run_dir) - adapters_before
    non_2xx = sum(load["errors"].values()) + (cold["errors"] if cold else 0)
    errors = {"non_2xx": non_2xx, "failed_verifications": max(len(failed_logged), len(failed_checks)),
              "status_errors": sum(e not in failed_logged for e in new_errors),
              "too_many_adapters": adapters_errors, "not_active": sum(v for k, v in states.items() if k != "active")}
    return {"registered": registered, "active": count, "active_names": sorted(names), "newly_active": newly,
            "created": len(creation_s), "creation_s": {"median": rounded_median(creation_s),
                                                       "max": round(max(creation_s), 2) if creation_s else None,
                                                       "total": round(sum(creation_s), 1)},
            "window_s": window_s, **{k: v for k, v in load.items() if k != "tenants"},
            "push_s_median": rounded_median(pushes), "step_s_median": rounded_median(steps),
            "pushes": sum(max(0, statuses[n].policy_version - before[n].policy_version) for n in names),
            "learner_steps": sum(max(0, statuses[n].step - before[n].step) for n in names),
            "drain_s": drain_s, "drained": drained, "cold": cold, **paging(log_text(learner_log, log_offset)), **memory,
            "disk_mib": {"median": rounded_median(disk), "max": round(max(disk), 1), "total": round(sum(disk), 1)},
            "learner_memory": dict(Counter(s.learner_memory or "unknown" for s in statuses.values())),
            "errors": errors, "error_count": sum(errors.values()), "failed_verification_names": failed_checks[:8],
            "failed_verifications_logged": failed_logged[:8],
            "inconclusive_verifications": len(CHECK_INCONCLUSIVE.findall(server_text)),
            "experiment_errors": {n: s.errors[-2:] for n, s in statuses.items() if s.errors},
            "tenants": load["tenants"]}


# --- the figure ------------------------------------------------------------------------------------------------

def checks_of(levels: list[dict], anchor: dict) -> tuple[dict, dict]:
    """Each target's value and whether it held (None: not measured in this run)."""
    values: dict = {}
    base = next((lv for lv in levels if lv["active"] == BASELINE_ACTIVE), None)
    last = levels[-1] if levels else None
    values["tok_s_ratio"] = (round(last["tok_s"] / base["tok_s"], 3) if base and last and base is not last
                             and base["tok_s"] and last["tok_s"] is not None else None)
    spreads = [lv["p95_spread"] for lv in levels if lv["active"] > 1]
    values["p95_spread_max"] = max((s for s in spreads if s is not None), default=None)
    extras = [lv["cold"]["extra_s"] for lv in levels if lv.get("cold")]
    values["cold_extra_s_max"] = max((e for e in extras if e is not None), default=None)
    if len(levels) >= 2:
        a, b = levels[-2], levels[-1]
        for role in ("learner", "sampler"):
            x, y = a["rss_mib"].get(role), b["rss_mib"].get(role)
            values[f"{role}_rss_ratio"] = round(y / x, 3) if x and y else None
        values["rss_same_active"] = a["active"] == b["active"]
    else:
        values.update(learner_rss_ratio=None, sampler_rss_ratio=None, rss_same_active=None)
    values["vs_vllm"] = (round(last["tok_s"] / anchor["tok_s"], 3) if last and not anchor.get("error")
                         and anchor.get("tok_s") and last["tok_s"] is not None else None)
    values["errors"] = sum(lv["error_count"] for lv in levels)

    def at_most(value, limit):
        return None if value is None else value <= limit

    checks = {"tok_s": None if values["tok_s_ratio"] is None else values["tok_s_ratio"] >= TARGET_TOK_S,
              "p95_spread": at_most(values["p95_spread_max"], TARGET_P95_SPREAD),
              "cold": at_most(values["cold_extra_s_max"], TARGET_COLD_EXTRA_S),
              "memory": (None if values["learner_rss_ratio"] is None or values["sampler_rss_ratio"] is None else
                         max(values["learner_rss_ratio"], values["sampler_rss_ratio"]) <= TARGET_RSS_RATIO),
              "vs_vllm": None if values["vs_vllm"] is None else values["vs_vllm"] >= TARGET_VS_VLLM,
              "errors": values["errors"] == 0}
    return checks, values


async def tenants_figure(handle, model_dir: Path, work: Path, server: dict, sampler_dtype: str, *,
                         levels=LEVELS, active: int = ACTIVE, window_s: float = WINDOW_S) -> tuple[dict, dict]:
    """The levels on a running server (`handle`): their results, and what the anchor needs (the last level's
    active tenants and their adapters, copied out of the run directory)."""
    tenants: list[Tenant] = []
    clients: dict[str, AsyncClient] = {}
    results: list[dict] = []
    async with AsyncClient(handle.url, handle.api_key, timeout_s=REQUEST_TIMEOUT_S) as admin:
        await admin.health()
        try:
            last: set[str] = set()
            for index, registered in enumerate(levels):
                print(f"[tenants] {registered} registered ...", flush=True)
                results.append(await level_figure(handle, admin, clients, tenants, index, registered, active,
                                                  window_s, last))
                last = set(results[-1]["active_names"])
                print(f"[tenants] {registered} registered: " + json.dumps(
                    {k: results[-1][k] for k in ("active", "tok_s", "p95_s_median_tenant", "p95_s_worst_tenant",
                                                 "page_ins", "rss_mib", "error_count")}
                    | {"cold": {k: (results[-1]["cold"] or {}).get(k) for k in ("cold_median_s", "warm_median_s")}}),
                    flush=True)
            statuses = {s.name: s for s in await admin.list_experiments()}
        finally:
            for client in clients.values():
                with contextlib.suppress(Exception):
                    await client.close()
    chosen = [t for t in tenants if t.name in last]
    adapters: dict[str, Path] = {}
    for t in chosen:  # the newest version each served; the server may prune its own folders
        folder = handle.run_dir / "adapters" / t.name / f"v{statuses[t.name].policy_version:06d}"
        if (folder / "adapter_config.json").exists():
            adapters[t.name] = shutil.copytree(folder, work / "anchor-adapters" / t.name, dirs_exist_ok=True)
    versions = {t.name: statuses[t.name].policy_version for t in chosen}
    sampling = {k: v for k, v in statuses[chosen[0].name].config.get("sampling", {}).items()
                if k in ("temperature", "top_p")} if chosen else {}
    return {"levels": results, "versions_served": versions, "sampling": sampling}, {
        "tenants": [t for t in chosen if t.name in adapters], "adapters": adapters, "sampling": sampling}


async def own_server_figure(model_dir: Path, sampler_settings: dict | None = None, keep: bool = False, *,
                            levels=LEVELS, active: int = ACTIVE, window_s: float = WINDOW_S,
                            anchor: bool = True) -> dict:
    """The figure on a server started for it, then stopped; then the anchor (`vllm serve`)."""
    from .host import default_sampler_dtype
    from .server import clear_run_dir, start, stop

    run_dir = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    work = Path(tempfile.mkdtemp(prefix="bench-tenants-anchor-"))
    server, changed = server_settings(sampler_settings, levels)
    options = sampler_options(server)
    sampler_dtype = server["sampler"].get("dtype") or default_sampler_dtype()  # what `auto` resolves to here
    started = time.perf_counter()
    handle = await start(run_dir, model_dir, **server)
    server_s = round(time.perf_counter() - started, 1)
    code, result, for_anchor = None, None, None
    try:
        result, for_anchor = await tenants_figure(handle, model_dir, work, server, sampler_dtype, levels=levels,
                                                  active=active, window_s=window_s)
    finally:
        code = await stop(handle)
    if not anchor:
        side = {"skipped": "not asked (--no-anchor)"}
    elif not for_anchor["adapters"]:
        side = {"error": "no adapter folder of the last level's active experiments to serve"}
    else:
        print(f"[tenants] vllm serve with {len(for_anchor['adapters'])} adapters ...", flush=True)
        side = await anchor_figure(model_dir, work, for_anchor["adapters"], for_anchor["tenants"], options,
                                   sampler_dtype, server.get("max_model_len", 1024), window_s,
                                   for_anchor["sampling"])
        print("[tenants] vllm serve: " + json.dumps({k: side.get(k) for k in ("tok_s", "p95_s_median_tenant",
                                                                            "failures", "error")}), flush=True)
    levels_out = result["levels"]
    checks, values = checks_of(levels_out, side)
    ok = code == 0 and not keep and not any(lv["error_count"] for lv in levels_out)
    if not keep:  # a failed run keeps its logs (256 experiments' adapters and checkpoints are ~20 GiB)
        clear_run_dir(run_dir, failed=not ok)
        shutil.rmtree(work, ignore_errors=True)
    # The summary first: scripts/bench prints a figure's first 400 characters.
    return {"met": all(v is True for v in checks.values()), "checks": checks, "values": values,
            "tok_s": {str(lv["registered"]): lv["tok_s"] for lv in levels_out}, "vllm_serve_tok_s": side.get("tok_s"),
            "targets": {"tok_s_ratio": TARGET_TOK_S, "baseline_active": BASELINE_ACTIVE,
                        "p95_spread": TARGET_P95_SPREAD, "cold_extra_s": TARGET_COLD_EXTRA_S,
                        "rss_ratio": TARGET_RSS_RATIO, "vs_vllm": TARGET_VS_VLLM},
            "levels": levels_out, "anchor": side, "level_counts": list(levels), "active_max": active,
            "window_s": window_s, "n": N, "max_tokens": MAX_TOKENS, "batch_groups": BATCH_GROUPS,
            "cold_probes": COLD_PROBES, "sampling": result["sampling"], "versions_served": result["versions_served"],
            "server": {"config": os.path.relpath(SERVER_CONFIG, REPO), "changed": changed,
                       "max_experiments": server.get("max_experiments", 64), "sampler": options,
                       "learner": server.get("learner", {}), "sampler_dtype": sampler_dtype},
            "server_start_s": server_s, "server_exit_code": code, "run_dir": None if ok else str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="registered experiments, e.g. 1,16,64")
    parser.add_argument("--active", type=int, default=ACTIVE, help="active experiments at most per level")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="seconds of load per level (and the anchor)")
    parser.add_argument("--no-anchor", action="store_true", help="no `vllm serve` after the levels")
    from .server import standalone, standalone_options

    standalone_options(parser)
    args = parser.parse_args()
    from .host import print_result

    model_dir, sampler_settings = standalone(args, "tenants")
    levels = tuple(int(k) for k in args.levels.split(",") if k.strip())
    result = asyncio.run(own_server_figure(model_dir, sampler_settings, args.keep, levels=levels, active=args.active,
                                           window_s=args.window, anchor=not args.no_anchor))
    print_result({"model": str(model_dir), **result}, args.out)


if __name__ == "__main__":
    main()
