"""The client side of a task, shared by the examples: make prompts, get completions, score them, post
rewards, with several groups in flight, a progress bar of the running reward, and a reward curve.

A task is two functions: `make_prompt(rng) -> (messages, state)` and `score(text, state) -> float`.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import yaml
from tqdm import tqdm

from grpo_server.client import AsyncClient, GrpoServerError

MakePrompt = Callable[[random.Random], tuple[list[dict], Any]]
Score = Callable[[str, Any], float]


def parse_args(description: str, default_config: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=os.environ.get("GRPO_SERVER_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("GRPO_SERVER_API_KEY"),
                        help="admin key (env GRPO_SERVER_API_KEY)")
    parser.add_argument("--config", default=default_config, help="experiment YAML")
    parser.add_argument("--steps", type=int, default=30, help="stop after this many policy versions")
    parser.add_argument("--concurrency", type=int, default=4, help="groups in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="reward curve CSV (default: runs/<experiment>-reward.csv)")
    args = parser.parse_args()
    if not args.api_key:
        parser.error("give --api-key or set GRPO_SERVER_API_KEY")
    return args


async def ensure_experiment(client: AsyncClient, config: dict) -> None:
    try:
        await client.create_experiment(config)
    except GrpoServerError as exc:
        if exc.status != 409:
            raise  # 409: it exists already (a re-run continues it)


async def run_task(args: argparse.Namespace, make_prompt: MakePrompt, score: Score) -> dict:
    config = yaml.safe_load(Path(args.config).read_text())
    name = config["name"]
    out = Path(args.out or f"runs/{name}-reward.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    rows: list[dict] = []  # one per group: time, policy version, mean reward
    started = time.monotonic()

    async with AsyncClient(args.url, args.api_key) as client:
        await ensure_experiment(client, config)
        start_version = (await client.status(name)).policy_version
        goal = start_version + args.steps
        bar = tqdm(total=args.steps, desc=name, unit="version")
        done = asyncio.Event()

        async def worker() -> None:
            while not done.is_set():
                messages, state = make_prompt(rng)
                try:
                    group = await client.complete(name, messages=messages)
                    rewards = [score(c.text, state) for c in group.completions]
                    await client.feedback(name, group.group_id, rewards)
                except GrpoServerError as exc:
                    if exc.status in (429, 503):  # back-pressure or a worker restarting: retry
                        await asyncio.sleep(exc.retry_after or 2.0)
                        continue
                    raise
                rows.append({"seconds": round(time.monotonic() - started, 2),
                             "policy_version": group.policy_version, "reward": statistics.fmean(rewards)})
                recent = [r["reward"] for r in rows[-32:]]
                bar.n = min(group.policy_version - start_version, args.steps)
                bar.set_postfix(reward=f"{statistics.fmean(recent):.3f}", groups=len(rows))
                if group.policy_version >= goal:
                    done.set()

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        bar.close()
        status = await client.status(name)

    with open(out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["seconds", "policy_version", "reward"])
        writer.writeheader()
        writer.writerows(rows)
    window = max(1, min(32, len(rows) // 4))
    summary = {
        "experiment": name,
        "groups": len(rows),
        "policy_version": status.policy_version,
        "reward_first": statistics.fmean(r["reward"] for r in rows[:window]),
        "reward_last": statistics.fmean(r["reward"] for r in rows[-window:]),
        "wall_s": round(time.monotonic() - started, 1),
        "curve": str(out),
    }
    print(f"\n{name}: reward {summary['reward_first']:.3f} (first {window} groups) -> "
          f"{summary['reward_last']:.3f} (last {window}) over {summary['policy_version']} versions, "
          f"{len(rows)} groups, {summary['wall_s']} s; reward curve: {out}")
    return summary
