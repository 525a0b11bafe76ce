"""`grpo-server plot RUN_DIR`: one PNG per experiment, `RUN_DIR/plots/<name>.png`, from its metrics log
(`RUN_DIR/metrics/<name>.jsonl`, see `grpo_server/runtime/metrics_log.py`), with three panels: mean reward per
learner step (with its spread across the batch), KL to the base model per step, and sampling throughput
(completion tokens per second) over the run's wall-clock time.

matplotlib draws on its Agg canvas: no display, no GUI toolkit. It is imported inside the functions, so
the CLI starts without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class NoMetrics(Exception):
    """The run directory holds no metrics log."""


def _number(value: Any) -> float:
    """A plottable float: null (a non-finite value in the log) or a missing field is a gap (NaN)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


@dataclass
class Series:
    """What one experiment's plot shows, read from its metrics log."""

    name: str
    step: list[int] = field(default_factory=list)  # per train record, as the four below
    reward_mean: list[float] = field(default_factory=list)
    reward_std: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    sampling_minutes: list[float] = field(default_factory=list)  # since the log's first record
    tokens_per_s: list[float] = field(default_factory=list)  # per sampling record
    push_steps: list[int] = field(default_factory=list)


def load_series(path: Path) -> Series:
    """The series of one metrics log; lines that are not JSON objects (a line a crash cut short) are skipped."""
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    series = Series(name=path.stem)
    start = min((r["time"] for r in records if isinstance(r.get("time"), (int, float))), default=0.0)
    for record in records:
        kind = record.get("kind")
        if kind == "train" and isinstance(record.get("step"), int):
            series.step.append(record["step"])
            series.reward_mean.append(_number(record.get("reward_mean")))
            series.reward_std.append(_number(record.get("reward_std")))
            series.kl.append(_number(record.get("kl")))
        elif kind == "sampling" and isinstance(record.get("time"), (int, float)):
            series.sampling_minutes.append((record["time"] - start) / 60)
            series.tokens_per_s.append(_number(record.get("tokens_per_s")))
        elif kind == "push" and isinstance(record.get("step"), int):
            series.push_steps.append(record["step"])
    return series


def plot_series(series: Series, out: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 9), layout="constrained")
    FigureCanvasAgg(figure)
    reward, kl, throughput = figure.subplots(3, 1)
    figure.suptitle(f"{series.name}: {len(series.step)} steps, {len(series.push_steps)} pushes")

    reward.plot(series.step, series.reward_mean, marker=".", label="mean reward")
    low = [m - s for m, s in zip(series.reward_mean, series.reward_std)]
    high = [m + s for m, s in zip(series.reward_mean, series.reward_std)]
    reward.fill_between(series.step, low, high, alpha=0.2, label="± std within the batch")
    reward.set(xlabel="learner step", ylabel="reward", title="Reward")
    kl.plot(series.step, series.kl, marker=".", color="tab:red")
    kl.set(xlabel="learner step", ylabel="KL", title="KL to the base model")
    throughput.plot(series.sampling_minutes, series.tokens_per_s, marker=".", color="tab:green")
    throughput.set(xlabel="minutes since the log began", ylabel="completion tokens / s",
                   title="Sampling throughput")
    for axes, points in ((reward, series.step), (kl, series.step), (throughput, series.sampling_minutes)):
        if not points:
            axes.text(0.5, 0.5, "no data yet", transform=axes.transAxes, ha="center", va="center")
        axes.grid(alpha=0.3)
    for axes in (reward, kl):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    if series.step:
        reward.legend(loc="best")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def metrics_logs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "metrics").glob("*.jsonl"))


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """A PNG per metrics log of `run_dir` (into `out_dir`, default `run_dir/plots`); the paths written."""
    logs = metrics_logs(run_dir)
    if not logs:
        raise NoMetrics(f"no metrics logs in {run_dir / 'metrics'} (*.jsonl): give the run directory of a "
                        "server (its run_dir) where an experiment has run")
    out_dir = run_dir / "plots" if out_dir is None else out_dir
    return [plot_series(load_series(log), out_dir / f"{log.stem}.png") for log in logs]
