"""scripts/gpu-check's driver: every phase of the stack on a CUDA machine, each in its own process with its own
time limit, all results in one JSON file. A phase that fails or runs out of time is recorded and the next runs.

    scripts/gpu-check                   # on the GPU machine (the `run` tool's H200): phases below, at most ~8 minutes
    scripts/gpu-check --cpu-smoke       # here: the same phases, tiny and short, on the CPU with .venv
    scripts/gpu-check --prepare         # here, with network: fetch the wheels and split the model (gpu_carry.py)

Phases (gpu_phases.py holds their bodies; docs/development/index.md "The whole stack on a GPU": what they show):
install (the carried wheels into a target folder: the machine has no network), model (SmolLM2-135M-Instruct
from the carried GGUF halves, or a tiny random model when a half is missing), learner (DeepSpeed ZeRO-2 in bf16
on CUDA, in process), sampler (the transformers engine on CUDA, in process), server (the whole server on that
engine), race_server and race_trl (end_to_end.py's race on alphabetize, one side each, so a side that hangs
keeps the other's result), then race (end_to_end's `compare` of the two sides, computed here).

`--fleet K` runs the fleet race instead of the race (issue 28, item 6): install, model, then fleet.py's server
arrangements on the transformers engine, fleet_at_once (K alphabetize experiments, seeds 0..K-1, at once on one
server) and fleet_one_by_one (the same K one after another on a fresh server), then fleet: one by one's time over
at once's, beside the figure to beat (FLEET_PUBLISHED). Each side gets half of what the budget leaves; one by one
splits its half evenly among its K experiments, and one that misses the target counts its limit, so the
speed-up is then a lower bound. `--only install,model,fleet_one_by_one --fleet 8` runs one side in a call of
its own where one call's budget is too short for both.

Only the standard library is imported here: this process runs before the wheels are installed, and must
record a phase that breaks on an import.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import REPO

RESULT_PREFIX = "GPU_CHECK_RESULT "  # a phase's last line starting with this is its JSON result
WHEELS = REPO / ".gpu-wheels"
PHASES = ("install", "model", "learner", "sampler", "server", "race_server", "race_trl")
FLEET_PHASES = ("fleet_at_once", "fleet_one_by_one")  # with --fleet K (or named in --only)
# The published figure the fleet race on a GPU is to beat (issue 28): Trajectory's multi-LoRA stack on SkyRL,
# experiment throughput of 8 concurrent runs on one H200 against the same runs one after another.
FLEET_PUBLISHED = {"k": 8, "speedup": 2.81, "source": "Trajectory multi-LoRA on SkyRL, one H200 (1.88x at k=4)"}
FLEET_GOAL = 3.0  # the speed-up this server aims at, at k = 8 on one H200
# Per phase: the longest it may take (seconds). The race sides get what the budget leaves (race_limits).
GPU_TIMEOUTS = {"install": 90, "model": 120, "learner": 100, "sampler": 75, "server": 110}
SMOKE_TIMEOUTS = {"install": 120, "model": 240, "learner": 300, "sampler": 180, "server": 420}
# Seconds a race side needs beside its clock: server start and stop, TRL's imports and model load.
GPU_SIDE_OVERHEAD = {"race_server": 75, "race_trl": 60, "fleet_at_once": 90, "fleet_one_by_one": 90}
SMOKE_SIDE_OVERHEAD = {"race_server": 300, "race_trl": 240, "fleet_at_once": 300, "fleet_one_by_one": 300}
GRACE_S = 30  # after SIGINT, before SIGKILL: the server phases stop their server in a `finally`
GPU_BUDGET_S = 440  # with a last phase's GRACE_S and the start, under the 8 minutes a GPU call is sized for


def default_out() -> Path:
    """$OUT (the run tool's output folder, which comes back) or runs/."""
    return Path(os.environ["OUT"]) / "gpu-check.json" if os.environ.get("OUT") else REPO / "runs" / "gpu-check.json"


def fleet_limit(phase: str, remaining_s: float, sides_left: int, k: int, smoke: bool) -> float:
    """Seconds on a fleet side's clock: at once, the shared clock; one by one, each experiment's (its half split
    evenly among its k experiments). A side's half: what is left, less the sides' overheads, over the sides left."""
    if smoke:
        return 30.0 if phase == "fleet_at_once" else 15.0  # the plumbing only
    side_s = max(20.0, (remaining_s - GPU_SIDE_OVERHEAD[phase] * sides_left - 10) / sides_left)
    return side_s if phase == "fleet_at_once" else max(10.0, side_s / k)


def race_limits(remaining_s: float, smoke: bool) -> float:
    """Seconds on each race side's clock: what is left, less both sides' overheads, shared evenly."""
    if smoke:
        return 20.0  # the plumbing only: the TRL side's first optimizer step takes longer than this anyway
    overhead = GPU_SIDE_OVERHEAD["race_server"] + GPU_SIDE_OVERHEAD["race_trl"]
    return max(20.0, min(600.0, (remaining_s - overhead - 10) / 2))


# --- processes -------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in () may hold spaces
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGINT to the phase (its `finally` blocks stop a server), then SIGKILL to whatever of its tree is left.
    The tree is read before the signal: a worker whose parent dies is re-parented and would be lost."""
    tree = descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *tree, *(p for t in tree for p in descendants(t))]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_phase(cmd: list[str], timeout_s: float, env: dict, log, label: str, needs_result: bool = True) -> dict:
    """One phase in its own process (own session): its output goes to `log` and to our stdout with a label;
    returns rc, seconds, timed_out, its result (the last RESULT_PREFIX line) and, on failure, its last lines."""
    started = time.perf_counter()
    # SIGINT back to its default in the phase: a shell ignores it in what it starts in the background, and the
    # phase would inherit that, skip its `finally` and wait GRACE_S for the SIGKILL.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    found: list[dict] = []

    def pump() -> None:
        for line in proc.stdout:
            if line.startswith(RESULT_PREFIX):
                try:
                    found.append(json.loads(line[len(RESULT_PREFIX):]))
                except ValueError:
                    lines.append(line)
                continue
            lines.append(line)
            del lines[:-200]
            log.write(f"[{label}] {line}")
            log.flush()
            print(f"[{label}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop_tree(proc)
    except BaseException:  # our own SIGINT / SIGTERM: take the phase down with us
        stop_tree(proc)
        raise
    reader.join(timeout=10)
    out = {"rc": proc.returncode, "seconds": round(time.perf_counter() - started, 1), "timeout_s": round(timeout_s),
           "timed_out": timed_out}
    if found:
        out["result"] = found[-1]
    out["ok"] = proc.returncode == 0 and not timed_out and (bool(found) or not needs_result)
    if not out["ok"]:
        out["error"] = (f"no result within {timeout_s:.0f} s" if timed_out else
                        f"exited {proc.returncode}" + ("" if found or not needs_result else " without a result"))
        out["log_tail"] = "".join(lines[-40:])[-6000:]
    return out


# --- the phases ------------------------------------------------------------------------------------


def install_cmd(python: str, smoke: bool, target: Path) -> list[str]:
    """pip from the carried folder only. Smoke: the same wheels for the GPU machine's Python 3.12 into a
    throw-away folder, which checks that the set installs (not used: this box runs .venv)."""
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(target)]
    if smoke:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--platform",
                "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any"]
    return cmd + sorted(str(p) for p in WHEELS.glob("*.whl"))


def install(python: str, smoke: bool, site: Path, env: dict, log) -> dict:
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        return {"ok": False, "error": f"no wheels in {WHEELS} (scripts/gpu-check --prepare, and carry it)"}
    timeout = (SMOKE_TIMEOUTS if smoke else GPU_TIMEOUTS)["install"]
    out = run_phase(install_cmd(python, smoke, site), timeout, env, log, "install", needs_result=False)
    out["result"] = {"wheels": [p.name for p in wheels], "target": str(site),
                     "megabytes": round(sum(p.stat().st_size for p in wheels) / 1e6, 1)}
    return out


def machine() -> dict:
    """What the machine is: GPU (nvidia-smi), Python, cores; a failure here is only recorded."""
    out: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                 "cpus": os.cpu_count()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["gpus"] = [line.strip() for line in smi.stdout.splitlines() if line.strip()] or smi.stderr.strip()[-300:]
    except (OSError, subprocess.SubprocessError) as exc:
        out["gpus"] = f"nvidia-smi: {exc}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="the phases tiny and short, on the CPU")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default $OUT/gpu-check.json, else runs/)")
    parser.add_argument("--budget-s", type=float, default=None, help="all phases together (GPU 440, smoke 1500)")
    parser.add_argument("--only", default="", help="comma-separated phases (default all)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (model, run folders)")
    parser.add_argument("--target", type=float, default=0.6, help="race: running mean reward to reach")
    parser.add_argument("--window", type=int, default=None, help="race: groups in the running mean (16; smoke 4)")
    parser.add_argument("--fleet", type=int, default=0, metavar="K",
                        help="the fleet race of K experiments instead of the race (install, model and the fleet phases)")
    parser.add_argument("--compare-fleet", nargs="+", type=Path, metavar="JSON",
                        help="only compare the fleet sides of earlier runs' JSON files (one side a call)")
    args = parser.parse_args()
    if args.compare_fleet:
        sides = {name: phase for path in args.compare_fleet
                 for name, phase in json.loads(path.read_text())["phases"].items() if name in FLEET_PHASES}
        missing = [name for name in FLEET_PHASES if name not in sides]
        print(json.dumps(compare_fleet(sides) if not missing else {"ok": False, "missing": missing}, indent=2))
        return 0 if not missing else 1
    # SIGTERM (a caller's time limit) as SIGINT: run_phase then stops the phase's tree, which lives in its own
    # session and would outlive us otherwise.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    smoke = args.cpu_smoke
    if args.only:
        only = [p for p in PHASES + FLEET_PHASES if p in args.only.split(",")]
    else:
        only = ["install", "model", *FLEET_PHASES] if args.fleet else list(PHASES)
    started = time.monotonic()
    deadline = started + (args.budget_s or (1500.0 if smoke else GPU_BUDGET_S))
    out_path = args.out or default_out()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    site = work / "site"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}  # progress bars would fill the log
    if not smoke:  # the wheels shadow whatever older copies the machine's image has
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    results: dict = {"mode": "cpu-smoke" if smoke else "gpu", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                     time.gmtime()), "argv": sys.argv[1:], "machine": machine(), "phases": {}}
    phases = results["phases"]

    def save() -> None:
        results["total_s"] = round(time.monotonic() - started, 1)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(tmp, out_path)

    context: dict = {"smoke": smoke, "work": str(work), "target": args.target,
                     "window": args.window or (4 if smoke else 16), "fleet_k": args.fleet or (2 if smoke else 8)}
    try:
        with open(out_path.with_suffix(".log"), "w") as log:
            run_all(only, phases, context, deadline, site, env, log, save)
    except KeyboardInterrupt:  # SIGINT or SIGTERM: the phase in flight was stopped (run_phase); say so
        results["interrupted"] = True
    finally:
        results["ok"] = bool(phases) and all(p.get("ok") for p in phases.values()) and not results.get("interrupted")
        save()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    brief = ", ".join(f"{name} {'ok' if p.get('ok') else 'FAILED'}" for name, p in phases.items())
    print(f"[gpu-check] {brief}; {results['total_s']} s; {out_path}", flush=True)
    return 0 if results["ok"] else 1


def run_all(only: list[str], phases: dict, context: dict, deadline: float, site: Path, env: dict, log,
            save) -> None:
    """Each phase in order (skipped when what it needs is missing or the budget is spent), the JSON saved after
    each; then the two race sides compared."""
    smoke, work = context["smoke"], Path(context["work"])
    for phase in only:
        remaining = deadline - time.monotonic()
        print(f"[gpu-check] {phase} ({remaining:.0f} s left of the budget)", flush=True)
        if phase == "install":
            phases[phase] = install(sys.executable, smoke, site, env, log)
        elif phase != "model" and "model_dir" not in context:
            phases[phase] = {"ok": False, "skipped": "no model (the model phase failed or did not run)"}
        elif phase.startswith(("race", "fleet")) and context.get("model_kind") != "smollm2-135m-instruct":
            phases[phase] = {"ok": False, "skipped": "the races need SmolLM2-135M-Instruct, not the tiny model"}
        elif remaining < 20:
            phases[phase] = {"ok": False, "skipped": f"the budget is spent ({remaining:.0f} s left)"}
        else:
            phase_context = context
            if phase.startswith("race"):
                context["time_limit_s"] = context.get("time_limit_s") or race_limits(remaining, smoke)
                timeout = context["time_limit_s"] + (SMOKE_SIDE_OVERHEAD if smoke else GPU_SIDE_OVERHEAD)[phase]
            elif phase.startswith("fleet"):
                sides_left = len([p for p in only[only.index(phase):] if p in FLEET_PHASES])
                limit = fleet_limit(phase, remaining, sides_left, context["fleet_k"], smoke)
                phase_context = {**context, "time_limit_s": limit}
                clocks = limit if phase == "fleet_at_once" else limit * context["fleet_k"]
                timeout = clocks + (SMOKE_SIDE_OVERHEAD if smoke else GPU_SIDE_OVERHEAD)[phase]
            else:
                timeout = (SMOKE_TIMEOUTS if smoke else GPU_TIMEOUTS)[phase]
            cmd = [sys.executable, "-m", "scripts.benchmarks.gpu_phases", phase,
                   context_file(work, phase, phase_context)]
            phases[phase] = {"running": True}  # what the JSON says if we are stopped meanwhile
            phases[phase] = run_phase(cmd, min(timeout, remaining), env, log, phase)
            context.update(phases[phase].get("result", {}).pop("context", {}))
        save()
    if "race_server" in phases and "race_trl" in phases:
        phases["race"] = compare_sides(phases, context, env, log)
    if all(p in phases for p in FLEET_PHASES):
        phases["fleet"] = compare_fleet(phases)


def compare_fleet(phases: dict) -> dict:
    """One by one's time (the sum of its clocks) over at once's (the last experiment's target): the fleet's
    speed-up, beside the published figure and the goal. An experiment that missed the target one by one counts
    its limit, so the speed-up is then a lower bound (`exact` false); at once missing it gives none."""
    once, one_by_one = (phases[p].get("result") for p in FLEET_PHASES)
    if not once or not one_by_one:
        return {"ok": False, "skipped": "a fleet side has no result"}
    out = {"ok": True, "k": len(once["experiments"]), "at_once_s": once["fleet_s"], "published": FLEET_PUBLISHED,
           "goal": FLEET_GOAL}
    rows = one_by_one["experiments"]
    out["one_by_one_s"] = round(sum(r["reached_s"] if r["reached"] else one_by_one["time_limit_s"] for r in rows), 1)
    out["exact"] = all(r["reached"] for r in rows)
    # Groups a second over each arrangement's wall time: the rate at once adds, even where no clock reached the
    # target (the first GPU run: 0.34 against 0.35, the transformers engine taking one request a model call).
    rates = {"at_once": _groups_per_s(once), "one_by_one": _groups_per_s(one_by_one)}
    out["groups_per_s"] = rates
    if None not in rates.values() and rates["one_by_one"] > 0:
        out["throughput_ratio"] = round(rates["at_once"] / rates["one_by_one"], 3)
    if once["fleet_s"] is None:
        out["verdict"] = "at once missed the target within its clock: no speed-up measured"
        return out
    out["speedup"] = round(out["one_by_one_s"] / once["fleet_s"], 3)
    bound = "" if out["exact"] else "at least "
    met = "met" if out["speedup"] >= FLEET_GOAL else ("not met" if out["exact"] else "not shown")
    out["verdict"] = (f"{bound}{out['speedup']}x at k={out['k']} against the published {FLEET_PUBLISHED['speedup']}x "
                      f"at k={FLEET_PUBLISHED['k']}; goal {FLEET_GOAL}x: {met}")
    return out


def _groups_per_s(side: dict) -> float | None:
    groups = sum(row.get("groups", 0) for row in side["experiments"])
    return round(groups / side["wall_s"], 3) if side.get("wall_s") else None


def compare_sides(phases: dict, context: dict, env: dict, log) -> dict:
    """end_to_end's `compare` of the two sides (in a process of the phases' Python: it needs their imports)."""
    sides = {side: phases[f"race_{side}"].get("result", {}).get(side) for side in ("server", "trl")}
    if None in sides.values():
        return {"ok": False, "skipped": "a side has no result"}
    cmd = [sys.executable, "-m", "scripts.benchmarks.gpu_phases", "compare",
           context_file(Path(context["work"]), "compare", {**context, **sides})]
    return run_phase(cmd, 60, env, log, "race")


def context_file(work: Path, phase: str, context: dict) -> str:
    """The context as a file (a race's curves could outgrow one command-line argument)."""
    path = work / f"context-{phase}.json"
    path.write_text(json.dumps(context))
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
