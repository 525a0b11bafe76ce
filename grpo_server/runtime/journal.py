"""The feedback journal and the experiment registry: what the front end must not lose in a crash.

Feedback journal: one append-only file per experiment, `run_dir/journal/{name}.jsonl`. Every rated group
the server accepts (a 202 that will be trained) is written and fsynced there, with a sequence number,
before the answer goes out. The learner's checkpoints record the newest sequence number their weights
include (`journal_seq`); after any restart the groups after it are queued again, so an accepted group is
in the weights exactly once. Entries a checkpoint covers are compacted away (the file is rewritten to a
temporary name and renamed, both fsynced), so the file holds only feedback the learner has not made durable yet.

A write that fails (disk full, an I/O error, a failed fsync) is cut back to the end of the last whole record
and answered 503 `journal_write_failed`: the caller keeps the group rateable, and no torn tail is left for
the next record to be glued to (a crash mid-write leaves one; the next start drops it). Appends and
compactions run on a worker thread, one at a time and in sequence order (`append_async`, `compact_async`):
an fsync can take seconds, and the event loop serves every other request meanwhile.

Experiment registry: `run_dir/experiments/{name}.json`, the config of every live experiment (with its
API key, so the file is 0600), so `grpo-server serve` on the same run directory brings them all back; beside it
`{name}.paused` while an admin has paused it, so it comes back paused.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from grpo_server.config import ExperimentConfig
from grpo_server.protocol.durable import RUN_FILE_MODE, fsync_dir, write_atomic
from grpo_server.protocol.errors import Unavailable
from grpo_server.protocol.wire import Completion
from grpo_server.runtime.groups import Group

log = logging.getLogger(__name__)

# Journal writes (appends and compactions, each fsynced) run on threads of their own: on asyncio's default
# executor they waited behind whatever else ran there (adapter archives, registry writes), and a feedback's 202
# waits for its append (issue 46). Each journal still writes one thing at a time (its lock); four threads let
# four experiments' appends go at once.
_WRITES = ThreadPoolExecutor(max_workers=4, thread_name_prefix="journal")


async def _on_journal_thread(work: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_WRITES, work, *args)


def group_record(group: Group) -> dict[str, Any]:
    return {
        "seq": group.journal_seq, "group_id": group.group_id, "experiment": group.experiment,
        "prompt_token_ids": group.prompt_token_ids, "completions": [c.model_dump() for c in group.completions],
        "policy_version": group.policy_version, "temperature": group.temperature, "top_p": group.top_p,
        "max_tokens": group.max_tokens,
        "rewards": group.rewards, "advantages": group.advantages,
        "sampled_step": group.sampled_step,  # absent in older journals: 0, counted from the first step
        **({} if group.episode_of is None else {"episode_of": group.episode_of,
                                                "sequence_prompts": group.sequence_prompts,
                                                "loss_masks": group.loss_masks}),
    }


def group_from_record(record: dict[str, Any]) -> Group:
    fields = dict(record)
    seq = fields.pop("seq")
    fields["completions"] = [Completion(**c) for c in fields["completions"]]
    return Group(**fields, journal_seq=seq)


class JournalWriteFailed(Unavailable):
    """A rated group could not be made durable: not accepted, nothing lost; the client retries."""

    code = "journal_write_failed"


class FeedbackJournal:
    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.parent.is_dir():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(self.path.parent.parent)  # the folder's own entry, as the file's below
        self._drop_torn_tail()
        # The newest acknowledged record: set on the event loop once its write returned (with the caller's
        # `then`), never by the thread writing it, so `pending` (a learner restart) never queues a group twice.
        self.last_seq = max((r["seq"] for r in self._records()), default=0)
        self._fd: int | None = None
        self._size = 0  # where the next record starts: the end of the last whole one
        self._torn = False  # a failed append could not be cut back yet: cut before writing again
        self._closed = False
        self._lock = asyncio.Lock()  # one append or compaction at a time, in the order they were asked
        self._open()

    def _open(self) -> int:
        if self._closed:
            raise ValueError(f"{self.path}: the journal is closed")
        if self._fd is None:
            created = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, RUN_FILE_MODE)
            if created:  # its entry in the folder is durable before any append is acknowledged: a power cut
                fsync_dir(self.path.parent)  # could otherwise lose the whole file, fsynced records and all
            self._size = os.fstat(self._fd).st_size  # whole records only: opened at start or after a compaction
        return self._fd

    def _drop_torn_tail(self) -> None:
        """A crash mid-append leaves a last line without its newline (that group never got its 202):
        cut it, or the next append would be glued to it."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            log.warning("%s: dropping an incomplete last line (%d bytes)", self.path, len(data) - data.rfind(b"\n") - 1)
            with open(self.path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)
                os.fsync(handle.fileno())

    def _lines(self) -> list[tuple[bytes, dict[str, Any]]]:
        """(line, record) of every whole record. A last line without its newline is an append still being
        written (or a torn one, cut back right after): not a record yet."""
        if not self.path.exists():
            return []
        found = []
        with open(self.path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.endswith(b"\n"):
                    break
                try:
                    found.append((line, json.loads(line)))
                except ValueError:  # not written by append (which only ever leaves whole lines)
                    log.warning("%s: line %d is not a journal record, skipped", self.path, number)
        return found

    def _records(self) -> list[dict[str, Any]]:
        return [record for _, record in self._lines()]

    def _write(self, data: bytes) -> None:
        """Append whole lines durably, or raise OSError with the file as it was: a failed or short write (disk
        full) or a failed fsync is cut back to the last whole record."""
        fd = self._open()
        if self._torn:
            self._cut_back(fd)  # raises again while it cannot: nothing is written after a torn tail
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)  # O_APPEND: at the end, after the last whole record
                if written <= 0:
                    raise OSError(errno.ENOSPC, "the journal write made no progress")
                view = view[written:]
            os.fsync(fd)  # after a failed fsync the bytes' fate is unknown: cut back below, not retried
        except OSError:
            try:
                self._cut_back(fd)
            except OSError as exc:
                log.error("%s: cannot cut a failed append back to %d bytes (%s); the next append retries",
                          self.path, self._size, exc)
            raise
        self._size += len(data)

    def _cut_back(self, fd: int) -> None:
        self._torn = True
        os.ftruncate(fd, self._size)
        os.fsync(fd)
        self._torn = False

    def _write_group(self, group: Group, seq: int) -> None:
        record = {**group_record(group), "seq": seq}
        self._write(json.dumps(record, separators=(",", ":")).encode() + b"\n")

    def append(self, group: Group) -> int:
        """Write the group durably and return its sequence number (also set on the group). Blocking: the
        server calls `append_async`."""
        seq = self.last_seq + 1
        self._write_group(group, seq)
        group.journal_seq = self.last_seq = seq
        return seq

    async def append_async(self, group: Group, then: Callable[[], Any] | None = None) -> int:
        """`append` on a worker thread, after every append and compaction asked before it; `then` runs as soon
        as the record is durable, before the next append starts (the caller queues the group there: the queue
        stays in journal order). A failed write raises JournalWriteFailed (503). A cancelled caller does not
        stop it: the write in its thread cannot be, and the next must not start before it ends."""
        return await asyncio.shield(self._append_in_turn(group, then))

    async def _append_in_turn(self, group: Group, then: Callable[[], Any] | None) -> int:
        async with self._lock:
            seq = self.last_seq + 1
            try:
                await _on_journal_thread(self._write_group, group, seq)
            except OSError as exc:
                log.error("%s: feedback not journalled: %s", self.path, exc)
                # The reason without the file's name (an OSError's str carries the server's path): the log has it.
                reason = exc.strerror or type(exc).__name__
                raise JournalWriteFailed(f"the feedback journal could not be written ({reason}); nothing was "
                                         "accepted and the group is still rateable: retry", retry_after=5.0) from exc
            group.journal_seq = self.last_seq = seq
            if then is not None:
                then()
            return seq

    def pending(self, after_seq: int) -> list[Group]:
        """Journalled groups not in the learner's weights (sequence number > after_seq), oldest first; only
        acknowledged ones (an append still being written is queued by its caller)."""
        return [group_from_record(r) for r in sorted(self._records(), key=lambda r: r["seq"])
                if after_seq < r["seq"] <= self.last_seq]

    def compact(self, through_seq: int) -> None:
        """Forget entries up to `through_seq`: the learner's checkpoint holds them. Blocking: the server calls
        `compact_async`. On a failure the file is as it was (it only holds more than needed)."""
        keep = b"".join(line for line, record in self._lines() if through_seq < record["seq"] <= self.last_seq)
        write_atomic(self.path, keep, mode=RUN_FILE_MODE)
        # Appends go to the new file, whole records only.
        old = self._fd
        self._fd = None
        self._torn = False
        if old is not None:
            os.close(old)
        self._open()

    async def compact_async(self, through_seq: int) -> None:
        async with self._lock:
            await _on_journal_thread(self.compact, through_seq)

    def close(self) -> None:
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def aclose(self) -> None:
        """Close once the appends and compactions asked before have ended."""
        async with self._lock:
            self.close()


