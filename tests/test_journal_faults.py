"""The feedback journal under failing disks (issue 25, item 5), on the real FeedbackJournal and Experiment.

Faults are injected into the journal's own file only (os.write, os.fsync, os.ftruncate on its descriptor):
an I/O error, a short write followed by a full disk, a full disk at once, a failed fsync, a cut-back that
fails too. After each, the feedback was answered 503 `journal_write_failed`, nothing was counted or queued,
the group (or the episodes) is still rateable, the retry succeeds, and the file read again holds exactly
the acknowledged records, each on its own whole line. Also: a torn tail left on disk is dropped at load and
the next append starts on a fresh line; the writes run off the event loop, in order; a request cancelled
mid-write still ends with its group queued; a failed compaction keeps everything.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import time
from pathlib import Path

import pytest

from grpo_server.api_models import FeedbackRequest
from grpo_server.config import ExperimentConfig
from grpo_server.protocol.errors import Conflict
from grpo_server.protocol.wire import Completion
from grpo_server.runtime import journal as journal_module
from grpo_server.runtime.episodes import EpisodeStore
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.groups import Group, GroupStore
from grpo_server.runtime.journal import FeedbackJournal, JournalWriteFailed

REAL_WRITE, REAL_FSYNC, REAL_FTRUNCATE = os.write, os.fsync, os.ftruncate


def completion(ids: list[int]) -> Completion:
    return Completion(text="x", token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")


def experiment(tmp_path: Path) -> Experiment:
    config = ExperimentConfig.model_validate({"name": "exp", "algorithm": {"batch_groups": 1}})
    return Experiment(config=config, groups=GroupStore(ttl_s=600), episodes=EpisodeStore(ttl_s=600),
                      journal=FeedbackJournal(tmp_path / "journal" / "exp.jsonl"))


def sampled(exp: Experiment) -> Group:
    group = Group(group_id=exp.groups.new_id(), experiment=exp.name, prompt_token_ids=[1, 2, 3],
                  completions=[completion([5, 6]), completion([7])], policy_version=0, temperature=1.0, max_tokens=4)
    exp.groups.add(group)
    return group


def rate(group: Group) -> FeedbackRequest:
    return FeedbackRequest(group_id=group.group_id, rewards=[1.0, 0.0])


def on_disk(path: Path) -> list[dict]:
    """The records in the file, checking that it is whole lines of JSON and nothing else."""
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), data[-80:]
    return [json.loads(line) for line in data.splitlines()]


class Faults:
    """Faults on the journal file's descriptor only (anything else the process writes goes through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path):
        self.path = path
        self.writes: list = []  # one per os.write call, in order: None = real, else a fault
        self.fsyncs: list = []
        self.ftruncates: list = []
        monkeypatch.setattr(os, "write", self._write)
        monkeypatch.setattr(os, "fsync", self._fsync)
        monkeypatch.setattr(os, "ftruncate", self._ftruncate)

    def _mine(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except OSError:
            return False

    def _write(self, fd, data):
        if self._mine(fd) and self.writes:
            fault = self.writes.pop(0)
            if fault == "half":  # a short write: the disk took only part of it
                return REAL_WRITE(fd, bytes(data[: max(1, len(data) // 2)]))
            if fault is not None:
                raise fault
        return REAL_WRITE(fd, data)

    def _fsync(self, fd):
        if self._mine(fd) and self.fsyncs:
            fault = self.fsyncs.pop(0)
            if isinstance(fault, float):
                time.sleep(fault)  # a slow disk
            elif fault is not None:
                raise fault
        return REAL_FSYNC(fd)

    def _ftruncate(self, fd, length):
        if self._mine(fd) and self.ftruncates:
            fault = self.ftruncates.pop(0)
            if fault is not None:
                raise fault
        return REAL_FTRUNCATE(fd, length)


def eio() -> OSError:
    return OSError(errno.EIO, "Input/output error")


def enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


FAULTS = {
    "write raises OSError": dict(writes=[eio()]),
    "short write, then disk full": dict(writes=["half", enospc()]),
    "disk full": dict(writes=[enospc()]),
    "fsync fails": dict(fsyncs=[eio()]),
    "write and the cut-back fail": dict(writes=["half", enospc()], ftruncates=[eio()]),
}


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_failed_journal_write_loses_nothing_and_the_retry_succeeds(tmp_path, monkeypatch, fault):
    exp = experiment(tmp_path)
    path = exp.journal.path
    first, second, third = sampled(exp), sampled(exp), sampled(exp)
    await exp.feedback(rate(first))
    faults = Faults(monkeypatch, path)
    for kind, queued in FAULTS[fault].items():
        getattr(faults, kind).extend(queued)

    with pytest.raises(JournalWriteFailed) as failed:
        await exp.feedback(rate(second))
    assert (failed.value.status, failed.value.code, failed.value.retry_after) == (503, "journal_write_failed", 5.0)
    assert "still rateable" in failed.value.message
    # Nothing accepted: not queued, not counted, and the group is pending again, as it was.
    assert [g.group_id for g in exp.queue] == [first.group_id]
    assert exp.counters.groups_received == 1 and exp.groups.pending_count("exp") == 2
    assert exp.groups.peek("exp", second.group_id) is second and second.journal_seq == 0
    if fault != "write and the cut-back fail":  # else the torn tail is cut at the next append
        assert [r["group_id"] for r in on_disk(path)] == [first.group_id]

    await exp.feedback(rate(second))  # the retry: accepted, with the next number
    await exp.feedback(rate(third))
    assert [g.journal_seq for g in exp.queue] == [1, 2, 3]
    assert [g.group_id for g in exp.queue] == [first.group_id, second.group_id, third.group_id]
    with pytest.raises(Conflict):  # taken for good now
        await exp.feedback(rate(second))
    assert all(not queued for queued in (faults.writes, faults.fsyncs, faults.ftruncates))  # every fault was hit
    await exp.stop()

    records = on_disk(path)
    assert [(r["seq"], r["group_id"]) for r in records] == [(g.journal_seq, g.group_id) for g in exp.queue]
    reloaded = FeedbackJournal(path).pending(after_seq=0)
    assert [(g.journal_seq, g.group_id, g.rewards) for g in reloaded] == [
        (g.journal_seq, g.group_id, [1.0, 0.0]) for g in exp.queue]


async def test_a_cut_back_that_keeps_failing_refuses_every_append_until_it_works(tmp_path, monkeypatch):
    exp = experiment(tmp_path)
    group = sampled(exp)
    faults = Faults(monkeypatch, exp.journal.path)
    faults.writes.append("half")
    faults.writes.append(enospc())
    faults.ftruncates.extend([eio(), eio()])  # the failed append's cut, then the next append's
    for _ in range(2):  # the second never writes: a record after a torn tail would be glued to it
        with pytest.raises(JournalWriteFailed):
            await exp.feedback(rate(group))
    assert faults.writes == [] and faults.ftruncates == [] and exp.groups.pending_count("exp") == 1
    await exp.feedback(rate(group))
    await exp.stop()
    assert [r["group_id"] for r in on_disk(exp.journal.path)] == [group.group_id]


async def test_a_short_write_that_goes_on_is_a_whole_record(tmp_path, monkeypatch):
    exp = experiment(tmp_path)
    group = sampled(exp)
    Faults(monkeypatch, exp.journal.path).writes.append("half")  # the rest goes in the next write
    await exp.feedback(rate(group))
    await exp.stop()
    assert [r["group_id"] for r in on_disk(exp.journal.path)] == [group.group_id]


async def test_failed_episode_feedback_leaves_the_episodes_rateable(tmp_path, monkeypatch):
    exp = experiment(tmp_path)
    ids = ["ep1", "ep2"]
    for index, episode_id in enumerate(ids):
        episode = exp.episodes.open("exp", episode_id, max_pending=8, max_turns=4)
        episode.add_turn([1, 2], completion([10 + index, 11]), version=0, messages=None, decoding=(1.0, 1.0))
        exp.episodes.done(episode)
    Faults(monkeypatch, exp.journal.path).writes.append(enospc())
    request = FeedbackRequest(episode_ids=ids, rewards=[1.0, 0.0])
    with pytest.raises(JournalWriteFailed):
        await exp.feedback(request)
    assert exp.episodes.pending_count("exp") == 2 and exp.counters.episodes_rated == 0 and not exp.queue
    await exp.feedback(request)
    assert exp.episodes.pending_count("exp") == 0 and exp.counters.episodes_rated == 2
    await exp.stop()
    [back] = FeedbackJournal(exp.journal.path).pending(after_seq=0)
    assert back.episode_of == [0, 1] and back.rewards == [1.0, 0.0]


async def test_a_torn_tail_on_disk_is_dropped_at_load_and_the_next_append_starts_a_fresh_line(tmp_path, caplog):
    exp = experiment(tmp_path)
    groups = [sampled(exp) for _ in range(3)]
    for group in groups[:2]:
        await exp.feedback(rate(group))
    await exp.stop()
    path = exp.journal.path
    with open(path, "ab") as handle:  # a crash mid-append: that group never got its 202
        handle.write(b'{"seq":3,"group_id":"' + groups[2].group_id.encode())
    with caplog.at_level(logging.WARNING, logger="grpo_server.runtime.journal"):
        journal = FeedbackJournal(path)
    assert "dropping an incomplete last line" in caplog.text
    assert journal.last_seq == 2 and [g.group_id for g in journal.pending(after_seq=0)] == [
        g.group_id for g in groups[:2]]
    groups[2].rewards, groups[2].advantages = [0.0, 1.0], [-1.0, 1.0]
    assert await journal.append_async(groups[2]) == 3
    journal.close()
    assert [(r["seq"], r["group_id"]) for r in on_disk(path)] == [(i + 1, g.group_id) for i, g in enumerate(groups)]


async def test_appends_run_off_the_event_loop_in_journal_order(tmp_path, monkeypatch):
    exp = experiment(tmp_path)
    groups = [sampled(exp) for _ in range(4)]
    faults = Faults(monkeypatch, exp.journal.path)
    faults.fsyncs.extend([0.15] * 4)  # a slow disk
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(ticker())
    try:
        await asyncio.gather(*(exp.feedback(rate(g)) for g in reversed(groups)))
    finally:
        beat.cancel()
    assert ticks >= 20  # the loop went on while the writes waited for the disk (4 x 0.15 s)
    # The queue is in journal order, whatever order the requests finished in.
    assert [g.journal_seq for g in exp.queue] == [1, 2, 3, 4]
    assert [g.group_id for g in exp.queue] == [g.group_id for g in reversed(groups)]
    await exp.stop()
    assert [(r["seq"], r["group_id"]) for r in on_disk(exp.journal.path)] == [
        (g.journal_seq, g.group_id) for g in exp.queue]


async def test_a_request_cancelled_mid_write_still_queues_its_group(tmp_path, monkeypatch):
    exp = experiment(tmp_path)
    group = sampled(exp)
    Faults(monkeypatch, exp.journal.path).fsyncs.append(0.3)
    request = asyncio.create_task(exp.feedback(rate(group)))
    await asyncio.sleep(0.1)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    for _ in range(100):  # the write goes on in its thread, and its group is queued after it
        if exp.queue:
            break
        await asyncio.sleep(0.02)
    assert [g.group_id for g in exp.queue] == [group.group_id] and exp.queue[0].journal_seq == 1
    with pytest.raises(Conflict):  # journalled: not rateable twice
        await exp.feedback(rate(group))
    await exp.stop()
    assert [r["group_id"] for r in on_disk(exp.journal.path)] == [group.group_id]


async def test_compaction_runs_in_turn_and_a_failed_one_keeps_everything(tmp_path, monkeypatch):
    exp = experiment(tmp_path)
    groups = [sampled(exp) for _ in range(4)]
    for group in groups[:2]:
        await exp.feedback(rate(group))
    journal = exp.journal

    def disk_full(*_, **__):
        raise enospc()

    with monkeypatch.context() as patch:
        patch.setattr(journal_module, "write_atomic", disk_full)
        with pytest.raises(OSError):
            await journal.compact_async(through_seq=1)
    await exp.feedback(rate(groups[2]))  # still appended to the live file
    assert [r["seq"] for r in on_disk(journal.path)] == [1, 2, 3]
    # Compaction and appends asked together run in the order asked.
    await asyncio.gather(journal.compact_async(through_seq=2), exp.feedback(rate(groups[3])))
    assert [r["seq"] for r in on_disk(journal.path)] == [3, 4]
    await exp.stop()
    assert [g.journal_seq for g in FeedbackJournal(journal.path).pending(after_seq=0)] == [3, 4]


async def test_a_closed_journal_writes_nothing(tmp_path):
    exp = experiment(tmp_path)
    group = sampled(exp)
    await exp.stop()
    with pytest.raises(ValueError):
        await exp.feedback(rate(group))
    assert exp.groups.pending_count("exp") == 1 and on_disk(exp.journal.path) == []


def test_a_new_journal_file_and_folder_have_durable_entries(tmp_path, monkeypatch):
    """Creating the journal fsyncs the folder that holds it (and the run directory, for a new folder): fsyncing
    its records alone leaves the file's name to a power cut, and every record with it. Opening one that exists
    fsyncs nothing. Its file is the owner's and its group's only (0640 at most)."""
    synced: list[Path] = []
    real_fsync_dir = journal_module.fsync_dir
    monkeypatch.setattr(journal_module, "fsync_dir", lambda path: (synced.append(Path(path)),
                                                                   real_fsync_dir(path))[1])
    path = tmp_path / "run" / "journal" / "exp.jsonl"
    (tmp_path / "run").mkdir()
    journal = FeedbackJournal(path)
    assert synced == [tmp_path / "run", tmp_path / "run" / "journal"]
    assert os.stat(path).st_mode & 0o777 & ~0o640 == 0
    journal.close()
    synced.clear()
    FeedbackJournal(path).close()
    assert synced == []
