"""Experiments: completion tok/s in total and per experiment with 1, 2, 4 (8) experiments sampling at once.

Each level adds experiments (`ensure`) and has every one of them run the same request mix at once; where
the memory or push figure is wanted, each new experiment then trains one step (`train_once`), so the
memory figure's snapshots are taken with k experiments sampled and trained.
"""

from __future__ import annotations

import asyncio
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


async def curve(client: AsyncClient, ensure: Callable[[int], Awaitable[list[str]]], chats: list[list[dict]], mode,
                train: bool, after_training: Callable[[int], None] | None = None) -> tuple[list[dict], dict, dict]:
    """Every level of `mode.levels`: that many experiments (made by `ensure`) sample at once; with `train`,
    each new one then trains one step and `after_training(level)` runs. Returns the levels' rows, each
    trained experiment's step and each experiment's last group."""
    levels: list[dict] = []
    trained: dict[str, dict] = {}
    last_groups: dict[str, Any] = {}
    for level in mode.levels:
        names = await ensure(level)
        others = await asyncio.to_thread(other_processes)
        load0 = loadavg()
        row, groups = await sample_concurrently(client, names, mode.exp_requests, mode.exp_concurrency,
                                                mode.exp_n, mode.exp_max_tokens, chats)
        row["load"] = [load0, loadavg()]
        row["others_at_start"] = others
        levels.append(row)
        last_groups.update(groups)
        print(f"[bench] experiments {level}: {row['total_tok_s']} tok/s in total", flush=True)
        if train:  # one step + push for each new experiment, at once
            new = [name for name in names if name not in trained]
            steps = await asyncio.gather(*(train_once(client, name, groups[name]) for name in new))
            trained.update(zip(new, steps))
            if after_training is not None:
                after_training(level)
    return levels, trained, last_groups


def experiments_figure(levels: list[dict], creation_s: list[float], mode) -> dict:
    return {"levels": levels, "requests_per_experiment": mode.exp_requests,
            "concurrency_per_experiment": mode.exp_concurrency, "n": mode.exp_n,
            "max_tokens": mode.exp_max_tokens, "max_loras": SamplerSettings().max_loras,
            "create_experiment_s": creation_s,
            "load": [levels[0]["load"][0], levels[-1]["load"][1]] if levels else None}
