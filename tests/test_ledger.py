"""learner/ledger.py: what every durable step consumed, written with (before) the checkpoint that holds it, kept
through a failed write, and read back as a history with rollbacks. The server's use of it, under faults:
tests/test_chaos.py."""

from __future__ import annotations

import torch

from learner import checkpoint, ledger
from learner.checkpoint_writer import CheckpointWriter


def _state(step: int) -> checkpoint.CheckpointState:
    return checkpoint.CheckpointState(step=step, version=0, journal_seq=step, groups_trained=step, lora={},
                                      algorithm={})


def _shards():
    return [checkpoint.RankShard({}, torch.get_rng_state())]


def test_a_checkpoint_writes_its_steps_lines_first_and_a_failed_write_keeps_them(tmp_path):
    lines = ledger.PendingLines()
    lines.record(1, "train", 4, ["g1", "g2"], {"g0": "stale"})
    lines.record(2, "optim_step")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the run directory should be")  # as a full disk: nothing can be written
    writer = CheckpointWriter(blocked)
    writer.submit("exp", _state(2), {"w": torch.ones(2)}, _shards(), lines.take())
    assert lines.take() == []  # the checkpoint holds them now
    try:
        writer.wait()
        raise AssertionError("the write should have failed")
    except OSError:
        pass
    writer.run_dir = tmp_path / "run"  # space again: the next checkpoint writes the lines the failed one held
    lines.record(3, "train", 6, ["g3"])
    writer.submit("exp", _state(3), {"w": torch.ones(2)}, _shards(), lines.take())
    writer.wait()
    written = ledger.read(checkpoint.checkpoint_root(tmp_path / "run", "exp"))
    assert [(line["step"], line["kind"], line["trained"], line["passed_over"]) for line in written] == [
        (1, "train", ["g1", "g2"], {"g0": "stale"}), (2, "optim_step", [], {}), (3, "train", ["g3"], {})]
    assert checkpoint.list_steps(tmp_path / "run", "exp") == [3]


def test_the_timeline_drops_rolled_back_steps_and_skips_a_torn_line(tmp_path):
    root = tmp_path / "exp"
    ledger.resumed(root, 0)
    ledger.append(root, [{"step": s, "trained": [f"a{s}"]} for s in (1, 2, 3)])
    # A crash after step 3's lines, before its checkpoint: the next life resumes at 1 and trains 2 and 3 again.
    ledger.resumed(root, 1)
    ledger.append(root, [{"step": s, "trained": [f"b{s}"]} for s in (2, 4)])
    ledger.append(root, [{"step": 3, "trained": ["b3"]}])  # a failed checkpoint's lines, written with the next
    with open(root / ledger.LEDGER_FILE, "ab") as f:
        f.write(b'{"step": 5, "trai')  # torn by a crash mid-write
    kept = ledger.timeline(ledger.read(root))
    assert [(line["step"], line["trained"]) for line in kept] == [(1, ["a1"]), (2, ["b2"]), (3, ["b3"]), (4, ["b4"])]
    ledger.resumed(root, 2)  # rolled back again, past lines written in any order
    assert [line["step"] for line in ledger.timeline(ledger.read(root))] == [1, 2]
