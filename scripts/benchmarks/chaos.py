"""The chaos soak (issue 60): one seed's schedule of faults against a real server while clients of every API family
load it, then an invariant checker over what the clients were answered and what the server holds.

    scripts/chaos --seed 7 --minutes 3 --tiny        # the CI soak's shape (tests/test_chaos.py)
    scripts/chaos --seed 7                           # the long soak (30 minutes) on the embedded SmolLM2
    scripts/chaos --seed 7 --two-hosts               # the server over two hosts (chaos_hosts.py), partitioned
    scripts/bench --only chaos                       # the long soak as a benchmark figure (its table)

Phases: the server starts (on a tmpfs of its own where `disk_full` can be injected, with the fsync shim preloaded
where `slow_disk` can: chaos_faults.py); the experiments are created; the load (chaos_load.py) runs for `--minutes`
(longer if needed for every kind to come up once) while the injector (chaos_faults.py) injects a fault every `--gap`
seconds and waits for recovery. Then the load stops, the server must be healthy, every experiment must still train
one more step (its last groups trained or passed over), and the server is stopped
cleanly, which checkpoints every step taken (and so writes every ledger line). The checker (chaos_check.py) then
reads the history, the ledgers and the metrics logs.

The same seed gives the same schedule: the faults' kinds, order and gaps, and every client's choices. (What the
server answers under them is timing, not the seed's.) A failing run writes its seed and the history records of
the broken invariants' examples in the result.

The result (JSON): faults by kind with recovery times (p50, p95), requests by family and answer, each invariant's
count of breaks, throughput (acknowledged groups a minute) during faults and outside them, and the front end's RSS
and the run directory's size through the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from grpo_server.client import AsyncClient, GrpoServerError

from .chaos_check import answers_by_family, breaking_history, check
from .chaos_faults import (BETWEEN_HOSTS, KINDS, NOT_INJECTED, NOT_INJECTED_TWO_HOSTS, PARTITIONS, TWO_HOST_KINDS,
                           ChaosServer, DiskFiller, Injector, Partition, SlowDisk)
from .chaos_hosts import HostB, TwoHosts
from .chaos_load import MAX_TOKENS, N, History, Load

SEED = 1  # the benchmark's soak (scripts/bench --only chaos)
GAP_S = (10.0, 20.0)  # seconds between a fault's recovery and the next: 50-odd faults in 30 minutes
EXPERIMENTS = ("soak-a", "soak-b")
WORKER_TIMEOUT_S = 20.0  # a paused worker is held past this (PAUSE_S): its calls time out, as on a hung host
PAUSE_S = 25.0
FULL_S = 10.0
# The run directory's filesystem, where one is mounted (disk_full): room for what the soak keeps on the embedded
# SmolLM2 (each experiment's versions and 2 checkpoints, ~200 MiB; every deleted experiment's archive, ~15 MiB: a
# 4-minute soak's run directory held 620 MiB, and filled 768 MiB) with space to spare; a tmpfs is memory.
DISK_MIB = 3072
TINY_DISK_MIB = 768
SETTLE_S = 120.0  # after the load stops: the last queued groups trained
ARCHIVES_KEPT = 4  # the server's archives_kept: the churn makes dozens, and the checker holds the disk to this


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


async def _watch(server: ChaosServer, stop: asyncio.Event, versions: dict, samples: list, run_dir: Path,
                 admin_key: str) -> None:
    """Every 2 s: each experiment's serving version, the front end's RSS and the run directory's size."""
    async with AsyncClient(server.url, admin_key, timeout_s=10) as client:
        while not stop.is_set():
            t = time.monotonic()
            for name in EXPERIMENTS:
                try:
                    status = await client.status(name)
                    versions[name].append((round(t - samples[0]["t0"], 1), status.serving_version))
                except Exception:  # noqa: BLE001 - down during a fault: no sample
                    pass
            samples.append({"t": round(t - samples[0]["t0"], 1), "rss_mib": server.front_end_rss_mib(),
                            "disk_mib": await asyncio.to_thread(_size_mib, run_dir)})
            try:
                await asyncio.wait_for(stop.wait(), 2.0)
            except asyncio.TimeoutError:
                pass


