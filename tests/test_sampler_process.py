"""The sampler process itself: the requests it refuses (400 with an error code), its health answer and
resolved config, its vLLM worker inside a forked engine core (sampler/vllm_start.py), and a bad config failing fast
before torch or vLLM is imported.

The engines are the shared session-scoped `sampler_*` fixtures of `tests/conftest.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from grpo_server.protocol.worker_config import SamplerConfig
from tests.sampler_helpers import MAX_MODEL_LEN, ROOT, Sampler


# --- bad requests ----------------------------------------------------------------------------------


def test_bad_requests_are_400(sampler: Sampler) -> None:
    vocab = 49152
    cases = [
        ("/generate", {"prompt_token_ids": [1] * 500, "max_tokens": 13}, "bad_request"),
        ("/generate", {"prompt_token_ids": [1] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt_too_long"),
        ("/generate", {"prompt_token_ids": [5, vocab]}, "bad_request"),
        ("/generate", {"prompt_token_ids": [-1]}, "bad_request"),
        ("/generate", {"prompt_token_ids": [5], "top_p": 0}, "bad_request"),
        ("/generate", {"prompt_token_ids": []}, "bad_request"),
        ("/generate", {"prompt_token_ids": [5], "surprise": 1}, "bad_request"),
        ("/score", {"prompt_token_ids": [5], "completions_token_ids": [[vocab + 3]]}, "bad_request"),
        ("/score", {"prompt_token_ids": [1] * 500, "completions_token_ids": [[1] * 13]}, "bad_request"),
        ("/generate", b"\xc1 not msgpack", "bad_request"),
    ]
    for path, body, code in cases:
        status, answer = sampler.post(path, body)
        assert status == 400 and answer["error"]["code"] == code, (path, answer)
    # A sequence of exactly max_model_len tokens can still be generated and scored.
    out = sampler.generate(prompt_token_ids=[1] * (MAX_MODEL_LEN - 2), n=1, max_tokens=2, seed=1)["completions"][0]
    scored = sampler.score([out["token_ids"]], prompt_token_ids=[1] * (MAX_MODEL_LEN - 2))[0]
    assert len(scored) == len(out["token_ids"])


# --- health and config -----------------------------------------------------------------------------


def test_health_and_resolved_config(sampler: Sampler) -> None:
    health = sampler.health()
    assert health["status"] == "ok" and health["engine"] == sampler.engine
    assert health["max_model_len"] == MAX_MODEL_LEN and isinstance(health["adapters"], list)
    assert health["dtype"] == "float32"  # dtype auto without CUDA (the front end picks its push check by it)
    # The vLLM sampler compiles, as by default (conftest.py); transformers has no such switch.
    assert health["compiled"] is {"vllm": True, "transformers": None}[sampler.engine]
    resolved = yaml.safe_load((sampler.run_dir / "config" / "sampler-0.resolved.yaml").read_text())
    assert resolved["engine"] == sampler.engine and resolved["max_model_len"] == MAX_MODEL_LEN


def test_a_cpu_vllm_sampler_runs_its_worker_inside_the_engine_core(sampler_vllm: Sampler) -> None:
    # sampler/vllm_start.py: "uni" on a CPU host, so the model's worker is no third process that imports torch
    # and vLLM again (seconds of every start, and its own resident copy of both).
    rows = subprocess.run(["ps", "-e", "-o", "pgid=,args="], capture_output=True, text=True, check=True).stdout
    group = str(sampler_vllm.proc.pid)  # a session and process group of its own (tests/sampler_helpers.py)
    parsed = (row.strip().partition(" ") for row in rows.splitlines())
    names = [args.strip() for pgid, _, args in parsed if pgid == group]
    assert names.count("VLLM::EngineCore") == 1, names
    assert not [name for name in names if name.startswith("VLLM::Worker")], names


def test_the_engine_core_is_forked_without_the_port_and_with_the_kv_cache_asked_for(sampler_vllm: Sampler) -> None:
    # sampler/vllm_start.py: forked, not spawned (no second import of torch and vLLM); the sampler's listening
    # socket stays the sampler's alone; the KV cache is the config's 1/16 GiB, not vLLM's whole-GiB variable's 1.
    text = sampler_vllm.log.read_text(errors="replace")
    assert "vLLM's engine core: forked from this process" in text
    assert "Explicitly set (0.06/" in text, "the KV cache is not the configured 0.0625 GiB"
    holders = socket_holders(listening_inode(sampler_vllm.port))
    assert holders == [sampler_vllm.proc.pid], holders


def listening_inode(port: int) -> str:
    """The inode of the socket listening on 127.0.0.1:`port` (/proc/net/tcp: state 0A is LISTEN)."""
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":
            return fields[9]
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def socket_holders(inode: str) -> list[int]:
    """Pids with a file descriptor on socket `inode`."""
    holders = []
    for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or not ours to read
            continue
        if f"socket:[{inode}]" in links:
            holders.append(pid)
    return holders


@pytest.mark.parametrize(("bind", "threads", "omp"), [
    (None, 1, "1"), (None, 3, "3"), (None, 0, str(len(os.sched_getaffinity(0)))), ("0", 1, None)])
def test_the_engine_core_gets_the_worker_and_its_threads(monkeypatch: pytest.MonkeyPatch, bind: str | None,
                                                           threads: int, omp: str | None) -> None:
    from sampler.vllm_start import engine_core_environment, worker_in_engine_core

    for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    if bind is not None:  # the user's own binding: vLLM's own worker process, and cpu_threads has no say
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    config = SamplerConfig(model_path=Path("/model"), run_dir=Path("/run"), port=1, cpu_threads=threads)
    env = engine_core_environment(config)
    assert env.get("OMP_NUM_THREADS") == omp and env["GRPO_SERVER_CPU_LORA_OPS"] == "grouped"
    assert (env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") == (bind is None)
    assert worker_in_engine_core() == (bind is None)  # engine_args' "uni" (None: vLLM's own "mp" on CPU)


def test_a_compiled_sampler_on_cpu_uses_the_compile_cache_that_loads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's AOT-compile cache cannot load its CPU artifacts back (every start compiled again); its Inductor
    # cache can. A user's own VLLM_USE_AOT_COMPILE is theirs; an eager sampler compiles nothing.
    from sampler.vllm_start import engine_core_environment

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    config = SamplerConfig(model_path=Path("/model"), run_dir=Path("/run"), port=1)
    assert config.compile and engine_core_environment(config)["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in engine_core_environment(config.model_copy(update={"compile": False}))
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert "VLLM_USE_AOT_COMPILE" not in engine_core_environment(config)


def test_the_engine_core_environment_is_set_only_while_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A benchmark that runs vLLM in its own process starts servers afterwards: their learner must not inherit
    # the engine core's one-thread OMP_NUM_THREADS.
    from sampler.vllm_start import _environment

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with _environment({"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_bad_config_fails_before_loading_anything(tmp_path: Path) -> None:
    config = tmp_path / "sampler.yaml"
    config.write_text(yaml.safe_dump({"model_path": "/nowhere", "run_dir": str(tmp_path), "port": 1, "enigne": "vllm"}))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sampler", "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "enigne" in done.stderr
    assert time.monotonic() - started < 30  # no torch / vLLM import happened
