"""learner/checkpoint_writer.py: a checkpoint is copied when started and written on a thread of its own; it counts
(its journal position handed on once) only when on disk, and a failed write is raised, not reported durable. The
trainer's use of it, with resume: tests/test_learner_adapters.py."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from learner import checkpoint
from learner.checkpoint_writer import CheckpointWriter, copied


def _state(step: int, journal_seq: int) -> checkpoint.CheckpointState:
    return checkpoint.CheckpointState(step=step, version=step, journal_seq=journal_seq, groups_trained=step, lora={},
                                      algorithm={})


def test_what_was_started_is_written_even_as_the_live_tensors_move_on(tmp_path):
    writer = CheckpointWriter(tmp_path)
    weights = {"w": torch.ones(4)}
    optimizer = {"state": {0: {"exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": 0.1}]}
    writer.submit("exp", _state(1, 7), weights, [checkpoint.RankShard(optimizer, torch.get_rng_state())])
    weights["w"].add_(1)  # the next step, while the write may still be running
    optimizer["state"][0]["exp_avg"].add_(1)
    writer.wait()
    written = checkpoint.read_latest(tmp_path, "exp")
    assert torch.equal(written.weights["w"], torch.ones(4))
    assert torch.equal(written.optimizer["state"][0]["exp_avg"], torch.zeros(4))
    assert writer.newly_durable("exp") == 7
    assert writer.newly_durable("exp") is None  # handed on once


def test_a_checkpoint_counts_only_once_on_disk(tmp_path, monkeypatch):
    release, real_write = threading.Event(), checkpoint.write

    def slow_write(*args, **kwargs):
        release.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write", slow_write)
    writer = CheckpointWriter(tmp_path)
    writer.submit("exp", _state(1, 3), {"w": torch.ones(2)}, [checkpoint.RankShard({}, torch.get_rng_state())])
    assert writer.newly_durable("exp") is None and checkpoint.list_steps(tmp_path, "exp") == []
    release.set()
    writer.wait()
    assert writer.newly_durable("exp") == 3 and checkpoint.list_steps(tmp_path, "exp") == [1]


def test_a_failed_write_is_raised_and_never_counts(tmp_path):
    blocked = tmp_path / "run"
    blocked.write_text("a file where the run directory should be")  # as a full or read-only disk: mkdir fails
    writer = CheckpointWriter(blocked)
    writer.submit("exp", _state(1, 5), {"w": torch.ones(2)}, [checkpoint.RankShard({}, torch.get_rng_state())])
    with pytest.raises(OSError):
        writer.wait()
    assert writer.newly_durable("exp") is None
    writer.wait()  # raised once: the next checkpoint may succeed


def test_copied_rebuilds_containers_and_copies_tensors_only():
    marker = object()
    tree = {"a": [torch.zeros(2), (torch.ones(1), marker)], "b": 3}
    out = copied(tree)
    assert out["a"][1][1] is marker and out["b"] == 3 and isinstance(out["a"][1], tuple)
    tree["a"][0].add_(5)
    assert torch.equal(out["a"][0], torch.zeros(2))


def _shards(ranks: int, value: float) -> list[checkpoint.RankShard]:
    return [checkpoint.RankShard({"state": {0: {"exp_avg": torch.full((8,), value + r)}}}, torch.get_rng_state())
            for r in range(ranks)]


def test_once_two_are_kept_the_oldest_ones_files_are_written_over_for_the_next(tmp_path):
    """learner/checkpoint.py `write`: a checkpoint after the second takes the oldest's folder and writes over its
    files (their page cache is reused, not freed), and the newest is whole throughout."""
    root = checkpoint.checkpoint_root(tmp_path, "exp")
    for step in (1, 2):
        checkpoint.write(tmp_path, "exp", _state(step, step), {"w": torch.full((4,), float(step))}, _shards(1, step))
    oldest_file = os.stat(root / "step00000001" / checkpoint.OPTIMIZER_FILE).st_ino
    checkpoint.write(tmp_path, "exp", _state(3, 3), {"w": torch.full((4,), 3.0)}, _shards(1, 3))
    assert checkpoint.list_steps(tmp_path, "exp") == [2, 3]
    assert os.stat(root / "step00000003" / checkpoint.OPTIMIZER_FILE).st_ino == oldest_file
    latest = checkpoint.read_latest(tmp_path, "exp")
    assert latest.state.step == 3 and torch.equal(latest.weights["w"], torch.full((4,), 3.0))
    assert torch.equal(latest.optimizer["state"][0]["exp_avg"], torch.full((8,), 3.0))
    assert sorted(p.name for p in root.iterdir()) == ["step00000002", "step00000003"]  # no temporary left


def test_a_reused_folder_keeps_no_file_of_another_rank_count(tmp_path):
    for step, ranks in ((1, 2), (2, 2), (3, 1)):
        state = _state(step, step)
        state.ranks = ranks
        checkpoint.write(tmp_path, "exp", state, {"w": torch.ones(2)}, _shards(ranks, step))
    folder = checkpoint.checkpoint_root(tmp_path, "exp") / "step00000003"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [checkpoint.WEIGHTS_FILE, checkpoint.OPTIMIZER_FILE, checkpoint.RNG_FILE, checkpoint.STATE_FILE])
    assert checkpoint.read_latest(tmp_path, "exp").optimizer is not None


def test_a_write_that_fails_midway_leaves_the_newest_whole(tmp_path, monkeypatch):
    for step in (1, 2):
        checkpoint.write(tmp_path, "exp", _state(step, step), {"w": torch.ones(2)}, _shards(1, step))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        checkpoint.write(tmp_path, "exp", _state(3, 3), {"w": torch.ones(2)}, _shards(1, 3))
    assert checkpoint.list_steps(tmp_path, "exp") == [2]  # the oldest was the one being written over
    assert checkpoint.read_latest(tmp_path, "exp").state.step == 2
    assert sorted(p.name for p in checkpoint.checkpoint_root(tmp_path, "exp").iterdir()) == ["step00000002"]
