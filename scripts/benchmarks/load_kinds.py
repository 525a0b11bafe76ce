"""The client kinds of the mixed load round (load_mixed.py), each a loop until the round's deadline:

- plain: native `completions` then `feedback` (load.py's loop);
- stream: `POST /v1/chat/completions` with `stream: true` (model = the experiment), read as raw server-sent events
  (`data:` lines up to `data: [DONE]`; a `data: {"error": ...}` after the headers counts as `stream_error`, a
  stream that ends without `[DONE]` as `stream_cut`: both are server failures hidden behind a 200), then feedback
  for the group named in its first chunk;
- episode: two agent episodes at once, each EPISODE_TURNS n=1 turns on `/v1/chat/completions` with an
  `episode_id` (turn k+1's messages = turn k's + the reply + a user message, so the server continues from the
  sampled ids), then one `feedback` with `episode_ids` for the pair;
- tools: a `tools` list with `tool_choice` "required" and "auto" in turn (n=2, `parallel_tool_calls` false: a
  random model forced to call otherwise calls again and again until max_tokens cuts a call), then a tool-result turn
  (the first choice's `tool_calls` as an assistant message and a `tool` message per call; without a call, a user
  message), each group rated.

A 429 waits out its Retry-After (capped at 2 s), as in load.py. No new request (an episode's next turn
included) starts after the deadline: episodes cut there are left unrated and expire after `episode_ttl_s`, as
groups left without feedback expire after `group_ttl_s`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from .load import RETRY_AFTER_CAP_S, WORDS, EndpointStats, _post

KINDS = {"plain": ("completions", "feedback"), "stream": ("stream", "feedback"), "episode": ("turn", "feedback"),
         "tools": ("call", "result", "feedback")}
DEFAULT_MIX = "plain=2,stream=1,episode=1,tools=1"
STREAM_MAX_TOKENS = 16
EPISODE_TURNS = 3
EPISODE_MAX_TOKENS = 8
TOOL_MAX_TOKENS = 64  # a forced call on the tiny model: 30-50 tokens (the grammar lets it add whitespace)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"]}}}


def split_clients(clients: int, mix: str) -> dict[str, int]:
    """`clients` shared out by the weights of `mix` ("plain=2,stream=1,..."), largest remainders first."""
    weights = {}
    for part in mix.split(","):
        kind, _, weight = part.partition("=")
        if kind.strip() not in KINDS:
            raise ValueError(f"unknown client kind {kind!r}; kinds: {', '.join(KINDS)}")
        weights[kind.strip()] = float(weight or 1)
    total = sum(weights.values())
    exact = {k: clients * w / total for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: out[k] - exact[k])[:clients - sum(out.values())]:
        out[k] += 1
    return out


def _other(stats: EndpointStats, key: str, seconds: float, detail: str) -> None:
    """An answer that is neither a status nor a transport failure (a stream's error after its headers)."""
    stats.by_status[key] = stats.by_status.get(key, 0) + 1
    stats.max_latency_s = max(stats.max_latency_s, seconds)
    if len(stats.error_samples) < 5:
        stats.error_samples.append(f"{key}: {detail[:300]}")


@dataclass
class Round:
    """What the clients share: the session, the addresses, the deadline, and what they record."""

    session: aiohttp.ClientSession
    url: str
    experiment: str
    headers: dict
    timeout: aiohttp.ClientTimeout
    deadline: float
    n: int
    max_tokens: int
    abandon: float
    stats: dict[str, dict[str, EndpointStats]] = field(default_factory=lambda: {
        kind: {endpoint: EndpointStats() for endpoint in endpoints} for kind, endpoints in KINDS.items()})
    first_chunk_s: list[float] = field(default_factory=list)
    left_unrated: dict[str, int] = field(default_factory=lambda: {"plain": 0, "episodes": 0})
    tool_calls: dict[str, dict[str, int]] = field(default_factory=lambda: {
        choice: {"choices": 0, "with_calls": 0} for choice in ("required", "auto")})

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    async def post(self, kind: str, endpoint: str, path: str, body: dict):
        return await _post(self.session, self.stats[kind][endpoint], self.url + path, body, self.headers,
                           self.timeout)

    async def feedback(self, kind: str, body: dict):
        return await self.post(kind, "feedback", f"/v1/experiments/{self.experiment}/feedback", body)

    @staticmethod
    async def answered(status: int | None, body: dict | None, retry_after: float | None,
                       rng: random.Random) -> bool:
        """True for a 2xx with a body; else waits (a 429 its Retry-After, an error 0.2 s) and says False."""
        if status is not None and 200 <= status < 300 and body:
            return True
        await asyncio.sleep(min(retry_after or 1.0, RETRY_AFTER_CAP_S) * (0.5 + rng.random())
                            if status == 429 else 0.2)
        return False


def _prompt(index: int, rng: random.Random, what: str) -> list[dict]:
    words = " ".join(rng.choice(WORDS) for _ in range(3))
    return [{"role": "user", "content": f"Client {index}: {what} {words}."}]


async def plain_client(r: Round, index: int, rng: random.Random) -> None:
    while r.running():
        answer = await r.post("plain", "completions", f"/v1/experiments/{r.experiment}/completions", {
            "messages": _prompt(index, rng, "say something about"), "n": r.n, "max_tokens": r.max_tokens,
            "temperature": 1.0})
        if not await r.answered(*answer, rng):
            continue
        if rng.random() < r.abandon:
            r.left_unrated["plain"] += 1
            continue
        await r.feedback("plain", {"group_id": answer[1]["group_id"],
                                   "rewards": [rng.random() for _ in answer[1]["completions"]]})


async def stream_once(r: Round, body: dict) -> tuple[int | None, dict | None, float | None]:
    """One streamed chat completion, read to its end: (status, {"group_id", "choices"}, Retry-After)."""
    stats, started = r.stats["stream"]["stream"], time.perf_counter()
    try:
        async with r.session.post(r.url + "/v1/chat/completions", json=body, headers=r.headers,
                                  timeout=r.timeout) as response:
            if response.status != 200:
                raw = await response.read()
                stats.record(response.status, time.perf_counter() - started, raw.decode(errors="replace"))
                retry = response.headers.get("Retry-After")
                return response.status, None, float(retry) if retry else None
            group_id, choices, done, error = None, set(), False, None
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue  # the blank line after each event, `: ping` keep-alives
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = data.decode(errors="replace")
                    break
                if group_id is None:
                    r.first_chunk_s.append(time.perf_counter() - started)
                    group_id = chunk.get("group_id")
                choices.update(c["index"] for c in chunk.get("choices") or [])
            seconds = time.perf_counter() - started
            if done and group_id:
                stats.record(200, seconds)
                return 200, {"group_id": group_id, "choices": len(choices)}, None
            _other(stats, "stream_error" if error else "stream_cut", seconds, error or f"no [DONE] ({group_id})")
    except asyncio.TimeoutError:
        stats.record_failure("timeout", time.perf_counter() - started, f"no end within {r.timeout.total} s")
    except aiohttp.ClientError as exc:
        stats.record_failure("connection", time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
    return None, None, None


async def stream_client(r: Round, index: int, rng: random.Random) -> None:
    while r.running():
        answer = await stream_once(r, {"model": r.experiment, "messages": _prompt(index, rng, "write about"), "n": 2,
                                       "max_tokens": STREAM_MAX_TOKENS, "temperature": 1.0, "stream": True,
                                       "stream_options": {"include_usage": True}})
        if await r.answered(*answer, rng):
            await r.feedback("stream", {"group_id": answer[1]["group_id"],
                                        "rewards": [rng.random() for _ in range(answer[1]["choices"])]})


async def one_episode(r: Round, episode_id: str, index: int, rng: random.Random) -> int:
    """EPISODE_TURNS turns of one episode (429s waited out); the turns it got, -1 once complete."""
    messages, turns = _prompt(index, rng, "plan a trip with"), 0
    while turns < EPISODE_TURNS:
        if not r.running():
            return turns
        answer = await r.post("episode", "turn", "/v1/chat/completions", {
            "model": r.experiment, "messages": messages, "n": 1, "max_tokens": EPISODE_MAX_TOKENS,
            "temperature": 1.0, "episode_id": episode_id})
        if not await r.answered(*answer, rng):
            if answer[0] == 429:
                continue
            return turns
        turns += 1
        reply = answer[1]["choices"][0]["message"].get("content") or ""
        messages = [*messages, {"role": "assistant", "content": reply},
                    {"role": "user", "content": f"And then ({turns})?"}]
    return -1


async def episode_client(r: Round, index: int, rng: random.Random) -> None:
    pair = 0
    while r.running():
        ids = [f"load-{index}-{pair}-{k}-{uuid.uuid4().hex[:8]}" for k in range(2)]
        pair += 1
        got = await asyncio.gather(*(one_episode(r, episode_id, index, rng) for episode_id in ids))
        if all(turns == -1 for turns in got):
            await r.feedback("episode", {"episode_ids": ids, "rewards": [rng.random(), rng.random()]})
        else:  # a lone episode cannot be rated: the started ones expire
            r.left_unrated["episodes"] += sum(1 for turns in got if turns != 0)


async def tools_client(r: Round, index: int, rng: random.Random) -> None:
    turn = 0
    while r.running():
        choice = ("required", "auto")[turn % 2]
        turn += 1
        user = _prompt(index, rng, "what is the weather where one finds")
        call = await r.post("tools", "call", "/v1/chat/completions", {
            "model": r.experiment, "messages": user, "tools": [WEATHER], "tool_choice": choice, "n": 2,
            "parallel_tool_calls": False, "max_tokens": TOOL_MAX_TOKENS, "temperature": 1.0})
        if not await r.answered(*call, rng):
            continue
        choices = call[1]["choices"]
        r.tool_calls[choice]["choices"] += len(choices)
        r.tool_calls[choice]["with_calls"] += sum(1 for c in choices if c["message"].get("tool_calls"))
        await r.feedback("tools", {"group_id": call[1]["group_id"],
                                   "rewards": [float(bool(c["message"].get("tool_calls"))) + rng.random()
                                               for c in choices]})
        message = choices[0]["message"]
        if message.get("tool_calls"):
            history = [*user, {"role": "assistant", "content": message.get("content"),
                               "tool_calls": message["tool_calls"]},
                       *({"role": "tool", "tool_call_id": c["id"], "content": "18 C and sunny"}
                         for c in message["tool_calls"])]
        else:
            history = [*user, {"role": "assistant", "content": message.get("content") or ""},
                       {"role": "user", "content": "Use the tool."}]
        while r.running():
            result = await r.post("tools", "result", "/v1/chat/completions", {
                "model": r.experiment, "messages": history, "tools": [WEATHER], "tool_choice": "auto", "n": 2,
                "parallel_tool_calls": False, "max_tokens": TOOL_MAX_TOKENS, "temperature": 1.0})
            if await r.answered(*result, rng):
                await r.feedback("tools", {"group_id": result[1]["group_id"],
                                           "rewards": [rng.random() for _ in result[1]["choices"]]})
            if result[0] != 429:
                break


CLIENTS = {"plain": plain_client, "stream": stream_client, "episode": episode_client, "tools": tools_client}
