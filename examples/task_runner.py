"""The client side of a task, shared by the examples: make prompts, get completions, score them, post
rewards, with several episodes in flight, a progress bar of the running reward, and a reward curve.

A single-turn task is two functions: `make_prompt(rng) -> (messages, state)` and
`score(text, state) -> float` (`run_task`). A multi-step task is an `Episode`: an async function that
talks to the server (completions and feedback for each of its steps) and returns one row per step it
rated (`run_episodes`).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import yaml
from tqdm import tqdm

from grpo_server.client import AsyncClient, GrpoServerError

MakePrompt = Callable[[random.Random], tuple[list[dict], Any]]
Score = Callable[[str, Any], float]
StepRow = dict  # {"turn": int, "policy_version": int, "reward": mean reward of the step's group}
Episode = Callable[[AsyncClient, str, random.Random], Awaitable[list[StepRow]]]
T = TypeVar("T")


def default_api_key(run_dir: str | Path = "runs/demo") -> str | None:
    """GRPO_SERVER_API_KEY, else the admin key a server generated into `<run_dir>/admin_key`, else None."""
    key = os.environ.get("GRPO_SERVER_API_KEY")
    if key:
        return key
    path = Path(run_dir) / "admin_key"
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def parse_args(description: str, default_config: str | dict) -> argparse.Namespace:
    """The task's command line. `default_config`: the experiment's YAML file, or the config itself (a dict,
    kept as `args.default_config`; `--config FILE` replaces it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=os.environ.get("GRPO_SERVER_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=default_api_key(),
                        help="admin key (env GRPO_SERVER_API_KEY, else runs/demo/admin_key)")
    in_code = isinstance(default_config, dict)
    parser.add_argument("--config", default=None if in_code else default_config, help="experiment YAML")
    parser.add_argument("--steps", type=int, default=30, help="stop after this many policy versions")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="groups in flight at once (default: the server's suggested_groups_in_flight, followed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="reward curve CSV (default: runs/<experiment>-reward.csv); "
                        "its summary goes beside it as .json")
    args = parser.parse_args()
    args.default_config = default_config if in_code else None
    if not args.api_key:
        parser.error("give --api-key or set GRPO_SERVER_API_KEY")
    return args


def experiment_config(args: argparse.Namespace) -> dict:
    """The experiment's config: `--config`'s YAML, else the task's own (`parse_args`' dict)."""
    return yaml.safe_load(Path(args.config).read_text()) if args.config else dict(args.default_config)


async def ensure_experiment(client: AsyncClient, config: dict) -> None:
    try:
        await client.create_experiment(config)
    except GrpoServerError as exc:
        if exc.status != 409:
            raise  # 409: it exists already (a re-run continues it)


class GroupsInFlight:
    """How many groups a task keeps in flight: `fixed`, else (None) the server's `suggested_groups_in_flight` for the
    experiment, re-read every POLL_S seconds: one batch while it samples alone, more while other experiments
    sample too (grpo_server/runtime/status.py says why). Worker `i` of `workers` samples while `i` is below the
    limit. Used as `async with`, which follows the server in the background."""

    POLL_S = 5.0
    MAX_FOLLOWED = 16  # workers started when following the server
    WITHOUT_SUGGESTION = 4  # a server older than suggested_groups_in_flight: this runner's fixed default before it

    def __init__(self, client: AsyncClient, name: str, fixed: int | None = None):
        self.client, self.name, self.fixed = client, name, fixed
        self.limit = fixed or 1
        self.workers = fixed or self.MAX_FOLLOWED
        self._follower: asyncio.Task | None = None

    async def __aenter__(self) -> "GroupsInFlight":
        if self.fixed is None:
            self._follower = asyncio.create_task(self._follow(), name=f"follow-{self.name}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)

    async def _follow(self) -> None:
        while True:
            status = await retrying(lambda: self.client.status(self.name))
            suggested = status.suggested_groups_in_flight or self.WITHOUT_SUGGESTION
            self.limit = max(1, min(suggested, self.MAX_FOLLOWED))
            await asyncio.sleep(self.POLL_S)

    async def turn(self, index: int, stop: Callable[[], bool]) -> bool:
        """Wait until worker `index` may sample (True) or `stop()` (False); raise what ended following the server."""
        while True:
            if self._follower is not None and self._follower.done():
                self._follower.result()
            if stop():
                return False
            if index < self.limit:
                return True
            await asyncio.sleep(0.5)


async def retrying(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, waited out while the server pushes back (429) or a worker restarts (503)."""
    while True:
        try:
            return await call()
        except GrpoServerError as exc:
            if exc.status not in (429, 503):
                raise
            await asyncio.sleep(exc.retry_after or 2.0)


def single_turn(make_prompt: MakePrompt, score: Score) -> Episode:
    async def episode(client: AsyncClient, name: str, rng: random.Random) -> list[StepRow]:
        messages, state = make_prompt(rng)
        group = await retrying(lambda: client.complete(name, messages=messages))
        rewards = [score(c.text, state) for c in group.completions]
        await retrying(lambda: client.feedback(name, group.group_id, rewards))
        return [{"turn": 1, "policy_version": group.policy_version, "reward": statistics.fmean(rewards)}]
    return episode


async def run_task(args: argparse.Namespace, make_prompt: MakePrompt, score: Score) -> dict:
    return await run_episodes(args, single_turn(make_prompt, score))


async def run_episodes(args: argparse.Namespace, episode: Episode) -> dict:
    config = experiment_config(args)
    name = config["name"]
    out = Path(args.out or f"runs/{name}-reward.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    rows: list[dict] = []  # one per rated group: time, turn, policy version, mean reward
    started = time.monotonic()

    async with AsyncClient(args.url, args.api_key) as client:
        await ensure_experiment(client, config)
        start_version = (await client.status(name)).policy_version
        goal = start_version + args.steps
        bar = tqdm(total=args.steps, desc=name, unit="version")
        done = asyncio.Event()

        async def worker(index: int) -> None:
            while await in_flight.turn(index, done.is_set):
                steps = await episode(client, name, rng)
                rows.extend({"seconds": round(time.monotonic() - started, 2), **step} for step in steps)
                recent = [r["reward"] for r in rows[-32:]]
                version = max(step["policy_version"] for step in steps)
                bar.n = min(version - start_version, args.steps)
                bar.set_postfix(reward=f"{statistics.fmean(recent):.3f}", groups=len(rows))
                if version >= goal:
                    done.set()

        async with GroupsInFlight(client, name, args.concurrency) as in_flight:
            await asyncio.gather(*(worker(i) for i in range(in_flight.workers)))
        bar.close()
        status = await client.status(name)

    with open(out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["seconds", "turn", "policy_version", "reward"])
        writer.writeheader()
        writer.writerows(rows)
    summary = {"experiment": name, "groups": len(rows), "policy_version": status.policy_version,
               "wall_s": round(time.monotonic() - started, 1), "curve": str(out)}
    for turn in sorted({r["turn"] for r in rows}):
        rewards = [r["reward"] for r in rows if r["turn"] == turn]
        window = max(1, min(32, len(rewards) // 4))
        first, last = statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
        summary.update({f"reward_first_turn{turn}": first, f"reward_last_turn{turn}": last})
        if turn == 1:
            summary.update(reward_first=first, reward_last=last)
        print(f"\n{name} turn {turn}: reward {first:.3f} (first {window} groups) -> {last:.3f} (last {window})")
    print(f"{name}: {summary['policy_version']} versions, {len(rows)} groups, {summary['wall_s']} s; "
          f"reward curve: {out}")
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))  # scripts/demo_summary.py reads it
    return summary
