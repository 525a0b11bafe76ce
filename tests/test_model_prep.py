"""grpo_server/workers/model_prep.py: processes that prepare the embedded model at once on one cache prepare it
once (a fresh clone's set-up failed mid-write when the tests started a second preparation beside it)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from grpo_server.workers.model_prep import READY_MARKER, is_prepared, prepare_once


def _slow_make(folder: Path) -> None:
    with open(folder.parent / "makes.log", "a") as log:
        log.write(f"{folder.name}\n")
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    time.sleep(0.5)  # the window in which a second preparer used to remove this folder
    (folder / "config.json").write_text("{}")


def _prepare(out: str, force: bool = False) -> None:
    prepare_once(Path(out), _slow_make, force)


def test_two_processes_at_once_prepare_the_folder_once(tmp_path):
    out = tmp_path / "models" / "m"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_prepare, args=(str(out),)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert is_prepared(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([READY_MARKER, "config.json", "model.safetensors"])
    assert len((out.parent / "makes.log").read_text().splitlines()) == 1  # the second found it ready
    assert sorted(p.name for p in out.parent.iterdir()) == ["m", "m.lock", "makes.log"]  # no half-made folder


def test_a_failed_preparation_leaves_nothing_marked_ready(tmp_path):
    out = tmp_path / "m"

    def broken(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    try:
        prepare_once(out, broken)
    except OSError:
        pass
    else:
        raise AssertionError("the error was swallowed")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m.lock"]
    assert is_prepared(prepare_once(out, _slow_make))  # a later try prepares it
