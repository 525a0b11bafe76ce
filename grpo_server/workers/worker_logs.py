"""A local worker's log, `run_dir/logs/<worker>.log`: its stdout and stderr, bounded in size, and read from its tail.

Why the output goes through a pipe to the front end, which writes it, rather than to a file the worker holds:
a worker's output is not only Python logging. vLLM's engine core (a child process), DeepSpeed's JIT build (a
compiler), the learner's other ranks, native crash reports and faulthandler all write straight to file
descriptors 1 and 2; a `RotatingFileHandler` inside the worker would see none of it, and a file held open by
every one of those processes cannot be rotated under them (each would go on writing into the renamed file).
With a pipe, one writer, `LogPump`'s thread in the front end, sees every byte and rotates by size: at most
`LOG_MAX_BYTES` in `<worker>.log` and as much in each of `LOG_BACKUPS` older files, `<worker>.log.1` (the
newest) to `.N`. The worker dies with the front end anyway (processes.py: PR_SET_PDEATHSIG), so routing its
output through it costs no independence. The thread only copies bytes: a worker never blocks on the front
end's event loop, and a write that fails (disk full) drops the bytes rather than stall the worker on a full pipe.

Readers take only the tail (`tail_lines`: the last `TAIL_BYTES`), never the whole file: the front end looks at
the last line every few seconds while a worker starts, and at the last lines when one dies.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

LOG_MAX_BYTES = 16 * 1024 * 1024  # a model load and hours of request logs fit; a crash loop's output is cut
LOG_BACKUPS = 3  # so at most 64 MiB a worker
TAIL_BYTES = 64 * 1024  # what a reader of the tail reads: far more than the 20 lines it shows
CHUNK_BYTES = 64 * 1024


class RotatingLog:
    """Bytes appended to `path`, which moves to `path.1` (`.1` to `.2`, ...; the oldest dropped) before it would
    pass `max_bytes`. Thread-safe: a restarted worker's pump may overlap the dead one's last bytes."""

    def __init__(self, path: Path, max_bytes: int | None = None, backups: int | None = None):
        self.path = Path(path)
        self.max_bytes = LOG_MAX_BYTES if max_bytes is None else max_bytes
        self.backups = LOG_BACKUPS if backups is None else backups
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self._size = 0

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "ab")
                self._size = self._file.tell()
            while data:
                room = self.max_bytes - self._size
                if room <= 0:
                    self._rotate()
                    room = self.max_bytes
                # A file ends at a line's end where one fits (a pipe read holds many lines, and may be larger
                # than a file).
                cut = len(data) if len(data) <= room else (data.rfind(b"\n", 0, room) + 1 or room)
                self._file.write(data[:cut])
                self._size += cut
                data = data[cut:]
                if data:
                    self._rotate()
            self._file.flush()  # readers of the tail see it at once

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            newer = self.path if index == 1 else self.path.with_name(f"{self.path.name}.{index - 1}")
            if newer.exists():
                os.replace(newer, older)  # onto the oldest backup: it is dropped
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "ab")
        self._size = 0

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class LogPump:
    """Copies one worker process's output pipe into its `RotatingLog`, on a daemon thread, until every writer
    (the worker and what it spawned) has closed the pipe."""

    def __init__(self, pipe: IO[bytes], target: RotatingLog, name: str):
        self._fd, self._pipe, self.target = pipe.fileno(), pipe, target
        self._failing = False
        self.thread = threading.Thread(target=self._run, name=f"log-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while data := os.read(self._fd, CHUNK_BYTES):
                try:
                    self.target.write(data)
                    self._failing = False
                except OSError as exc:  # keep draining: a full pipe would block the worker
                    if not self._failing:
                        log.warning("%s: cannot write (%s); its output is dropped until it can", self.target.path, exc)
                    self._failing = True
        except OSError:  # the pipe itself failed: nothing more to copy
            pass
        finally:
            self._pipe.close()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)


def tail_lines(path: Path, lines: int = 20, tail_bytes: int = TAIL_BYTES) -> str:
    """The last `lines` lines of the log at `path`, from its last `tail_bytes` only; when the file was just
    rotated and holds fewer, the rest come from the newest backup. "" if there is none."""
    found: list[str] = []
    for candidate in (Path(path), Path(path).with_name(f"{Path(path).name}.1")):
        try:
            with open(candidate, "rb") as file:
                size = file.seek(0, os.SEEK_END)
                file.seek(max(0, size - tail_bytes))
                data = file.read(tail_bytes)
        except OSError:
            break
        chunk = data.decode("utf-8", errors="replace").splitlines()
        if size > tail_bytes and chunk:
            chunk = chunk[1:]  # the first line read may be cut
        found = chunk + found
        if len(found) >= lines:
            break
    return "\n".join(found[-lines:])
