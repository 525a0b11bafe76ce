"""The image's Python and this suite's (issue 50): the image's front end crash-looped because a checkpoint's bytes
depended on the Python that wrote it (an Enum pickles as `getattr(EnumClass, 'NAME')` on Debian 12's CPython
3.11.2, as `EnumClass(value)` on 3.11.7). The suite runs on one Python only, so:

- the image's Python and the suite's agree in minor version (read from the Dockerfile's default base and the
  Debian release scripts/make-base-image bootstraps), so the suite tests the language the image runs;
- where Docker runs and the image is built (scripts/compose-check builds it), checkpoints written by the image's
  Python read back here and the other way, the earlier format's files included.
"""

from __future__ import annotations

import re
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner import checkpoint
from learner.plain_data import load_data

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "grpo-server:cpu"  # scripts/compose_check.py's tag
DEBIAN_PYTHON = {"bullseye": (3, 9), "bookworm": (3, 11), "trixie": (3, 13)}  # each release's python3


def test_the_image_runs_the_suites_python_minor():
    base = re.search(r"^ARG BASE_IMAGE=python:(\d+)\.(\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert base, "the Dockerfile's default base is no longer python:X.Y-*: say here which Python it runs"
    suite = re.search(r"debootstrap .*\n(?:.*\n)*?\s+(\w+) \"\$root\"", (ROOT / "scripts/make-base-image").read_text())
    assert suite and suite.group(1) in DEBIAN_PYTHON, "scripts/make-base-image bootstraps a release not named here"
    assert (int(base.group(1)), int(base.group(2))) == DEBIAN_PYTHON[suite.group(1)] == sys.version_info[:2]


def _image_ready() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode == 0


IN_THE_IMAGE = """
import platform, sys, torch
from pathlib import Path
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from learner import checkpoint

state = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(scale=2.0), "exp_avg": torch.arange(4.0)}
written = checkpoint.CheckpointState(step=3, version=2, journal_seq=5, groups_trained=4, lora={}, algorithm={})
checkpoint.write(Path("/data/image"), "exp", written, {"w": torch.ones(2)},
                 [checkpoint.RankShard(state, torch.get_rng_state())])
torch.save(state, "/data/earlier-format.pt")  # how the earlier writer saved it, pickled by this Python
back = checkpoint.read_latest(Path("/data/host"), "exp")
assert back.optimizer["zero_stage"] is ZeroStageEnum.gradients and back.state.step == 7
print(platform.python_version())
"""


@pytest.mark.skipif(not _image_ready(), reason=f"no Docker, or the image {IMAGE} is not built (scripts/compose-check)")
def test_checkpoints_cross_between_the_images_python_and_this_one(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    host_state = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(scale=2.0)}
    written = checkpoint.CheckpointState(step=7, version=3, journal_seq=9, groups_trained=6, lora={}, algorithm={})
    checkpoint.write(tmp_path / "host", "exp", written, {"w": torch.ones(2)},
                     [checkpoint.RankShard(host_state, torch.get_rng_state())])
    # As this test's own user: the image's (uid 10001, non-root) cannot write the folder the test made, and the
    # files it writes there are read back here.
    run = subprocess.run(["docker", "run", "--rm", "--network", "none", "--user", f"{os.getuid()}:{os.getgid()}",
                          "-v", f"{tmp_path}:/data", IMAGE, "python", "-c", IN_THE_IMAGE],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    image_python = run.stdout.split()[-1]
    assert image_python.startswith(f"{sys.version_info[0]}.{sys.version_info[1]}.")

    back = checkpoint.read_latest(tmp_path / "image", "exp")
    assert back.state.step == 3 and back.optimizer["zero_stage"] is ZeroStageEnum.gradients
    assert back.optimizer["loss_scaler"].cur_scale == 2.0 and torch.equal(back.optimizer["exp_avg"], torch.arange(4.0))
    earlier = (tmp_path / "earlier-format.pt").read_bytes()
    if image_python == "3.11.2":  # the pickle that crash-looped the front end
        assert b"getattr" in earlier
    assert load_data(tmp_path / "earlier-format.pt")["zero_stage"] is ZeroStageEnum.gradients
