"""Completions throughput through grpo_server's HTTP API vs vLLM used directly, same request mix.

    .venv/bin/python scripts/bench_completions.py [--requests 16 --n 8 --max-tokens 64 --concurrency 8]

Phase 1 starts `grpo-server serve` on the model, creates an experiment (LoRA r=16, version 0) and sends
the mix over HTTP. Phase 2 stops it and drives vLLM's AsyncLLM in-process with the same engine
arguments, the same prompts, seeds and sampling parameters, under the same adapter folder. Prints
tokens/s of each and the ratio (server / direct); append the output to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grpo_server.client import AsyncClient  # noqa: E402
from grpo_server.config import EMBEDDED_MODEL_NAME, SamplerConfig  # noqa: E402
from grpo_server.model_prep import resolve_model  # noqa: E402
from tests.serving import start_server, stop_server  # noqa: E402

TOPICS = ["rivers", "chess", "bread", "volcanoes", "owls", "trains", "tea", "glass", "maps", "bees",
          "clocks", "salt", "kites", "moss", "ink", "snow"]


def prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}."}]
            for i in range(count)]


async def run_mix(one_request, count: int, concurrency: int) -> tuple[int, float]:
    """Send `count` requests, `concurrency` at a time; return (completion tokens, seconds)."""
    semaphore = asyncio.Semaphore(concurrency)
    tokens = 0

    async def guarded(i: int) -> None:
        nonlocal tokens
        async with semaphore:
            count = await one_request(i)  # not `tokens += await ...`: that reads `tokens` before the await
            tokens += count

    started = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(count)))
    return tokens, time.perf_counter() - started


def server_request(client: AsyncClient, name: str, args, prompt_ids: list[list[int]]):
    """One request of the mix through the HTTP API: `one(i)` -> completion tokens; records the prompt's
    token ids in `prompt_ids[i]` (the direct engine is sent exactly those)."""
    chats = prompts(args.requests)

    async def one(i: int) -> int:
        group = await client.complete(name, messages=chats[i], n=args.n, max_tokens=args.max_tokens,
                                      temperature=1.0, seed=i)
        prompt_ids[i] = group.prompt_token_ids
        return sum(len(c.token_ids) for c in group.completions)

    return one


def server_sampler_settings(args) -> dict:
    """The server's `sampler` settings of this benchmark (the direct engine gets the same ones)."""
    return {"engine": "vllm", "kv_cache_gib": 2, "max_num_seqs": args.max_num_seqs}


async def through_server(model_dir: Path, run_dir: Path, args) -> tuple[float, list[list[int]], str]:
    handle = start_server(run_dir, model_dir, engine="vllm", max_model_len=1024,
                          sampler=server_sampler_settings(args))
    try:
        async with AsyncClient(handle.url, handle.api_key) as client:
            await client.create_experiment({"name": "bench"})
            prompt_ids: list[list[int]] = [None] * args.requests  # type: ignore[list-item]
            one = server_request(client, "bench", args, prompt_ids)
            await run_mix(one, min(2, args.requests), args.concurrency)  # warm-up
            tokens, seconds = await run_mix(one, args.requests, args.concurrency)
        adapter = str(run_dir / "adapters" / "bench" / "v000000")
    finally:
        stop_server(handle)
    return tokens / seconds, prompt_ids, adapter


def direct_engine(model_dir: Path, args):
    """vLLM's AsyncLLM in this process, with the sampler's own engine arguments (sampler.vllm_engine)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from sampler.vllm_engine import engine_args

    config = SamplerConfig(model_path=model_dir, run_dir=Path(tempfile.mkdtemp()), port=1, max_model_len=1024,
                           kv_cache_gib=2, max_num_seqs=args.max_num_seqs)
    return AsyncLLM.from_engine_args(engine_args(config, config.max_model_len))


def direct_request(llm, adapter: str | None, args, prompt_ids: list[list[int]]):
    """One request of the mix straight into the engine, under the adapter folder (None: no LoRA, e.g. when
    the adapter is merged into the engine's weights): `one(i)` -> tokens."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    lora = LoRARequest("bench@v0", 1, adapter) if adapter else None

    async def one(i: int) -> int:
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=i, logprobs=0,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt_ids[i]), params, uuid.uuid4().hex,
                                      lora_request=lora):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    return one


async def directly(model_dir: Path, prompt_ids: list[list[int]], adapter: str, args) -> float:
    llm = direct_engine(model_dir, args)
    try:
        one = direct_request(llm, adapter, args, prompt_ids)
        await run_mix(one, min(2, args.requests), args.concurrency)  # warm-up
        tokens, seconds = await run_mix(one, args.requests, args.concurrency)
    finally:
        llm.shutdown()
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_NAME)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model_dir = resolve_model(args.model)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-completions-"))
    server_tps, prompt_ids, adapter = asyncio.run(through_server(model_dir, run_dir, args))
    direct_tps = asyncio.run(directly(model_dir, prompt_ids, adapter, args))
    result = {"model": args.model, "requests": args.requests, "n": args.n, "max_tokens": args.max_tokens,
              "concurrency": args.concurrency, "server_tok_s": round(server_tps, 1),
              "direct_tok_s": round(direct_tps, 1), "ratio": round(server_tps / direct_tps, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
