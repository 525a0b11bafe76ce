"""Experiments: completion tok/s in total and per experiment with 1, 2, 4 (8) experiments sampling at once.

Each level adds experiments (`ensure`), warms each new one with one small completion, and has every one of
them run the same request mix at once; where the memory or push figure is wanted, each new experiment then
trains one step (`train_once`), so the memory figure's snapshots are taken with k experiments sampled and
trained. Each level also gives each experiment's p95 completion latency, and its total tok/s and worst p95
as ratios to the one-experiment level's (issue 15: with 4 experiments, >= 0.8x and <= 3x).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any, Awaitable, Callable

from grpo_server.client import AsyncClient
from grpo_server.config import SamplerSettings

from .host import loadavg, other_processes


async def sample_concurrently(client: AsyncClient, names: list[str], requests_per_experiment: int,
                              concurrency_per_experiment: int, n: int, max_tokens: int,
                              chats: list[list[dict]]) -> tuple[dict, dict[str, Any]]:
    """Every experiment in `names` runs `requests_per_experiment` completions, `concurrency_per_experiment`
    at a time, all experiments at once. Returns per-experiment and total completion tokens/s (tokens
    over the wall time of the whole level), each experiment's p95 completion latency (a request's
    seconds from its call to its answer, nearest rank) and each experiment's last group."""
    tokens = {name: 0 for name in names}
    latencies: dict[str, list[float]] = {name: [] for name in names}
    last_group: dict[str, Any] = {}

    async def one_experiment(index: int, name: str) -> None:
        semaphore = asyncio.Semaphore(concurrency_per_experiment)

        async def one(i: int) -> None:
            async with semaphore:
                called = time.perf_counter()
                group = await client.complete(name, messages=chats[(index + i) % len(chats)], n=n,
                                              max_tokens=max_tokens, temperature=1.0, seed=i)
                latencies[name].append(time.perf_counter() - called)
                tokens[name] += sum(len(c.token_ids) for c in group.completions)
                last_group[name] = group

        await asyncio.gather(*(one(i) for i in range(requests_per_experiment)))

    started = time.perf_counter()
    await asyncio.gather(*(one_experiment(i, name) for i, name in enumerate(names)))
    seconds = time.perf_counter() - started
    per = {name: round(t / seconds, 2) for name, t in tokens.items()}
    return ({"experiments": len(names), "seconds": round(seconds, 2), "tokens": sum(tokens.values()),
             "total_tok_s": round(sum(tokens.values()) / seconds, 2), "per_experiment_tok_s": per,
             "mean_per_experiment_tok_s": round(statistics.mean(per.values()), 2),
             "p95_latency_s": {name: round(_p95(xs), 3) for name, xs in latencies.items()}}, last_group)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def against_one(levels: list[dict]) -> None:
    """Each level's total tok/s and worst per-experiment p95 latency as ratios to the one-experiment level's
    (issue 15's targets, with 4 experiments: at least 0.8x the tok/s, at most 3x the p95)."""
    one = next((row for row in levels if row["experiments"] == 1), None)
    if one is None:
        return
    one_p95 = max(one["p95_latency_s"].values())
    for row in levels:
        row["total_tok_s_vs_one"] = round(row["total_tok_s"] / one["total_tok_s"], 3) if one["total_tok_s"] else None
        row["worst_p95_vs_one"] = round(max(row["p95_latency_s"].values()) / one_p95, 3) if one_p95 else None


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


async def curve(client: AsyncClient, ensure: Callable[[int], Awaitable[list[str]]], chats: list[list[dict]], mode,
                train: bool, after_training: Callable[[int], None] | None = None) -> tuple[list[dict], dict, dict]:
    """Every level of `mode.levels`: that many experiments (made by `ensure`) sample at once; with `train`,
    each new one then trains one step and `after_training(level)` runs. Returns the levels' rows, each
    trained experiment's step and each experiment's last group."""
    levels: list[dict] = []
    trained: dict[str, dict] = {}
    last_groups: dict[str, Any] = {}
    warm: set[str] = set()
    for level in mode.levels:
        names = await ensure(level)
        # One small untimed completion per new experiment first: an experiment's first completion pays
        # one-off costs (the sampler's first merge reads the base weights once), which would inflate the
        # one-experiment level that the others are compared with.
        await asyncio.gather(*(client.complete(name, messages=chats[0], n=1, max_tokens=4, temperature=1.0)
                               for name in names if name not in warm))
        warm.update(names)
        others = await asyncio.to_thread(other_processes)
        load0 = loadavg()
        row, groups = await sample_concurrently(client, names, mode.exp_requests, mode.exp_concurrency,
                                                mode.exp_n, mode.exp_max_tokens, chats)
        row["load"] = [load0, loadavg()]
        row["others_at_start"] = others
        levels.append(row)
        against_one(levels)
        last_groups.update(groups)
        print(f"[bench] experiments {level}: {row['total_tok_s']} tok/s in total "
              f"({row.get('total_tok_s_vs_one')}x one), worst p95 {max(row['p95_latency_s'].values())} s "
              f"({row.get('worst_p95_vs_one')}x one)", flush=True)
        if train:  # one step + push for each new experiment, at once
            new = [name for name in names if name not in trained]
            steps = await asyncio.gather(*(train_once(client, name, groups[name]) for name in new))
            trained.update(zip(new, steps))
            if after_training is not None:
                after_training(level)
    return levels, trained, last_groups


def experiments_figure(levels: list[dict], creation_s: list[float], mode, sampler: dict) -> dict:
    """`sampler`: the server's sampler settings (defaults for the rest)."""
    settings = SamplerSettings(**sampler)
    return {"levels": levels, "requests_per_experiment": mode.exp_requests,
            "concurrency_per_experiment": mode.exp_concurrency, "n": mode.exp_n,
            "max_tokens": mode.exp_max_tokens, "max_loras": settings.max_loras,
            "several_experiments": settings.several_experiments, "cpu_lora_ops": settings.cpu_lora_ops,
            "create_experiment_s": creation_s,
            "load": [levels[0]["load"][0], levels[-1]["load"][1]] if levels else None}
