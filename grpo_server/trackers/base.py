"""The sink interface every tracker implements, and the buffered dispatcher that feeds them.

A tracker is one implementation of one sink interface (`Tracker`): it opens a run of one experiment in its
backend (trackio, Weights & Biases, MLflow, TensorBoard), writes points to it, and closes it. The metrics log
(grpo_server/runtime/metrics_log.py) stays the source of truth: every record it writes is handed to the
experiment's `TrackerSet`, which turns it into a `Point` (numbers on the learner-step axis) and puts it in each
tracker's bounded buffer. Each tracker drains its own buffer on a thread of its own (`BufferedSink`), so a
backend that is slow, hangs or raises costs its own records, never a training step: a full buffer drops the
record and counts it, an exception is counted with its text, and the counts are in the experiment's status
(`trackers`) and in `/metrics`.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

log = logging.getLogger(__name__)

# Fields of a metrics-log record that are its axes or its labels, not series.
NOT_SERIES = frozenset({"time", "kind", "step"})
LAST_ERROR_CHARS = 300  # an exception's text can be long (a whole HTTP answer); the status shows its start


@dataclass(frozen=True)
class Point:
    """One metrics-log record as trackers take it: `values` are `<kind>/<field>` -> float on the `step` axis."""

    kind: str
    step: int
    time: float  # epoch seconds, the record's own
    values: dict[str, float]


def point_of(record: dict[str, Any], step: int) -> Point:
    """The numbers of a record, named `<kind>/<field>`. Booleans become 1 / 0 (a push's `verified`); a push's
    `verdict` becomes `push/inconclusive` (1 when the check could not tell, 0 when it could: `verified` says
    which way), since every backend plots numbers and only some keep text. Nulls and other text are left out."""
    kind = str(record.get("kind"))
    values: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SERIES or value is None:
            continue
        if isinstance(value, bool):
            values[f"{kind}/{key}"] = 1.0 if value else 0.0
        elif isinstance(value, (int, float)) and math.isfinite(value):
            values[f"{kind}/{key}"] = float(value)
    if kind == "push" and record.get("verdict") is not None:
        values["push/inconclusive"] = 1.0 if record["verdict"] == "inconclusive" else 0.0
    return Point(kind=kind, step=step, time=float(record.get("time") or time.time()), values=values)


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker needs to open the run of one experiment."""

    experiment: str  # the run's name in its backend
    directory: Path  # where local backends write: `<run_dir>/trackers` unless the server config says otherwise
    project: str  # trackio's project, wandb's project, MLflow's experiment: one for the whole server
    config: dict[str, Any]  # the experiment's public config, kept as the run's parameters
    options: Any = None  # the server's TrackersSettings (grpo_server/config.py): backend options


class Tracker(ABC):
    """One backend's run of one experiment. Every method is called on the sink's own thread, one at a time, so
    an implementation needs no lock; `open` is called before the first `write` (and again after it failed),
    and is where the backend's library is imported: the server runs without the `trackers` extra."""

    name: ClassVar[str]  # as in the config; its libraries are listed in grpo_server/trackers/__init__.py TRACKERS

    def __init__(self, run: TrackerRun):
        self.run = run

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def write(self, point: Point) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


@dataclass
class SinkCounts:
    """What became of the records handed to one tracker (read by the status without a lock: plain ints)."""

    written: int = 0
    dropped: int = 0  # the buffer was full, or the sink was closed before it could write them
    errors: int = 0  # open / write / close raised (the record is not retried)
    last_error: str | None = None


_STOP = object()  # the marker that ends a sink's thread once everything before it is written


class BufferedSink:
    """A tracker behind a bounded buffer, drained by a daemon thread of its own."""

    def __init__(self, tracker: Tracker, capacity: int):
        self.tracker = tracker
        self.counts = SinkCounts()
        self._buffer: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._opened = False
        self._closing = False
        self._abandoned = False  # close gave up on it: what it still holds was counted as dropped, not to be written
        self._closed: bool | None = None  # close's answer, once given
        self._thread = threading.Thread(target=self._drain, name=f"tracker-{tracker.name}-{tracker.run.experiment}",
                                        daemon=True)  # a hung backend must not keep the server from exiting
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._buffer.qsize()

    def submit(self, point: Point) -> None:
        """Never blocks: the caller is the event loop, which a slow backend must not hold up."""
        if self._closing:
            self.counts.dropped += 1
            return
        try:
            self._buffer.put_nowait(point)
        except queue.Full:
            self.counts.dropped += 1

    def _failed(self, what: str, exc: BaseException) -> None:
        self.counts.errors += 1
        text = f"{what}: {type(exc).__name__}: {exc}"
        if self.counts.last_error is None or self.counts.errors in (1, 10, 100, 1000):
            log.warning("tracker %s of %s: %s", self.tracker.name, self.tracker.run.experiment, text)
        self.counts.last_error = text[:LAST_ERROR_CHARS]

    def _drain(self) -> None:
        while True:
            point = self._buffer.get()
            if point is _STOP or self._abandoned:
                break
            try:
                if not self._opened:
                    self.tracker.open()
                    self._opened = True
                self.tracker.write(point)
            except Exception as exc:  # noqa: BLE001 - any backend failure is counted, never raised
                self._failed("open" if not self._opened else "write", exc)
            else:
                self.counts.written += 1
        if self._opened:
            try:
                self.tracker.close()
            except Exception as exc:  # noqa: BLE001
                self._failed("close", exc)

    def close(self, timeout_s: float) -> bool:
        """Write what is buffered and close the run, within `timeout_s`; False if the backend did not finish
        (its thread is left behind, and what it still held counts as dropped). Blocks: call it off the loop."""
        if self._closed is not None:
            return self._closed
        self._closing = True
        deadline = time.monotonic() + timeout_s
        try:
            self._buffer.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abandoned = True
            self.counts.dropped += sum(1 for point in list(self._buffer.queue) if point is not _STOP)
            log.warning("tracker %s of %s did not finish within %.0f s; left behind", self.tracker.name,
                        self.tracker.run.experiment, timeout_s)
            self._closed = False
        else:
            self._closed = True
        return self._closed


@dataclass
class TrackerSet:
    """One experiment's trackers: the metrics log feeds it every record, and it keeps the learner-step axis."""

    sinks: dict[str, BufferedSink] = field(default_factory=dict)
    step: int = 0  # the learner step of the newest `train` record: the axis of `sampling` records, which have none

    def feed(self, record: dict[str, Any]) -> None:
        """Called for every record the metrics log writes, on the event loop: never blocks, never raises."""
        if not self.sinks:
            return
        try:
            kind = record.get("kind")
            if kind == "train" and isinstance(record.get("step"), int):
                self.step = record["step"]
            # A push's step is the step that made its version (its check may end after later steps).
            step = record["step"] if kind == "push" and isinstance(record.get("step"), int) else self.step
            point = point_of(record, step)
        except Exception:  # noqa: BLE001 - a malformed record must not stop the metrics log
            log.exception("trackers: cannot read a metrics record")
            return
        for sink in self.sinks.values():
            sink.submit(point)

    def counts(self) -> dict[str, SinkCounts]:
        return {name: sink.counts for name, sink in self.sinks.items()}

    def pending(self) -> dict[str, int]:
        return {name: sink.pending for name, sink in self.sinks.items()}

    def close(self, timeout_s: float) -> None:
        """Close every sink, together (each has its own thread), within `timeout_s`. Blocks: off the loop."""
        closers = [threading.Thread(target=sink.close, args=(timeout_s,), daemon=True) for sink in self.sinks.values()]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(timeout_s + 1)
