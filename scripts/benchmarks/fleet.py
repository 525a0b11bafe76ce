"""The fleet race: how long until every one of k alphabetize experiments has learned (issue 28, item 1).

What a team feels when many experiments share one base model: the time until the last of its k experiments
has reached the target (the mean of its last `window` groups >= 0.6, race.py's `Race`). Each arrangement is
one invocation, so a long series can be stopped and resumed; `--summarize` reads their JSON files back and
prints the comparison.

    .venv/bin/python -m scripts.benchmarks.fleet --arrangement at_once --seeds 0-3 --out runs/fleet/once-0-3.json
    .venv/bin/python -m scripts.benchmarks.fleet --arrangement one_by_one --seeds 0-7 --out runs/fleet/seq-0-7.json
    .venv/bin/python -m scripts.benchmarks.fleet --arrangement trl_one_by_one --seeds 0-7 --out runs/fleet/trl-0-7.json
    .venv/bin/python -m scripts.benchmarks.fleet --summarize runs/fleet/*.json

The arrangements (experiment i of a fleet draws its prompts from `random.Random(seed_i)`, as end_to_end.py's
pair i does, so "k = 4, seeds 0-3" means the same four tasks in every arrangement):

- `at_once`: one server (configs/server.yaml, as scripts/demo serves), k experiments created together, each
  driven by examples/task_runner.py's episode, as many at once as the server suggests (as in the demo). An
  experiment whose running mean reaches the target stops being driven (a team stops a run that has learned) and
  the others go on. The fleet's time: from the first create to the last experiment's target.
- `one_by_one`: the same server, the same experiments in turn: the next one is created when the one before
  reached its target (or its own time limit). The fleet's time: the sum of each experiment's clock (each
  clock as end_to_end.py's: from its create to its target).
- `trl_one_by_one`: TRL's GRPOTrainer (trl_side.py, one fresh process per experiment); the sum of their clocks
  (model load excluded, as the server's start is on the server side).
- `trl_side_by_side`: the k trl_side.py processes at once, each with `cores / k` torch threads (at least 1);
  the fleet's time is the slowest one's clock.

`--trl-bf16` runs TRL's sides under bf16 autocast (trl_side.py --bf16), its faster setting on a CPU with
avx512_bf16 (docs/benchmarks/findings.md "The race to 0.6": 1.16x its float32).

The server's start and TRL's model load are outside every clock, the same on both sides. `--set` changes a
server setting (`sampler.max_loras=8` for k = 8: more adapters than slots would swap them in and out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from . import REPO
from .end_to_end import ALPHABETIZE_CONFIG, DEMO_CONCURRENCY, TRL_MODULE, server_overrides, wait_healthy
from .host import loadavg, other_processes
from .memory import peak_rss
from .race import Race, drive
from .run_metrics import learning_summary

ARRANGEMENTS = ("at_once", "one_by_one", "trl_one_by_one", "trl_side_by_side")


def parse_seeds(text: str) -> list[int]:
    """"0-3" -> [0, 1, 2, 3]; "0,2,5" -> [0, 2, 5]."""
    if "-" in text:
        first, last = (int(x) for x in text.split("-", 1))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(",") if x.strip()]


# --- the server's arrangements ----------------------------------------------------------------------


def _progress_printer():
    last = {}

    def note(name: str, race: Race) -> None:
        now = time.monotonic()
        if now - last.get(name, 0.0) < 30 and not race.done:
            return
        last[name] = now
        recent = [r[2] for r in race.rows[-race.window:]]
        state = f"reached at {race.reached['seconds']} s" if race.reached else f"mean of last {len(recent)}: " \
                                                                              f"{statistics.fmean(recent):.3f}"
        print(f"[fleet] {name}: {race.elapsed():.0f} s, {len(race.rows)} groups, step {race.rows[-1][1]}, "
              f"{state} (load {loadavg()})", flush=True)
    return note


async def server_fleet(model_dir: Path, arrangement: str, seeds: list[int], target: float, window: int,
                       time_limit_s: float, concurrency: int | None, settings: list[str]) -> dict:
    """`at_once` or `one_by_one` on one server started for it."""
    from grpo_server.client import AsyncClient

    from .server import start, stop

    base = yaml.safe_load(ALPHABETIZE_CONFIG.read_text())
    overrides = server_overrides(settings)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    t0 = time.perf_counter()
    handle = await start(run_dir, model_dir, **overrides)
    out: dict = {"arrangement": arrangement, "seeds": seeds, "concurrency": concurrency or "suggested",
                 "server_config": overrides,
                 "others_at_start": await asyncio.to_thread(other_processes), "experiments": []}
    note = _progress_printer()
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as client:
            await wait_healthy(client)
            out["startup_s"] = round(time.perf_counter() - t0, 1)
            out["load_start"] = loadavg()
            print(f"[fleet] {arrangement}, seeds {seeds}: server ready in {out['startup_s']} s (load "
                  f"{out['load_start']})", flush=True)
            names = [f"alphabetize-s{seed}" for seed in seeds]
            races = [Race(target, window, time_limit_s) for _ in seeds]
            fleet_clock = time.perf_counter()

            async def one(name: str, seed: int, race: Race) -> None:
                race.start()
                await client.create_experiment({**base, "name": name})
                await drive(client, name, race, seed, concurrency, lambda: note(name, race))

            if arrangement == "at_once":
                await asyncio.gather(*(one(n, s, r) for n, s, r in zip(names, seeds, races)))
            else:
                for name, seed, race in zip(names, seeds, races):
                    await one(name, seed, race)
            out["wall_s"] = round(time.perf_counter() - fleet_clock, 1)
            out["load_end"] = loadavg()
            out["peak_rss_mib"] = peak_rss(handle.process.pid)  # VmHWM of each process with its children
            for name, seed, race in zip(names, seeds, races):
                status = await client.status(name)
                out["experiments"].append({"name": name, "seed": seed, **race.summary(),
                                           "policy_version": status.policy_version, "served_as": status.served_as,
                                           "errors": status.errors})
    finally:
        out["server_exit_code"] = await stop(handle)
        for row in out["experiments"]:
            row["learning"] = learning_summary(run_dir / "metrics" / f"{row['name']}.jsonl")
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


# --- TRL's arrangements -----------------------------------------------------------------------------


def _trl_cmd(seed: int, target: float, window: int, time_limit_s: float, bf16: bool) -> list[str]:
    return [sys.executable, "-m", TRL_MODULE, "--target", str(target), "--window", str(window),
            "--time-limit-s", str(time_limit_s), "--seed", str(seed)] + (["--bf16"] if bf16 else [])


def trl_fleet(arrangement: str, seeds: list[int], target: float, window: int, time_limit_s: float,
              bf16: bool = False) -> dict:
    """trl_side.py per experiment: one after another, or all at once with the cores shared out. `bf16`: bf16
    autocast on the CPU (trl_side.py --bf16), TRL's faster setting on a CPU with avx512_bf16."""
    out: dict = {"arrangement": arrangement, "seeds": seeds, "bf16": bf16, "others_at_start": other_processes(),
                 "load_start": loadavg(), "experiments": []}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    if arrangement == "trl_one_by_one":
        for seed in seeds:
            print(f"[fleet] TRL seed {seed} (load {loadavg()}) ...", flush=True)
            proc = subprocess.run(_trl_cmd(seed, target, window, time_limit_s, bf16), stdout=subprocess.PIPE,
                                  text=True, timeout=time_limit_s + 1800, env=env, cwd=REPO)
            out["experiments"].append(_trl_result(proc.returncode, proc.stdout, seed))
    else:
        threads = max(1, (os.cpu_count() or 1) // len(seeds))
        out["torch_threads_each"] = threads
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        procs = [subprocess.Popen(_trl_cmd(seed, target, window, time_limit_s, bf16), stdout=subprocess.PIPE,
                                  text=True, env=env, cwd=REPO) for seed in seeds]
        for seed, proc in zip(seeds, procs):
            stdout, _ = proc.communicate(timeout=time_limit_s + 1800)
            out["experiments"].append(_trl_result(proc.returncode, stdout, seed))
    out["wall_s"] = round(time.perf_counter() - started, 1)
    out["load_end"] = loadavg()
    return out


def _trl_result(code: int, stdout: str, seed: int) -> dict:
    if code != 0:
        raise RuntimeError(f"{TRL_MODULE} --seed {seed} exited {code}")
    result = json.loads(stdout.strip().splitlines()[-1])
    print(f"[fleet] TRL seed {seed}: reached {result['reached']} at {result['reached_s']} s, "
          f"{result['groups']} groups", flush=True)
    return {"seed": seed, **result}


# --- the figure -------------------------------------------------------------------------------------


def fleet_seconds(run: dict) -> float | None:
    """The fleet's time: at once, the last experiment's target on the shared clock; one by one, the sum of the
    clocks. None when an experiment missed the target within its limit."""
    rows = run["experiments"]
    if not rows or not all(r.get("reached") for r in rows):
        return None
    if run["arrangement"] in ("at_once", "trl_side_by_side"):
        return round(max(r["reached_s"] for r in rows), 1)
    return round(sum(r["reached_s"] for r in rows), 1)


def summarize(paths: list[Path]) -> dict:
    """Per k (the seeds of each `at_once` run): every arrangement's fleet time on those same seeds, the medians
    over the runs, and each arrangement's median over at once's (the speed-up; > 1: at once is faster). The
    one-by-one times are sums of per-experiment clocks, so a file of seeds 0-3 and one of 4-7 give k = 8's too."""
    runs = [json.loads(path.read_text()) | {"file": path.name} for path in paths]
    per_seed: dict[str, dict[int, dict]] = {}
    for run in runs:
        if run["arrangement"] in ("one_by_one", "trl_one_by_one"):
            for row in run["experiments"]:
                per_seed.setdefault(_side(run), {}).setdefault(row["seed"], row)
    table: dict[str, dict] = {}
    for run in (r for r in runs if r["arrangement"] in ("at_once", "trl_side_by_side")):
        seeds = run["seeds"]
        per_k = table.setdefault(f"k={len(seeds)}", {"runs": []})
        row = {"seeds": seeds, _side(run): fleet_seconds(run), "load": [run.get("load_start"), run.get("load_end")]}
        for arrangement, rows in per_seed.items():
            if all(seed in rows for seed in seeds):
                row[arrangement] = fleet_seconds({"arrangement": arrangement, "experiments": [rows[s] for s in seeds]})
        per_k["runs"].append(row)
    for per_k in table.values():
        arrangements = sorted({a for row in per_k["runs"] for a in row if a not in ("seeds", "load")})
        per_k["medians_s"] = {a: _median([row[a] for row in per_k["runs"] if a in row]) for a in arrangements}
        # Each ratio over the runs that have both sides: the same seeds, the same box's day.
        per_k["speedup_of_at_once"] = {}
        for a in arrangements:
            pairs = [(row[a], row["at_once"]) for row in per_k["runs"] if a in row and "at_once" in row]
            if a != "at_once" and pairs:
                other, once = _median([p[0] for p in pairs]), _median([p[1] for p in pairs])
                per_k["speedup_of_at_once"][a] = {"ratio": round(other / once, 3) if other and once else None,
                                                  "runs": len(pairs)}
    return table


def _side(run: dict) -> str:
    """The arrangement, and TRL's bf16 apart from its float32: "trl_one_by_one_bf16"."""
    return run["arrangement"] + ("_bf16" if run.get("bf16") else "")


def _median(times: list[float | None]) -> float | None:
    """None when any run missed its target (a miss is slower than every finish, and its time is unknown)."""
    return None if not times or None in times else statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arrangement", choices=ARRANGEMENTS)
    parser.add_argument("--seeds", default="0-3", help="one experiment per seed: 0-3, or 0,2,5")
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--time-limit-s", type=float, default=1200.0,
                        help="each experiment's clock at most (at once: the shared clock)")
    parser.add_argument("--concurrency", type=int, default=DEMO_CONCURRENCY,
                        help="groups in flight per experiment (default: the server's suggestion)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="server setting")
    parser.add_argument("--trl-bf16", action="store_true", help="TRL's sides in bf16 autocast (trl_side.py --bf16)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="JSON")
    args = parser.parse_args()
    if args.summarize:
        print(json.dumps(summarize(args.summarize), indent=2))
        return 0
    if not args.arrangement:
        parser.error("--arrangement or --summarize")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    seeds = parse_seeds(args.seeds)
    if args.arrangement.startswith("trl"):
        result = trl_fleet(args.arrangement, seeds, args.target, args.window, args.time_limit_s, args.trl_bf16)
    else:
        from grpo_server.config import EMBEDDED_MODEL_NAME
        from grpo_server.workers.model_prep import resolve_model

        from .server import stop_on_signals

        stop_on_signals()
        result = asyncio.run(server_fleet(resolve_model(EMBEDDED_MODEL_NAME), args.arrangement, seeds, args.target,
                                          args.window, args.time_limit_s, args.concurrency, args.set))
    result.update(target=args.target, window=args.window, time_limit_s=args.time_limit_s,
                  fleet_s=fleet_seconds(result), command=" ".join(sys.argv))
    print(f"[fleet] {args.arrangement} seeds {seeds}: fleet time {result['fleet_s']} s, wall {result['wall_s']} s",
          flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
