"""Each experiment's ledger: `RUN_DIR/checkpoints/<name>/ledger.jsonl`, what every durable step of its weights
consumed, for an auditor (scripts/benchmarks/chaos_check.py) to prove that every acknowledged group was trained
exactly once or passed over with a reason.

One JSON object a line, one line a step:
- `step`: the optimizer step the line is about (the experiment's count, as in its checkpoints);
- `kind`: `train` (a native batch), `optim_step` (a Tinker one: no groups), or `resumed`: the learner took the
  experiment up at `step` (at its add: a start, a restart, a page-in is not one), so lines of later steps before it
  were rolled back;
- `journal_seq`: the newest feedback-journal entry in this step or passed over before it;
- `trained`: the ids of the groups the step trained (a group of episodes has the id its feedback answered with);
- `passed_over`: `{group id: reason}` for groups the front end took out of the queue since the step before without
  training them: `stale` (max_staleness), `failed` (the learner failed on their batch again and again),
  `nothing_to_train` (every completion left out, mask_truncated);
- `time`: when the step ended (wall clock).

Written where a step becomes durable, before it (fsynced): with the checkpoint that holds it, and with a saved
version (a learner without a newer checkpoint resumes from the newest version, learner/resume.py). A crash between
the two leaves lines for steps the next life rolls back and trains again from the journal, written again with the
same numbers. So the file is read as a history with rollbacks (`timeline`): a `resumed` line drops the lines of
the steps after it, and a step's newest line is its line. Lines reach the file in any order between two `resumed`
lines (a failed checkpoint's are written with the next). What a crash loses in memory is in no line: those steps
happen again, once.

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

    def put_back(self, lines: list[dict[str, Any]]) -> None:
        """Lines taken for a write that failed, ahead of those recorded since."""
        with self._lock:
            self._lines[:0] = lines


_APPENDING = threading.Lock()  # the checkpoint writer's thread and a version save append to one file


def append(root: Path, lines: list[dict[str, Any]]) -> None:
    """`lines` at the end of the ledger in checkpoint folder `root`, on disk (fsynced) when this returns."""
    if not lines:
        return
    root.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
    with _APPENDING, open(root / LEDGER_FILE, "ab+") as f:
        if f.tell() and os.pread(f.fileno(), 1, f.tell() - 1) != b"\n":
            data = b"\n" + data  # a line torn by a crash mid-write ends here; ours start on a line of their own
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def resumed(root: Path, step: int) -> None:
    """The experiment taken up at `step`: the steps after it, in lines before this one, were rolled back."""
    append(root, [{"step": step, "kind": "resumed", "time": round(time.time(), 3)}])


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
    """The history the weights went through, by step: a `resumed` line drops the steps after it (rolled back by a
    crash, and trained again from the journal), and a step's newest line is its line."""
    kept: dict[int, dict[str, Any]] = {}
    for line in lines:
        if line.get("kind") == "resumed":
            kept = {step: kept_line for step, kept_line in kept.items() if step <= line["step"]}
        else:
            kept[line["step"]] = line
    return [kept[step] for step in sorted(kept)]
