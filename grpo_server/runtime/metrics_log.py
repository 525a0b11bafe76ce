"""Each experiment's metrics history: `RUN_DIR/metrics/<name>.jsonl`, one JSON object a line, for plots
(`grpo-server plot`), the status page and whoever reads the file after the run.

Every line has `time` (wall clock, seconds since the epoch) and `kind`:
- `train`: one learner step (written when its answer reaches the front end): `step`, `policy_version`
  (the version serving when the step ended), `groups`, and the learner's `loss`, `reward_mean`,
  `reward_std`, `kl` (null when beta = 0: no reference forward), `clipped_fraction`, `ratio_mean`,
  `ratio_std`, `ratio_min`, `ratio_max`,
  `grad_norm`, `tokens`, `step_seconds`, and the step's free check of the samplers (grpo_server/
  verification.py): `checked_version`, `sampler_gap_tokens`, `sampler_gap_mean`, `sampler_gap_max`, and the
  sampler/learner `mismatch_kl` (and apart: `mismatch_kl_fresh` over the current version's tokens, numerics
  alone, `offpolicy_kl_stale` over older versions', with `mismatch_fresh_tokens` / `offpolicy_stale_tokens`) and
  `rollout_corrected_fraction` (grpo_server/protocol/wire.py TrainMetrics).
- `push`: a new version served: `version`, `step`, `push_seconds`, and its check against the learner:
  `verified` (true / false; null when no check ran, or it was inconclusive), `verdict` (ok / failed /
  inconclusive; null when no check ran), `mean_abs_diff`, `max_abs_diff`, `checked_on` (`trained_batch` or
  `probe`: grpo_server/runtime/verification.py), `step_fraction` (the nearest_version check's). Written when
  the check is done.
- `sampling`: what was sampled since the previous sampling line, every `SAMPLING_INTERVAL_S` while the
  experiment samples (an idle interval writes nothing): `interval_s`, `groups`, `completions`,
  `completion_tokens`, `tokens_per_s`.

Every record written is also handed to `feed` when one is given: the experiment's trackers (grpo_server/
trackers/), which must not block or raise (their own buffers and threads see to it).

Lines are appended and flushed one by one, not fsynced: a power cut may cost the last points of a plot,
never training. The file grows with the run; at start only its newest lines are read back (`last_lines`:
backwards from the end, in blocks), so creating or resuming an experiment costs the same after a long run.
Non-finite numbers are written as null (JSON has no NaN). The file outlives the experiment: deleting it moves
the file into the experiment's archive (grpo_server/protocol/archive.py), so a new experiment of the same name
starts a history of its own, and one resumed (`resume: true`) takes its history back and appends to it, as its
version numbers continue too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO, Callable, Literal

from pydantic import BaseModel, Field

from grpo_server.api_models import ExperimentCounters, VerificationResult
from grpo_server.protocol.wire import TrainMetrics

log = logging.getLogger(__name__)

Kind = Literal["train", "push", "sampling"]
KINDS: tuple[Kind, ...] = ("train", "push", "sampling")
SAMPLING_INTERVAL_S = 10.0
RECENT_PER_KIND = 2000  # records of each kind kept in memory for `GET /v1/experiments/{name}/metrics`
HISTORY_LINES = RECENT_PER_KIND * len(KINDS)  # the newest lines read back at start
BLOCK_BYTES = 64 * 1024
# However long its lines, no more is read back (our lines are well under 1 KiB: 6000 of them ~ 4 MB).
MAX_HISTORY_BYTES = 64 * 1024 * 1024


class MetricsHistory(BaseModel):
    """The answer of `GET /v1/experiments/{name}/metrics`: the newest records, oldest first."""

    name: str
    records: list[dict[str, Any]] = Field(
        description="Lines of the experiment's metrics log (`grpo_server/runtime/metrics_log.py` lists their fields); "
                    "each has `time` (seconds since the epoch) and `kind` (`train`, `push` or `sampling`).")


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLog:
    """The open log of one experiment (one file handle), with its newest records of each kind in memory."""

    def __init__(self, path: Path, feed: Callable[[dict[str, Any]], None] | None = None):
        self.path = path
        self.feed = feed  # the experiment's trackers (TrackerSet.feed); None: the file alone
        self.recent: dict[Kind, deque[dict[str, Any]]] = {k: deque(maxlen=RECENT_PER_KIND) for k in KINDS}
        path.parent.mkdir(parents=True, exist_ok=True)
        self._load_history()
        self._file = open(path, "a", encoding="utf-8")
        if path.stat().st_size and not self._ends_with_newline():
            self._file.write("\n")  # a line cut short by a crash: the next one must not be glued to it
        self._sampled_at = time.monotonic()
        self._sampled = ExperimentCounters()
        self._failing = False  # a write failed (disk full?): said once in the log, until one succeeds

    def _load_history(self) -> None:
        """The newest records of an earlier run, so the status page shows the whole curve after a restart."""
        if not self.path.is_file():
            return
        with open(self.path, "rb") as file:
            for raw in last_lines(file, HISTORY_LINES):
                try:
                    record = json.loads(raw.decode("utf-8", errors="replace"))
                except ValueError:
                    continue  # the line a crash cut short
                if (isinstance(record, dict) and record.get("kind") in KINDS
                        and isinstance(record.get("time"), (int, float))):
                    self.recent[record["kind"]].append(record)

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as file:
            file.seek(-1, 2)
            return file.read(1) == b"\n"

    def write(self, kind: Kind, **fields: Any) -> dict[str, Any]:
        """Append one line. Never raises: a full disk must not stop training, only its record."""
        record = {"time": time.time(), "kind": kind, **{k: _finite(v) for k, v in fields.items()}}
        self.recent[kind].append(record)
        try:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        except (OSError, ValueError) as exc:  # ValueError: written after close
            if not self._failing:
                log.warning("metrics log %s: cannot write (%s); the status page still shows new records",
                            self.path, exc)
            self._failing = True
        else:
            self._failing = False
        if self.feed is not None:
            self.feed(record)
        return record

    def train(self, metrics: TrainMetrics, policy_version: int, groups: int) -> None:
        learner = metrics.model_dump(exclude={"step", "seconds", "checkpointed_journal_seq"})
        self.write("train", step=metrics.step, policy_version=policy_version, groups=groups, **learner,
                   step_seconds=metrics.seconds)

    def push(self, version: int, step: int, push_seconds: float, verification: VerificationResult | None) -> None:
        self.write("push", version=version, step=step, push_seconds=push_seconds,
                   verified=None if verification is None else verification.ok,
                   mean_abs_diff=None if verification is None else verification.mean_abs_diff,
                   max_abs_diff=None if verification is None else verification.max_abs_diff,
                   checked_on=None if verification is None else verification.checked_on,
                   verdict=None if verification is None else _verdict(verification.ok),
                   step_fraction=None if verification is None else verification.step_fraction)

    def sampling(self, counters: ExperimentCounters) -> None:
        """A `sampling` line for what `counters` gained since the last call, if anything was sampled."""
        now = time.monotonic()
        interval = now - self._sampled_at
        self._sampled_at = now
        groups = counters.groups_sampled - self._sampled.groups_sampled
        completions = counters.completions_sampled - self._sampled.completions_sampled
        tokens = counters.tokens_sampled - self._sampled.tokens_sampled
        self._sampled = counters.model_copy()
        if groups > 0:
            self.write("sampling", interval_s=interval, groups=groups, completions=completions,
                       completion_tokens=tokens, tokens_per_s=tokens / interval if interval > 0 else None)

    def recent_group_rewards(self, groups: int) -> list[float]:
        """The mean rewards of the newest `groups` groups the learner trained, oldest first, from the `train`
        records read back at start: each step's `reward_mean` once for each group it trained (a group's mean and
        its step's are the same for groups of equal size). A restarted server's recent reward starts from them;
        the zero-variance groups a step skipped are not among them."""
        rewards: list[float] = []
        for record in reversed(self.recent["train"]):
            mean, count = record.get("reward_mean"), record.get("groups")
            if isinstance(mean, (int, float)) and isinstance(count, int) and count > 0:
                rewards.extend([float(mean)] * min(count, groups - len(rewards)))
            if len(rewards) >= groups:
                break
        return rewards[::-1]

    def records(self, kind: Kind | None = None, limit: int = RECENT_PER_KIND) -> list[dict[str, Any]]:
        """The newest `limit` records (of `kind`, or of every kind), oldest first."""
        if kind is not None:
            chosen = list(self.recent[kind])
        else:
            chosen = sorted((r for k in KINDS for r in self.recent[k]), key=lambda r: r["time"])
        return chosen[-limit:] if limit > 0 else []

    def close(self) -> None:
        self._file.close()


def last_lines(file: BinaryIO, count: int, block: int = BLOCK_BYTES, most: int = MAX_HISTORY_BYTES) -> list[bytes]:
    """The last `count` lines of a binary file, without their newlines, oldest first, as iterating over the whole
    file would give them (a last line without its newline, cut short by a crash, is one), but read backwards
    from the end in `block`s: what is read is those lines plus less than a block (at most `most` bytes)."""
    end = file.seek(0, os.SEEK_END)
    position, blocks, newlines = end, [], 0
    # count + 1 newlines: the first of them ends a line that may have begun before what was read.
    while position > 0 and newlines <= count and end - position < most:
        size = min(block, position)
        position -= size
        file.seek(position)
        data = file.read(size)
        blocks.append(data)
        newlines += data.count(b"\n")
    lines = b"".join(reversed(blocks)).split(b"\n")
    if lines[-1] == b"":  # the file ends with a newline: no line after it
        lines.pop()
    if position > 0 and lines:
        lines.pop(0)  # may be the end of a line that began before
    return lines[-count:] if count > 0 else []


def metrics_log_path(run_dir: Path, name: str) -> Path:
    return run_dir / "metrics" / f"{name}.jsonl"


def _verdict(ok: bool | None) -> str:
    return {True: "ok", False: "failed", None: "inconclusive"}[ok]
