"""scripts/demo's closing summary: one line per experiment the demo trained (its TASKS), read from the server.

The experiments are the ones the task runs name in their summaries (`RUN_DIR/<task>-reward.json`, written by
examples/task_runner.py), not every experiment of the server: a run directory used before holds others, resumed
at start. A figure the server does not have yet (a restored experiment's reward before any step, a check that
never ran) prints as "n/a".

    python -m scripts.demo_summary RUN_DIR TASK...     # GRPO_SERVER_URL and GRPO_SERVER_API_KEY from the environment
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from grpo_server.api_models import ExperimentStatus
from grpo_server.client import Client, GrpoServerError


def trained_experiments(run_dir: Path, tasks: list[str]) -> list[str]:
    """The experiments the tasks' runs trained, by their summaries (a task whose run left none: its own name)."""
    names = []
    for task in tasks:
        summary = run_dir / f"{task}-reward.json"
        try:
            names.append(json.loads(summary.read_text())["experiment"])
        except (OSError, ValueError, KeyError, TypeError):
            names.append(task)
    return list(dict.fromkeys(names))


def _figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_line(status: ExperimentStatus) -> str:
    check = status.last_verification
    return (f"{status.name}: version {status.policy_version}, step {status.step}, recent reward "
            f"{_figure(status.recent_reward_mean, '.3f')}, groups trained {status.counters.groups_trained}, "
            f"sampler/learner logprob gap {_figure(check.mean_abs_diff if check else None, '.2e')}, "
            f"errors {status.errors}")


def summary_lines(client: Client, names: list[str]) -> list[str]:
    lines = []
    for name in names:
        try:
            lines.append(summary_line(client.status(name)))
        except GrpoServerError as exc:
            lines.append(f"{name}: no status ({exc})")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    run_dir, tasks = Path(argv[0]), argv[1:]
    with Client(os.environ["GRPO_SERVER_URL"], os.environ["GRPO_SERVER_API_KEY"]) as client:
        for line in summary_lines(client, trained_experiments(run_dir, tasks)):
            print(f"[demo] {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