class ExperimentRegistry:
    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / "experiments"

    def save(self, config: ExperimentConfig) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        body = config.model_dump(mode="json")
        body["api_key"] = config.api_key.get_secret_value() if config.api_key else None
        write_atomic(self.root / f"{config.name}.json", json.dumps(body, indent=2).encode(), mode=0o600)

    def remove(self, name: str) -> None:
        # Its pause marker goes too: left behind, it would pause a later experiment of the name at a restart.
        self._pause_marker(name).unlink(missing_ok=True)
        (self.root / f"{name}.json").unlink(missing_ok=True)
        if self.root.is_dir():
            fsync_dir(self.root)  # or a power cut brings a deleted experiment back at the next start

    def _pause_marker(self, name: str) -> Path:
        return self.root / f"{name}.paused"

    def set_paused(self, name: str, paused: bool) -> None:
        """Keep an admin's pause across restarts: an empty file beside the config while it is paused."""
        self.root.mkdir(parents=True, exist_ok=True)
        if paused:
            write_atomic(self._pause_marker(name), b"")  # its folder fsynced too
        else:
            self._pause_marker(name).unlink(missing_ok=True)
            fsync_dir(self.root)

    def is_paused(self, name: str) -> bool:
        return self._pause_marker(name).is_file()

    def load_all(self) -> list[ExperimentConfig]:
        """The saved configs that still validate (`load_each` also says why the others do not)."""
        return [config for config in self.load_each().values() if isinstance(config, ExperimentConfig)]

    def load_each(self) -> dict[str, ExperimentConfig | str]:
        """Each saved experiment by its file's name: its config, or why it cannot be read (a file written by an
        older version that this one no longer takes, say a name now reserved, or a damaged one). One bad file
        must not stop the server from starting with the others."""
        if not self.root.is_dir():
            return {}
        found: dict[str, ExperimentConfig | str] = {}
        for path in sorted(self.root.glob("*.json")):
            try:
                found[path.stem] = ExperimentConfig.model_validate(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:  # ValueError: bad JSON, and pydantic's ValidationError
                found[path.stem] = f"its saved config ({path.name}) cannot be read: {exc}".replace("\n", "; ")
        return found
