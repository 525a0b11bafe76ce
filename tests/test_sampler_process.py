"""The sampler process itself: the requests it refuses (400 with an error code), its health answer and
resolved config, and a bad config failing fast before torch or vLLM is imported.

The engines are the shared session-scoped `sampler_*` fixtures of `tests/conftest.py`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

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
    resolved = yaml.safe_load((sampler.run_dir / "config" / "sampler-0.resolved.yaml").read_text())
    assert resolved["engine"] == sampler.engine and resolved["max_model_len"] == MAX_MODEL_LEN


def test_bad_config_fails_before_loading_anything(tmp_path: Path) -> None:
    config = tmp_path / "sampler.yaml"
    config.write_text(yaml.safe_dump({"model_path": "/nowhere", "run_dir": str(tmp_path), "port": 1, "enigne": "vllm"}))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sampler", "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "enigne" in done.stderr
    assert time.monotonic() - started < 30  # no torch / vLLM import happened
