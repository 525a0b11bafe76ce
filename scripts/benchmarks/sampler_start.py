"""A vLLM sampler's start: seconds until `python -m sampler` answers /health, its processes' memory, and
its tokens/s, with the model's one worker inside vLLM's engine-core process (`uni`, the default on a CPU
host: sampler/vllm_start.py) or in a process of its own (`mp`, vLLM's own CPU default).

    .venv/bin/python -m scripts.benchmarks.sampler_start [--rounds 3] [--model smollm2-135m-instruct]

Four arms, in a rotating order, a fresh sampler process each start (tests/sampler_helpers.py's, with
max_model_len 1024, a 1 GiB KV cache and 32 sequences at once):
- `uni`: the default (the worker in the engine core, `sampler.cpu_threads` 1: one compute thread);
- `uni_all`: the same with `cpu_threads` 0 (a thread per core);
- `uni_spawn`: `uni` with its engine-core process spawned, as vLLM does on CPU, not forked (`engine_core_start`);
- `mp`: what a sampler ran before `uni`. It sets VLLM_CPU_OMP_THREADS_BIND to the core vLLM's automatic binding
  picks for its one worker on a 2-CPU box (`--mp-bind`, 0; the sampler log's "core ids" line says which it
  took), which keeps vLLM's spawned worker process.

Throughput: 4 concurrent /generate requests x n = 8 x 64 tokens (ignore_eos), a 60-token prompt, the median
of 3 timed passes after one warm-up, through the sampler's own HTTP verb.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpo_server.config import EMBEDDED_MODEL_NAME
from grpo_server.workers.model_prep import resolve_model
from tests.sampler_helpers import _start, _stop

from .memory import tree_rss

PROMPT = list(range(100, 160))


def one_start(model_dir: Path, arm: str, mp_bind: str) -> dict:
    """Start a sampler in `arm`, time it to /health, measure its memory and tokens/s, stop it."""
    tmp = Path(tempfile.mkdtemp(prefix=f"sampler-start-{arm}-"))
    env = {"VLLM_CPU_OMP_THREADS_BIND": mp_bind} if arm == "mp" else {}
    started = time.perf_counter()
    sampler = _start("vllm", model_dir, tmp, env=env, max_model_len=1024, kv_cache_gib=1, max_num_seqs=32,
                     cpu_threads=0 if arm == "uni_all" else 1,
                     engine_core_start="spawn" if arm == "uni_spawn" else "fork",
                     compile=False)  # the arms' own costs; torch.compile adds its minute to each alike
    start_s = time.perf_counter() - started
    try:
        processes, rss_mib = tree_rss(sampler.proc.pid)

        def generate(seed: int) -> int:
            out = sampler.generate(prompt_token_ids=PROMPT, n=8, max_tokens=64, seed=seed, ignore_eos=True)
            return sum(len(c["token_ids"]) for c in out["completions"])

        generate(0)
        rates = []
        with ThreadPoolExecutor(4) as pool:
            for p in range(3):
                t0 = time.perf_counter()
                tokens = sum(pool.map(generate, [1 + 4 * p + i for i in range(4)]))
                rates.append(tokens / (time.perf_counter() - t0))
        bound = [line for line in sampler.log.read_text(errors="replace").splitlines() if "core ids" in line]
        return {"arm": arm, "start_s": round(start_s, 1), "processes": processes, "rss_mib": round(rss_mib),
                "tok_s": round(statistics.median(rates), 1), "binding": bound[-1].split("]", 1)[-1].strip() if bound
                else "none (no vLLM worker process)"}
    finally:
        _stop(sampler.proc)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_NAME)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mp-bind", default="0", help="the mp arm's VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        parser.error("unset VLLM_CPU_OMP_THREADS_BIND: the mp arm sets it, and the uni arms need it unset")
    model_dir = resolve_model(args.model)
    rows = []
    arms = ("uni", "uni_spawn", "uni_all", "mp")
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            rows.append({"round": r, **one_start(model_dir, arm, args.mp_bind)})
            print(json.dumps(rows[-1]), flush=True)
    summary = {arm: {key: statistics.median(row[key] for row in rows if row["arm"] == arm)
                     for key in ("start_s", "rss_mib", "tok_s")} for arm in arms}
    print(json.dumps({"median": summary}), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
