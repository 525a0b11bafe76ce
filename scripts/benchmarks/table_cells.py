"""The cells every table of BENCHMARKS.md is written with (scripts/benchmarks/table.py, table_tenants.py): a number,
a verdict against a target, a warning for noisy rounds, a failed figure, and a run's command line."""

from __future__ import annotations

from typing import Any


def _f(value: Any, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    if higher_is_better:
        return "met" if value >= target else f"**missed**: {value:.2f} is {value / target:.0%} of {target}"
    return "met" if value <= target else f"**missed**: {value:.2f} s is {value / target:.1f}x the {target:g} s"


def _spread(ratios: list[float], limit: float = 1.2) -> str:
    """A warning when the rounds (or steps) of one figure differ by more than `limit`: the load moved."""
    if len(ratios) > 1 and min(ratios) > 0 and max(ratios) / min(ratios) > limit:
        return f" (its rounds differ by {max(ratios) / min(ratios):.2f}x: noisy, rerun)"
    return ""


def _error(fig: dict | None) -> str | None:
    if not fig:
        return "not run"
    return f"failed: {fig['error']}" if "error" in fig else None


def _run_line(meta: dict) -> list[str]:
    return [
        f"Command ({meta['date']}, {meta['host']}): `{meta['command']}`, {meta['runtime_s']:.0f} s. "
        f"{meta['cpus']} CPUs, {meta['mem_gib']:.0f} GiB; model {meta['model']} (samplers in "
        f"{meta.get('dtype', 'float32')}, the default on this CPU), "
        f"{meta['versions']}. Load average (1 min) at the start / end of each figure: {meta['load_note']}. "
        f"Other processes busy when a figure started (not this benchmark; most busy share of a core): "
        f"{meta['others'] or 'none seen'}. "
        "Each figure is a ratio of two things measured side by side in this one run; absolute tok/s move "
        "with the box's load. Results: `" + meta["out"] + "`."]
