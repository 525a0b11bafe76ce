"""scripts/gpu-check's plumbing, without a GPU: a phase that hangs is stopped with its children and recorded, a
phase's result line is read, the carried wheels are pinned as pyproject.toml pins them, and the tiny-model
fallback builds from the tokenizer files alone. (`scripts/gpu-check --cpu-smoke` runs every phase for real.)"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from scripts.benchmarks import gpu_carry, gpu_check
from scripts.benchmarks.gpu_check import RESULT_PREFIX, race_limits, run_phase
from tests.pins import pinned_versions



def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its re-parenting reaper may not have waited for it yet


def test_a_hung_phase_is_stopped_with_its_children(tmp_path):
    code = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); print('child', child.pid, flush=True); time.sleep(120)")
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        out = run_phase([sys.executable, "-c", code], 3, {}, log, "hang")
    assert time.monotonic() - started < 90  # its 3 s limit, not the 120 s sleep (a loaded box is slow)
    assert out["timed_out"] and not out["ok"] and "no result within 3 s" in out["error"]
    child = int(re.search(r"child (\d+)", out["log_tail"]).group(1))
    time.sleep(0.5)
    assert not alive(child)


def test_a_phase_result_is_read_and_a_failure_recorded(tmp_path):
    with open(tmp_path / "log", "w") as log:
        good = run_phase([sys.executable, "-c", f"print('working'); print({RESULT_PREFIX!r} + '{{\"x\": 1}}')"],
                         30, {}, log, "good")
        bad = run_phase([sys.executable, "-c", "print('oops'); raise SystemExit(3)"], 30, {}, log, "bad")
    assert good["ok"] and good["result"] == {"x": 1} and good["rc"] == 0
    assert not bad["ok"] and bad["rc"] == 3 and bad["error"] == "exited 3 without a result"
    assert "oops" in bad["log_tail"]
    assert "[good] working" in (tmp_path / "log").read_text()


def test_the_race_gets_what_the_budget_leaves():
    assert race_limits(270, smoke=False) == pytest.approx((270 - sum(gpu_check.GPU_SIDE_OVERHEAD.values()) - 10) / 2)
    assert race_limits(0, smoke=False) == 20.0 and race_limits(10_000, smoke=False) == 600.0


def test_the_carried_wheels_are_pinned_as_constraints_pins_them():
    pins = pinned_versions()
    carried = dict(spec.split("==") for spec in gpu_carry.pinned())
    assert {"deepspeed", "pydantic", "pydantic-settings", "trl", "datasets"} <= set(carried)
    wrong = {name: (version, pins[name]) for name, version in carried.items()
             if name in pins and version not in pins[name]}
    assert wrong == {}


def test_a_missing_half_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_carry, "PART_A", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="gguf.part"):
        gpu_carry.assemble(tmp_path / "out")


def test_without_the_model_the_tiny_one_is_built_from_the_tokenizer(tmp_path, monkeypatch):
    from grpo_server.workers.model_prep import prepare_embedded_model

    from scripts.benchmarks import gpu_phases

    kit = tmp_path / "b" / "tokenizer"
    kit.mkdir(parents=True)
    embedded = prepare_embedded_model()
    for name in gpu_carry.TOKENIZER_FILES:
        if (embedded / name).exists():
            (kit / name).write_bytes((embedded / name).read_bytes())
    monkeypatch.setattr(gpu_carry, "PART_B", tmp_path / "b")
    monkeypatch.setenv("GRPO_SERVER_CACHE", str(tmp_path / "unused"))  # tiny_fallback sets its own
    out = gpu_phases.tiny_fallback(tmp_path / "work", "half a missing")
    assert out["model_kind"] == "tiny" and json.loads(json.dumps(out))
    assert (Path(out["context"]["model_dir"]) / "model.safetensors").is_file()
