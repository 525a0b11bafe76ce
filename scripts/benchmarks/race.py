"""The race both sides of the end-to-end figure share (end_to_end.py, trl_side.py): rows of scored groups,
the running mean of the last `window` groups, the time it first reached each level, and the summary of
several runs a side (median and spread of the time to each level, and how many runs reached it).

One run a side is not enough on this task: two identical server runs can diverge (one finds the exact
output format early, the other does not), so a side's figure is the median over its runs.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from typing import Callable

from .host import loadavg


async def drive(client, name: str, race: Race, seed: int, concurrency: int | None,
                on_group: Callable[[], None]) -> None:
    """The server side of a race (end_to_end.py's, and each experiment of fleet.py's): alphabetize episodes on
    experiment `name` (examples/task_runner.py's single turn: completions, score, feedback, waiting out 429/503),
    `concurrency` at once (None: as many as the server suggests, as examples/task_runner.py does by default),
    prompts drawn from `random.Random(seed)`, until `race` is done; `on_group` after each group added. A worker's
    error ends the race with it."""
    from examples.alphabetize import make_prompt, score
    from examples.task_runner import GroupsInFlight, single_turn

    episode = single_turn(make_prompt, score)
    rng = random.Random(seed)

    async def worker(index: int) -> None:
        while await in_flight.turn(index, lambda: race.done):
            for row in await episode(client, name, rng):
                if not race.done:
                    race.add(row["reward"], row["policy_version"])
                    on_group()

    async with GroupsInFlight(client, name, concurrency) as in_flight:
        await _until_done(race, [asyncio.create_task(worker(i)) for i in range(in_flight.workers)])


async def _until_done(race: Race, tasks: list[asyncio.Task]) -> None:
    try:
        while not race.done:  # the time limit holds even while every worker waits on the server
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            await asyncio.sleep(0.5)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Race:
    """Rows of (seconds, step, group mean reward); reached when the mean of the last `window` groups is
    >= `target`; done when reached or `time_limit_s` has passed since `start()`."""

    def __init__(self, target: float, window: int, time_limit_s: float):
        self.target, self.window, self.time_limit_s = target, window, time_limit_s
        self.started: float | None = None
        self.rows: list[list[float]] = []
        self.reached: dict | None = None
        self.load_samples: list[list[float]] = []  # [seconds, 1-minute load average], about every 30 s

    def start(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started

    @property
    def timed_out(self) -> bool:
        return self.elapsed() >= self.time_limit_s

    @property
    def done(self) -> bool:
        return self.reached is not None or self.timed_out

    def add(self, reward: float, step: int) -> bool:
        """One scored group; returns `done`."""
        seconds = self.elapsed()
        self.rows.append([round(seconds, 2), int(step), round(float(reward), 4)])
        if not self.load_samples or seconds - self.load_samples[-1][0] >= 30:
            self.load_samples.append([round(seconds), loadavg()])
        if self.reached is None and len(self.rows) >= self.window:
            running = statistics.fmean(r[2] for r in self.rows[-self.window:])
            if running >= self.target:
                self.reached = {"seconds": round(seconds, 1), "groups": len(self.rows), "step": int(step),
                                "running_mean": round(running, 4)}
        return self.done

    def summary(self) -> dict:
        running = running_means(self.rows, self.window)
        best = max(running, key=lambda p: p[1], default=None)
        rewards = [r[2] for r in self.rows]
        return {
            "reached": self.reached is not None,
            "reached_s": self.reached["seconds"] if self.reached else None,
            "reached_groups": self.reached["groups"] if self.reached else None,
            "reached_step": self.reached["step"] if self.reached else None,
            "timed_out": self.reached is None,
            "wall_s": round(self.elapsed(), 1),
            "groups": len(self.rows),
            "last_step": self.rows[-1][1] if self.rows else None,
            "first_window_mean": round(statistics.fmean(rewards[:self.window]), 4) if rewards else None,
            "last_window_mean": round(statistics.fmean(rewards[-self.window:]), 4) if rewards else None,
            "best_running_mean": round(best[1], 4) if best else None,
            "best_running_mean_s": best[0] if best else None,
            "milestones": milestones(self.rows, self.window, self.target),
            "load_samples": self.load_samples,
            "curve": self.rows,  # [seconds, step, group mean reward], one per group in scoring order
        }


def running_means(rows: list[list[float]], window: int) -> list[tuple[float, float]]:
    """(seconds, mean of the last `window` groups) at each group from the `window`-th on."""
    return [(rows[i][0], statistics.fmean(r[2] for r in rows[i + 1 - window:i + 1]))
            for i in range(window - 1, len(rows))]


def first_time_at(rows: list[list[float]], window: int, level: float) -> float | None:
    """Seconds at which the running mean first reached `level` (None if never)."""
    return next((round(s, 1) for s, m in running_means(rows, window) if m >= level - 1e-12), None)


def milestones(rows: list[list[float]], window: int, target: float) -> dict[str, float | None]:
    """Reward-vs-time in brief: when the running mean first reached each 0.05 step up to the target."""
    levels = [round(0.05 * k, 2) for k in range(1, 21) if 0.05 * k <= target + 1e-9]
    if target not in levels:
        levels.append(target)
    return {f"{level:.2f}": first_time_at(rows, window, level) for level in levels}


def compare(server: dict, trl: dict, window: int) -> dict:
    """The speed-up (TRL seconds / server seconds to the target), and, for a side that missed, the same ratio
    at the highest running mean both sides reached."""
    out: dict = {"speedup": None}
    if server.get("reached") and trl.get("reached"):
        out["speedup"] = round(trl["reached_s"] / server["reached_s"], 3)
    # From the curves, not the rounded best_running_mean: a level a hair above a side's own best is never reached.
    bests = [max((m for _, m in running_means(side.get("curve") or [], window)), default=None)
             for side in (server, trl)]
    if None not in bests:
        common = min(bests)
        s_at, t_at = first_time_at(server["curve"], window, common), first_time_at(trl["curve"], window, common)
        out.update(common_level=round(common, 4), server_s_at_common=s_at, trl_s_at_common=t_at,
                   ratio_at_common=round(t_at / s_at, 3) if s_at and t_at else None)
    return out


def over_runs(runs: list[dict], side: str, level: float, window: int) -> dict:
    """One side over several runs: when each run's running mean first reached `level` (None: never, within
    its limit), how many got there, and the median, min and max. A run that never got there counts as
    slower than every run that did, so the median is None when most runs missed."""
    times = [first_time_at(run[side].get("curve") or [], window, level) for run in runs if side in run]
    reached = sorted(t for t in times if t is not None)
    ordered = reached + [math.inf] * (len(times) - len(reached))
    median = statistics.median(ordered) if ordered else math.inf
    return {"level": level, "runs": len(times), "reached": len(reached), "seconds": times,
            "median_s": None if math.isinf(median) else round(median, 1),
            "min_s": reached[0] if reached else None, "max_s": reached[-1] if reached else None}


def summarize_runs(runs: list[dict], window: int, levels: tuple[float, ...]) -> dict:
    """Per level: each side's over_runs, and the ratio of the medians (TRL / server) when both have one."""
    out = {}
    for level in levels:
        server, trl = over_runs(runs, "server", level, window), over_runs(runs, "trl", level, window)
        ratio = (round(trl["median_s"] / server["median_s"], 3)
                 if server["median_s"] and trl["median_s"] else None)
        out[f"{level:.2f}"] = {"server": server, "trl": trl, "median_speedup": ratio}
    return out