def _size_mib(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return round(total / 2**20, 1)


async def _create(server: ChaosServer, admin_key: str) -> None:
    async with AsyncClient(server.url, admin_key) as client:
        for name in EXPERIMENTS:
            # checkpoint_every 2 with no interval: a crash rolls back up to a step, which the journal trains again.
            await client.create_experiment({"name": name, "sampling": {"n": N, "max_tokens": MAX_TOKENS},
                                            "algorithm": {"batch_groups": 2, "checkpoint_every": 2,
                                                          "checkpoint_interval_s": 0}})


async def _one_more_step(server: ChaosServer, admin_key: str, history: History) -> dict[str, bool]:
    """After the soak: each experiment samples and rates until its step count moves (it still trains)."""
    load = Load(server.url, admin_key, [], history, 0, None, asyncio.Event())
    out = {}
    async with AsyncClient(server.url, admin_key) as client:
        for name in EXPERIMENTS:
            before = (await client.status(name)).step
            deadline = time.monotonic() + SETTLE_S
            moved = False
            while time.monotonic() < deadline and not moved:
                try:
                    group = await client.complete(name, prompt="After the soak", n=N, max_tokens=MAX_TOKENS)
                except GrpoServerError as exc:
                    await asyncio.sleep(min(exc.retry_after or 1.0, 5.0))
                    continue
                history.add(client="final", family="native", op="complete", experiment=name, status=200,
                            group_id=group.group_id, version=group.policy_version)
                await load.rate(name, lambda: client.feedback(name, group.group_id, [0.0, 1.0] * (N // 2)),
                                "final", group_id=group.group_id)
                for _ in range(10):
                    status = await client.status(name)
                    if status.step > before and not status.queued_groups:
                        moved = True
                        break
                    await asyncio.sleep(1)
            out[name] = moved
    return out


async def soak(model_dir: Path, seed: int, minutes: float, gap_s: tuple[float, float], work_dir: Path,
               tinker: bool = True, kinds: tuple[str, ...] | None = None, keep: bool = False,
               worker_timeout_s: float = WORKER_TIMEOUT_S, pause_s: float = PAUSE_S, disk_mib: int = DISK_MIB,
               two_hosts: bool = False) -> dict:
    """The whole soak in `work_dir` (its run directory there, on a tmpfs where one can be mounted; with `keep`,
    copied to `work_dir/run-kept` before the tmpfs goes). `two_hosts`: the server split over two hosts
    (chaos_hosts.py), where this machine can make a second one; else on one, and the result says why."""
    from tests.serving import ADMIN_KEY

    run_dir = work_dir / "run"
    no_second_host = HostB.available() if two_hosts else None
    two_hosts = two_hosts and no_second_host is None
    kinds = kinds or (TWO_HOST_KINDS if two_hosts else KINDS)
    # What this machine lets the harness do (as root: a filesystem of its own, iptables; a C compiler): the kinds it
    # cannot inject are left out, and the result says why.
    why_not = {kind: why for kind, why in (("disk_full", DiskFiller.available()), ("slow_disk", SlowDisk.available()),
                                           *((kind, Partition.available()) for kind in PARTITIONS))
               if kind in kinds and why is not None}
    if no_second_host is not None:
        why_not[BETWEEN_HOSTS] = no_second_host
    kinds = tuple(k for k in kinds if k not in why_not)
    disk = DiskFiller(run_dir, disk_mib) if "disk_full" in kinds else None
    slow_disk = SlowDisk(work_dir) if "slow_disk" in kinds else None
    partition = Partition() if set(PARTITIONS) & set(kinds) else None
    history = History(work_dir / "history.jsonl")
    server = None
    started = time.monotonic()
    environ = dict(os.environ)
    try:
        if slow_disk is not None:  # the server's processes inherit the shim (and nothing else of this one's)
            os.environ.update(slow_disk.env())
        topology = TwoHosts if two_hosts else ChaosServer
        server = topology(run_dir, model_dir, worker_timeout_s=worker_timeout_s, max_pending_groups=256,
                          group_ttl_s=120, archives_kept=ARCHIVES_KEPT)
        await _create(server, ADMIN_KEY)
        stop, watching = asyncio.Event(), asyncio.Event()
        versions: dict[str, list] = defaultdict(list)
        samples: list[dict] = [{"t0": time.monotonic()}]
        history.started = samples[0]["t0"]
        load = Load(server.url, ADMIN_KEY, list(EXPERIMENTS), history, seed, str(model_dir) if tinker else None,
                    stop, run_dir)
        injector = Injector(server, seed, kinds, gap_s, pause_s, disk, FULL_S, slow_disk, partition)
        faults = []
        watcher = asyncio.create_task(_watch(server, watching, versions, samples, run_dir, ADMIN_KEY))
        loading = asyncio.create_task(load.run())
        end = samples[0]["t0"] + minutes * 60

        def more() -> bool:
            """Until `minutes` have passed and every kind came up once: a short soak whose recoveries ran long
            would otherwise end before its cycle of kinds did."""
            return time.monotonic() < end or len({f.kind for f in faults}) < len(kinds)

        while more():
            gap = injector.next_gap()
            await asyncio.sleep(gap if time.monotonic() >= end else min(gap, end - time.monotonic()))
            if not more():
                break
            kind = injector.next_kind()
            print(f"[chaos] {time.monotonic() - samples[0]['t0']:.0f} s: {kind}", flush=True)
            fault = await asyncio.to_thread(injector.inject, kind, round(time.monotonic() - samples[0]["t0"], 1))
            faults.append(fault)
            print(f"[chaos] {fault}", flush=True)
        stop.set()
        await asyncio.wait_for(loading, timeout=300)
        recovered = await asyncio.to_thread(server.wait_healthy)
        final_steps = await _one_more_step(server, ADMIN_KEY, history)
        watching.set()
        await watcher
        exit_code = await asyncio.to_thread(server.stop)
        history.close()
        fault_dicts = [asdict(f) for f in faults]
        invariants = check(history.records, run_dir, fault_dicts, versions,
                           [s["rss_mib"] for s in samples[1:] if s["rss_mib"] is not None], load.archived_ledgers,
                           ARCHIVES_KEPT)
        not_injected = {**(NOT_INJECTED_TWO_HOSTS if two_hosts else NOT_INJECTED), **why_not}
        result = _result(seed, minutes, history, fault_dicts, invariants, samples[1:], final_steps, exit_code,
                         recovered, not_injected, kinds, time.monotonic() - started, load.churned)
        result["topology"] = "two hosts" if two_hosts else "one host"
        if not result["met"]:
            result["failing_seed"] = seed
            result["breaking_history"] = breaking_history(invariants, history.records)
        return result
    finally:
        history.close()
        os.environ.clear()
        os.environ.update(environ)
        if partition is not None:
            partition.heal()
        if server is not None and server.running():
            await asyncio.to_thread(server.stop)
        if disk is not None:
            for log in [run_dir / "server.log", *run_dir.glob("logs/*.log")]:  # what happened, after the tmpfs goes
                shutil.copy(log, work_dir / log.name)
            if keep:
                shutil.copytree(run_dir, work_dir / "run-kept", ignore=shutil.ignore_patterns(".chaos-ballast"))
            disk.unmount()


def _result(seed, minutes, history, faults, invariants, samples, final_steps, exit_code, recovered, not_injected,
            kinds, took_s, churned) -> dict:
    by_kind: dict[str, list] = defaultdict(list)
    for f in faults:
        by_kind[f["kind"]].append(f)
    windows = [(f["at_s"], f["at_s"] + f["held_s"] + (f["recovered_s"] or 0)) for f in faults]
    acks = [r["t"] for r in history.records if r.get("op") == "feedback" and r.get("status") == 202]
    during_s = sum(end - start for start, end in windows)
    soak_s = minutes * 60
    in_fault = sum(1 for t in acks if any(s <= t <= e for s, e in windows))
    rss = [s["rss_mib"] for s in samples if s["rss_mib"] is not None]
    warm = rss[len(rss) // 4:] if rss else []
    breaks = {name: value["count"] for name, value in invariants.items() if isinstance(value, dict)
              and "count" in value}
    checks = {**{name: count == 0 for name, count in breaks.items()},
              "every_experiment_trains_after": all(final_steps.values()), "clean_stop": exit_code == 0,
              "faults_recovered": all(f["error"] is None for f in faults)}
    return {
        "seed": seed, "minutes": minutes, "took_s": round(took_s, 1), "met": all(checks.values()), "checks": checks,
        "faults": {"total": len(faults), "kinds": list(kinds),
                   "by_kind": {kind: {"count": len(fs), "errors": [f["error"] for f in fs if f["error"]],
                                      "recovery_p50_s": _percentile([f["recovered_s"] for f in fs
                                                                     if f["recovered_s"] is not None], 0.5),
                                      "recovery_p95_s": _percentile([f["recovered_s"] for f in fs
                                                                     if f["recovered_s"] is not None], 0.95)}
                               for kind, fs in sorted(by_kind.items())},
                   "not_injected": not_injected,
                   "schedule": faults},
        "requests": answers_by_family(history.records),
        "invariants": invariants,
        "throughput_groups_per_min": {
            "during_faults": round(in_fault / during_s * 60, 1) if during_s else None,
            "outside_faults": round((len(acks) - in_fault) / max(soak_s - during_s, 1) * 60, 1)},
        "front_end_rss_mib": {"after_warm_up": round(warm[0], 1) if warm else None,
                              "peak_after_warm_up": round(max(warm), 1) if warm else None,
                              "end": round(rss[-1], 1) if rss else None},
        "run_dir_mib": {"peak": max((s["disk_mib"] for s in samples), default=None),
                        "end": samples[-1]["disk_mib"] if samples else None},
        "experiments_churned": churned, "recovered_at_end_s": round(recovered, 1),
        "every_experiment_trains_after": final_steps,
    }


async def figure(model_dir: Path, seed: int, minutes: float, gap_s: tuple[float, float], keep: bool = False,
                 tinker: bool = True, disk_mib: int = DISK_MIB, two_hosts: bool = False) -> dict:
    work_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
    result = await soak(model_dir, seed, minutes, gap_s, work_dir, tinker, keep=keep, disk_mib=disk_mib,
                        two_hosts=two_hosts)
    keep = keep or not result["met"]  # a failing run's history and logs stay, for its seed's replay
    if not keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    return {**result, "work_dir": str(work_dir) if keep else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs with faults")
    parser.add_argument("--gap", type=float, nargs=2, default=GAP_S, metavar=("MIN_S", "MAX_S"),
                        help="seconds between one fault's recovery and the next fault (uniform)")
    parser.add_argument("--no-tinker", action="store_true", help="leave the Tinker client out")
    parser.add_argument("--two-hosts", action="store_true",
                        help="the server split over two hosts, the sampler on a network namespace of its own "
                             "(chaos_hosts.py), with partitions between the hosts")
    from .server import standalone, standalone_options

    standalone_options(parser, sampler=False)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from .host import print_result

    model_dir, _ = standalone(args, "chaos")
    result = asyncio.run(figure(model_dir, args.seed, args.minutes, tuple(args.gap), args.keep, not args.no_tinker,
                                TINY_DISK_MIB if args.tiny else DISK_MIB, args.two_hosts))
    print_result({"model": str(model_dir), **result}, args.out)
    raise SystemExit(0 if result["met"] else 1)


if __name__ == "__main__":
    main()
