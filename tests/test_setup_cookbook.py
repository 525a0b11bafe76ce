"""scripts/setup-cookbook, as the Tinker guide runs it (docs/guides/tinker.md, its install block): the overlay venv
(runs/cookbook-venv) sees the project's .venv through its .pth, which names a folder that exists, so `tinker`,
`datasets` and `torch` import there beside the overlay's `tinker_cookbook`, with its loops' recipes, and
`examples/tinker_cookbook.py --help` runs.

The test runs the real script in the repository (runs/ is git-ignored): the first run installs tinker-cookbook and
the packages its loops import from PyPI (about 15 s here), a re-run only rewrites the .pth and checks (a few
seconds), so a warm machine reuses the overlay that an earlier run made, as a user's re-run does."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.test_docs import blocks

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs/guides/tinker.md"
OVERLAY = REPO / "runs/cookbook-venv"
PYTHON = OVERLAY / "bin/python"


def _guide_block(test: str) -> str:
    mark = f"<!-- run: tests/test_setup_cookbook.py::{test} -->"
    wanted = [code for _, _, before, code in blocks(GUIDE) if before == mark]
    assert len(wanted) == 1, f"{GUIDE.name}: {len(wanted)} blocks marked for {test}"
    return wanted[0]


def _overlay(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PYTHON), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_setup_cookbook_block_runs():
    code = _guide_block("test_setup_cookbook_block_runs")
    assert "scripts/setup-cookbook" in code
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[setup-cookbook] ok:" in result.stdout, result.stdout[-3000:]

    # The .pth names a folder that exists: the project's packages (this interpreter's, when it is .venv's).
    site = sysconfig.get_paths()["purelib"]
    overlay_site = _overlay("import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    lines = (Path(overlay_site) / "zz_repo_venv.pth").read_text().split()
    assert len(lines) == 1 and Path(lines[0]).is_absolute() and Path(lines[0]).is_dir(), lines
    if Path(sys.prefix).resolve() == (REPO / ".venv").resolve():
        assert Path(lines[0]).resolve() == Path(site).resolve()

    # The SDK, datasets and torch from .venv; the cookbook and its loops from the overlay.
    probe = _overlay("import tinker, datasets, torch, tinker_cookbook, sys\n"
                     "from tinker_cookbook.recipes import rl_loop, sl_loop\n"
                     "print(tinker.__file__); print(datasets.__file__); print(torch.__file__)\n"
                     "print(tinker_cookbook.__file__)")
    assert probe.returncode == 0, probe.stderr[-3000:]
    tinker_at, datasets_at, torch_at, cookbook_at = probe.stdout.split()
    for path in (tinker_at, datasets_at, torch_at):
        assert Path(path).resolve().is_relative_to(Path(lines[0]).resolve()), path
    assert Path(cookbook_at).resolve().is_relative_to(OVERLAY.resolve()), cookbook_at

    helped = subprocess.run([str(PYTHON), "examples/tinker_cookbook.py", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert "usage: tinker_cookbook.py" in helped.stdout and "{rl,sl}" in helped.stdout, helped.stdout
