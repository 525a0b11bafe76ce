"""The process boundaries of DESIGN.md: the client and front end import no ML package at import time, the
front end never imports the workers, and the workers never import each other."""

import subprocess
import sys

import pytest


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", ["grpo_server.client", "grpo_server.cli", "grpo_server.api.app"])
def test_client_and_front_end_import_no_ml_package(module):
    assert not imported_after(module) & {"torch", "vllm", "deepspeed", "transformers", "peft", "sampler", "learner"}


def test_workers_do_not_import_each_other():
    assert "learner" not in imported_after("sampler.app")
    assert "sampler" not in imported_after("learner.app")
