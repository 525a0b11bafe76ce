"""Each experiment's ledger: `RUN_DIR/checkpoints/<name>/ledger.jsonl`, what every durable step of its weights
consumed, for an auditor (scripts/benchmarks/chaos_check.py) to prove that every acknowledged group was trained
exactly once or passed over with a reason.

One JSON object a line, one line a step:
- `step`: the optimizer step the line is about (the experiment's count, as in its checkpoints);
- `kind`: `train` (a native batch) or `optim_step` (a Tinker one: no groups);
- `journal_seq`: the newest feedback-journal entry in this step or passed over before it;
- `trained`: the ids of the groups the step trained (a group of episodes has the id its feedback answered with);
- `passed_over`: `{group id: reason}` for groups the front end took out of the queue since the step before without
  training them: `stale` (max_staleness), `failed` (the learner failed on their batch again and again),
  `nothing_to_train` (every completion left out, mask_truncated);
- `time`: when the step ended (wall clock).

Written with the checkpoint that holds the step, before it (fsynced): a line is in the file once its step could be
durable. A crash between the two leaves lines for steps the next life trains again from the journal: they are
written again, with the same step numbers. So the file is read as a history with rollbacks (`timeline`): a line
for step k replaces every earlier line for step k or later. What a crash before any checkpoint loses (steps in
memory) is in no line: those steps happen again, once.

The file grows with the run, about 50 bytes a group; it moves with the experiment's checkpoints (deleted: archived).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

LEDGER_FILE = "ledger.jsonl"


class PendingLines:
    """An experiment's lines since its newest checkpoint started: recorded by its steps, taken by the checkpoint."""

    def __init__(self) -> None:
        self._lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def record(self, step: int, kind: str, journal_seq: int = 0, trained: Iterable[str] = (),
               passed_over: dict[str, str] | None = None) -> None:
        line = {"step": step, "kind": kind, "journal_seq": journal_seq, "trained": list(trained),
                "passed_over": dict(passed_over or {}), "time": round(time.time(), 3)}
        with self._lock:
            self._lines.append(line)

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines


def append(root: Path, lines: list[dict[str, Any]]) -> None:
    """`lines` at the end of the ledger in checkpoint folder `root`, on disk (fsynced) when this returns."""
    if not lines:
        return
    root.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
    with open(root / LEDGER_FILE, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read(root: Path) -> list[dict[str, Any]]:
    """Every whole line of the ledger in `root`, in order (a torn last line, from a crash mid-write, left out)."""
    path = root / LEDGER_FILE
    if not path.is_file():
        return []
    lines = []
    for raw in path.read_bytes().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines


def timeline(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history the weights went through: a line for step k replaces every earlier line for step k or later
    (those steps were rolled back by a crash and trained again)."""
    kept: list[dict[str, Any]] = []
    for line in lines:
        while kept and kept[-1]["step"] >= line["step"]:
            kept.pop()
        kept.append(line)
    return kept
