"""`grpo-server plot RUN_DIR`: one PNG per experiment, `RUN_DIR/plots/<name>.png`, from its metrics log
(`RUN_DIR/metrics/<name>.jsonl`, see `grpo_server/runtime/metrics_log.py`), with three panels: mean reward per
learner step (with its spread across the batch), KL per step, and sampling throughput (completion tokens per
second) over the run's wall-clock time. The KL panel shows the KL to the base model (or says it is off: beta 0
runs no reference forward), the sampler/learner mismatch over the current version's tokens and the off-policy KL
of older versions' tokens, on a log scale, with each push as a vertical line coloured by its check (verified,
failed, not checked or inconclusive). With `--describe`, each PNG's path is
followed by its reward curve in one line of text (`describe`), for a terminal or a log with no image viewer.

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
    mismatch_kl_fresh: list[float] = field(default_factory=list)  # numerics alone: the current version's tokens
    offpolicy_kl_stale: list[float] = field(default_factory=list)  # policy change: older versions' tokens
    sampling_minutes: list[float] = field(default_factory=list)  # since the log's first record
    tokens_per_s: list[float] = field(default_factory=list)  # per sampling record
    push_steps: list[int] = field(default_factory=list)
    push_verified: list[bool | None] = field(default_factory=list)  # per push: its check (None: none, inconclusive)


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
            series.mismatch_kl_fresh.append(_number(record.get("mismatch_kl_fresh")))
            series.offpolicy_kl_stale.append(_number(record.get("offpolicy_kl_stale")))
        elif kind == "sampling" and isinstance(record.get("time"), (int, float)):
            series.sampling_minutes.append((record["time"] - start) / 60)
            series.tokens_per_s.append(_number(record.get("tokens_per_s")))
        elif kind == "push" and isinstance(record.get("step"), int):
            series.push_steps.append(record["step"])
            verified = record.get("verified")
            series.push_verified.append(verified if isinstance(verified, bool) else None)
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
    _kl_panel(kl, series)
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
        kl.legend(loc="best", fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


PUSH_COLOURS = {True: "tab:green", False: "tab:red", None: "tab:gray"}


def _kl_panel(axes: Any, series: Series) -> None:
    """The KLs that say whether training is healthy. At beta 0 there is no KL to the base model (no reference
    forward), so the panel says so instead of drawing an empty line; the mismatch is what a bf16 sampler or a
    silent push failure would move, so it is drawn either way, with each push's check."""
    lines = (("KL to the base model", series.kl, "tab:red"),
             ("mismatch KL (current version's tokens)", series.mismatch_kl_fresh, "tab:purple"),
             ("off-policy KL (older versions' tokens)", series.offpolicy_kl_stale, "tab:orange"))
    positive = [v for _, values, _ in lines for v in values if v > 0]  # NaN > 0 is False
    for label, values, colour in lines:
        points = [(step, v) for step, v in zip(series.step, values) if not math.isnan(v)]
        if points:  # joined across the steps without one (a step of fresh tokens alone has no off-policy KL)
            axes.plot(*zip(*points), marker=".", color=colour, label=label)
    if positive:
        axes.set_yscale("log")  # the mismatch (~1e-9 in float32) and the KL to the base (~1e-2) differ by decades
    for verified in (True, False, None):
        steps = [s for s, v in zip(series.push_steps, series.push_verified) if v is verified]
        label = {True: "push verified", False: "push check failed", None: "push not checked / inconclusive"}[verified]
        for i, step in enumerate(steps):
            axes.axvline(step, color=PUSH_COLOURS[verified], alpha=0.35, linewidth=1, label=None if i else label)
    kl_off = bool(series.step) and all(math.isnan(v) for v in series.kl)
    axes.set(xlabel="learner step", ylabel="KL (nats)",
             title="KL" + (" (KL to the base model: off, beta 0)" if kl_off else ""))


SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40  # characters; longer runs average neighbouring steps into one


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """`values` (NaN: skipped) as block characters from the lowest to the highest; more than `width` values are
    averaged in `width` consecutive buckets, so the line keeps the curve's shape at any length."""
    values = [v for v in values if not math.isnan(v)]
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in values)


def describe(series: Series) -> str:
    """The reward curve in one line: first and last steps' mean reward, and the curve between its low and high."""
    rewards = [r for r in series.reward_mean if not math.isnan(r)]
    if not rewards:
        return f"{series.name}: no train steps yet"
    edge = max(1, min(3, len(rewards) // 4))  # a few steps on each end: one batch's mean is noisy
    first, last = sum(rewards[:edge]) / edge, sum(rewards[-edge:]) / edge
    return (f"{series.name}: {len(series.step)} steps, mean reward {first:.2f} (first {edge}) -> {last:.2f} "
            f"(last {edge}); per step {min(rewards):.2f} {sparkline(rewards)} {max(rewards):.2f}")


def metrics_logs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "metrics").glob("*.jsonl"))


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[tuple[Path, Series]]:
    """A PNG per metrics log of `run_dir` (into `out_dir`, default `run_dir/plots`); the paths written, each
    with the series it shows."""
    logs = metrics_logs(run_dir)
    if not logs:
        raise NoMetrics(f"no metrics logs in {run_dir / 'metrics'} (*.jsonl): give the run directory of a "
                        "server (its run_dir) where an experiment has run")
    out_dir = run_dir / "plots" if out_dir is None else out_dir
    drawn = []
    for log in logs:
        series = load_series(log)
        drawn.append((plot_series(series, out_dir / f"{log.stem}.png"), series))
    return drawn
