"""The transformers engine with k experiments sampling at once: their requests batched (sampler/hf_batches.py)
against the same requests one after another, which is how the engine ran them before (one request a model call).

    .venv/bin/python -m scripts.benchmarks.hf_batching [--k 4 8] [--rounds 3] [--out runs/hf-batching.json]

In process, on the embedded SmolLM2-135M-Instruct (float32 on the CPU, bfloat16 on CUDA: `dtype` auto), k
adapters of rank 16 (random B, so every row really runs its LoRA), one request each of alphabetize's size (n=8,
40 tokens, temperature 1, a 60-token prompt; EOS ignored by the count: tokens are what was generated). Each
round times both arrangements, alternating which goes first; the table gives the median of the rounds and
every round's ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from grpo_server.config import EMBEDDED_MODEL_NAME
from grpo_server.protocol.wire import AdapterRef, GenerateRequest
from grpo_server.protocol.worker_config import SamplerConfig
from grpo_server.workers.model_prep import resolve_model

from .adapter import write_adapter
from .host import loadavg

N, MAX_TOKENS, PROMPT_TOKENS, RANK = 8, 40, 60, 16


async def measure(model_dir: Path, ks: list[int], rounds: int) -> dict:
    from sampler.hf_engine import HfEngine

    work = Path(tempfile.mkdtemp(prefix="bench-hf-batching-"))
    adapters = [write_adapter(model_dir, work / f"a{i}", RANK, b_std=0.01, seed=i) for i in range(max(ks))]
    engine = HfEngine(SamplerConfig(model_path=model_dir, run_dir=work / "run", port=1, engine="transformers",
                                    max_model_len=1024, max_num_seqs=N * max(ks), max_lora_rank=RANK))
    await engine.start()
    refs = [AdapterRef(name=f"exp{i}", version=0) for i in range(len(adapters))]
    for ref, path in zip(refs, adapters):
        await engine.load_adapter(ref, str(path))
    prompt = list(range(1000, 1000 + PROMPT_TOKENS))

    def requests(k: int, seed: int) -> list[GenerateRequest]:
        return [GenerateRequest(prompt_token_ids=prompt, n=N, max_tokens=MAX_TOKENS, seed=seed + i, adapter=ref)
                for i, ref in enumerate(refs[:k])]

    async def one_by_one(reqs):
        return [await engine.generate(r) for r in reqs]

    async def at_once(reqs):
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    async def timed(arrangement, reqs) -> tuple[float, int]:
        started = time.perf_counter()
        answers = await arrangement(reqs)
        seconds = time.perf_counter() - started
        return seconds, sum(len(c.token_ids) for a in answers for c in a.completions)

    import torch

    out: dict = {"device": "cuda" if torch.cuda.is_available() else "cpu", "dtype": engine.dtype_name, "n": N, "max_tokens": MAX_TOKENS,
                 "prompt_tokens": PROMPT_TOKENS, "rank": RANK, "load_start": loadavg(), "k": {}}
    try:
        await at_once(requests(2, 0))  # warm-up: the first calls allocate
        for k in ks:
            rows = []
            for round_ in range(rounds):
                reqs = requests(k, 100 * round_)
                order = [("one_by_one", one_by_one), ("at_once", at_once)]
                if round_ % 2:
                    order.reverse()
                batches_before = engine.batches.batches
                row = {}
                for name, arrangement in order:
                    seconds, tokens = await timed(arrangement, reqs)
                    row[name] = {"s": round(seconds, 3), "tok_s": round(tokens / seconds, 1)}
                row["batches"] = engine.batches.batches - batches_before  # k + 1 when at once shared one batch
                row["ratio"] = round(row["at_once"]["tok_s"] / row["one_by_one"]["tok_s"], 3)
                rows.append(row)
                print(f"[hf-batching] k={k} round {round_}: {row}", flush=True)
            out["k"][k] = {"rounds": rows,
                           "one_by_one_tok_s": statistics.median(r["one_by_one"]["tok_s"] for r in rows),
                           "at_once_tok_s": statistics.median(r["at_once"]["tok_s"] for r in rows),
                           "ratio_median": statistics.median(r["ratio"] for r in rows),
                           "ratios": [r["ratio"] for r in rows]}
    finally:
        await engine.shutdown()
    out["load_end"] = loadavg()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/hf-batching.json"))
    args = parser.parse_args()
    result = asyncio.run(measure(resolve_model(EMBEDDED_MODEL_NAME), args.k, args.rounds))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {x: v[x] for x in ("one_by_one_tok_s", "at_once_tok_s", "ratio_median", "ratios")}
                      for k, v in result["k"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
