"""learner/op_build.py: a FileBaton `lock` left by a killed build of DeepSpeed's shm op no longer keeps every
later learner from starting; a live builder's lock is waited for, not taken; a job of one rank builds nothing. (The
build itself is faked: the real one is ~50 s of g++, which the suite's multi-rank learners run.)"""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import threading
import time

from learner import op_build

HOLDER = """
import fcntl, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
held = open(folder / ".grpo_server_build.flock", "a+")
fcntl.flock(held, fcntl.LOCK_EX)
(folder / "lock").touch()  # as torch's FileBaton does while it compiles
print("holding", flush=True)
time.sleep(600)
"""


def test_a_dead_builders_lock_is_removed_and_a_live_ones_waited_for(tmp_path, monkeypatch):
    built: list[bool] = []
    monkeypatch.setattr(op_build, "build_folder", lambda name: tmp_path)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")

    monkeypatch.setattr(ds_comm_torch, "build_shm_op", lambda: built.append((tmp_path / "lock").exists()))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        ours = threading.Thread(target=op_build.build_shm_op, args=(2,))
        ours.start()
        time.sleep(0.5)
        assert ours.is_alive() and (tmp_path / "lock").exists() and built == []  # a live builder: waited for
        holder.send_signal(signal.SIGKILL)  # it dies mid-build: its lock stays, its flock goes
        ours.join(timeout=30)
        assert not ours.is_alive()
    finally:
        holder.kill()
        holder.wait()
    assert built == [False]  # the stale lock was gone before the build ran
    assert not (tmp_path / "lock").exists()


def test_without_a_lock_the_build_just_runs(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(op_build, "build_folder", lambda name: tmp_path)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")

    monkeypatch.setattr(ds_comm_torch, "build_shm_op", lambda: calls.append(1))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    op_build.build_shm_op(2)
    op_build.build_shm_op(2)
    assert calls == [1, 1] and not op_build.remove_stale_lock(tmp_path)


def test_a_one_rank_job_builds_nothing_and_deepspeed_goes_without_the_op(tmp_path, monkeypatch):
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, name, True)  # as a fresh process has it; restored after
    monkeypatch.setattr(op_build, "build_folder", lambda name: tmp_path)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    op_build.build_shm_op(1)
    assert list(tmp_path.iterdir()) == []  # no flock taken, nothing built
    # What deepspeed.init_distributed then calls: DeepSpeed's own, which returns None without a compiler run.
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None
