"""scripts/gpu-check's plumbing, without a GPU: a phase that hangs is stopped with its children and recorded, a
phase's result line is read, the carried wheels are pinned as pyproject.toml pins them, and the tiny-model
fallback builds from the tokenizer files alone. (`scripts/gpu-check --cpu-smoke` runs every phase for real.)"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from scripts.benchmarks import gpu_carry, gpu_check
from scripts.benchmarks.gpu_check import RESULT_PREFIX, compare_fleet, fleet_limit, race_limits, run_phase
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
    # As a shell starts a background job: SIGINT ignored, which the phase must not inherit.
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with open(tmp_path / "log", "w") as log:
            out = run_phase([sys.executable, "-c", code], 3, {}, log, "hang")
    finally:
        signal.signal(signal.SIGINT, before)
    assert time.monotonic() - started < 90  # its 3 s limit, not the 120 s sleep (a loaded box is slow)
    assert out["timed_out"] and not out["ok"] and "no result within 3 s" in out["error"]
    assert out["rc"] == -signal.SIGINT, out["rc"]  # stopped by the SIGINT (its `finally` ran), not the SIGKILL
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
    overhead = gpu_check.GPU_SIDE_OVERHEAD["race_server"] + gpu_check.GPU_SIDE_OVERHEAD["race_trl"]
    assert race_limits(270, smoke=False) == pytest.approx((270 - overhead - 10) / 2)
    assert race_limits(0, smoke=False) == 20.0 and race_limits(10_000, smoke=False) == 600.0


def test_the_fleet_sides_share_the_budget_and_one_by_one_splits_its_half():
    once = fleet_limit("fleet_at_once", 500, sides_left=2, k=8, smoke=False)
    assert once == pytest.approx((500 - 2 * gpu_check.GPU_SIDE_OVERHEAD["fleet_at_once"] - 10) / 2)
    each = fleet_limit("fleet_one_by_one", 500 - once, sides_left=1, k=8, smoke=False)
    assert each == pytest.approx((500 - once - gpu_check.GPU_SIDE_OVERHEAD["fleet_one_by_one"] - 10) / 8)


def fleet_side(limit_s: float, *clocks: float | None, groups: int = 10, wall_s: float = 100.0) -> dict:
    rows = [{"reached": c is not None, "reached_s": c, "groups": groups} for c in clocks]
    return {"result": {"experiments": rows, "time_limit_s": limit_s, "wall_s": wall_s,
                       "fleet_s": None if None in clocks else max(clocks)}}


def test_the_fleet_speedup_is_exact_or_a_lower_bound():
    exact = compare_fleet({"fleet_at_once": fleet_side(300, 100, 120), "fleet_one_by_one": fleet_side(60, 50, 40)})
    assert (exact["speedup"], exact["exact"]) == (0.75, True) and exact["verdict"].endswith("not met")
    # One by one missed its second target within 60 s: its time is at least 50 + 60.
    bound = compare_fleet({"fleet_at_once": fleet_side(300, 30, 35), "fleet_one_by_one": fleet_side(60, 50, None)})
    assert (bound["one_by_one_s"], bound["exact"]) == (110, False)
    assert bound["verdict"].startswith("at least 3.143x") and bound["verdict"].endswith(": met")
    low = compare_fleet({"fleet_at_once": fleet_side(300, 100), "fleet_one_by_one": fleet_side(60, None)})
    assert low["verdict"].endswith("not shown")  # at least 0.6x says nothing about 3x
    missed = compare_fleet({"fleet_at_once": fleet_side(300, None), "fleet_one_by_one": fleet_side(60, 50)})
    assert "speedup" not in missed and "no speed-up" in missed["verdict"]
    # Where no clock decides, the rates still do: 2 x 30 groups in 100 s against 2 x 10 in 100 s.
    rates = compare_fleet({"fleet_at_once": fleet_side(300, None, None, groups=30),
                           "fleet_one_by_one": fleet_side(60, None, None)})
    assert rates["groups_per_s"] == {"at_once": 0.6, "one_by_one": 0.2} and rates["throughput_ratio"] == 3.0
    assert not compare_fleet({"fleet_at_once": {"ok": False}, "fleet_one_by_one": fleet_side(60, 50)})["ok"]


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


def test_fleet_sides_of_two_calls_are_compared_from_their_files(tmp_path, capsys, monkeypatch):
    once, one_by_one = tmp_path / "once.json", tmp_path / "one_by_one.json"
    once.write_text(json.dumps({"phases": {"model": {"ok": True}, "fleet_at_once": fleet_side(300, 40, 50)}}))
    one_by_one.write_text(json.dumps({"phases": {"fleet_one_by_one": fleet_side(60, 50, 40)}}))
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--compare-fleet", str(once), str(one_by_one)])
    assert gpu_check.main() == 0
    assert json.loads(capsys.readouterr().out)["speedup"] == 1.8  # (50 + 40) / 50
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--compare-fleet", str(once)])
    assert gpu_check.main() == 1 and json.loads(capsys.readouterr().out)["missing"] == ["fleet_one_by_one"]
