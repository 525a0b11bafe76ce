"""One overlay venv per tinker SDK release, for tests/test_tinker_sdk_range.py and scripts/test-tinker-range: a venv
under runs/tinker-sdk/<version>/ (git-ignored) that holds only that release of `tinker`, with the project's .venv
behind it through a .pth (scripts/setup-cookbook's pattern), so every dependency is .venv's and only the SDK differs.
Every release in the range requires the same packages, all of which .venv has (docs/guides/tinker.md, "Supported SDK
versions"). Built once, from the package registry (`pip install --no-deps`, as pip is configured here), then
reused: a stamp file names the release installed. The releases: grpo_server/api/tinker/data.py SDK_RELEASES_TESTED.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ROOT / "runs" / "tinker-sdk"
INSTALL_TIMEOUT_S = 300


def pinned_release() -> str:
    """The tinker release .venv holds (constraints.txt's pin)."""
    return importlib.metadata.version("tinker")


def sdk_python(version: str, root: Path = OVERLAYS) -> Path:
    """An interpreter whose `tinker` is release `version`: .venv's own for the release it pins (no second copy of
    it), else that release's overlay venv, made first if it is not there or holds another release."""
    if version == pinned_release():
        return Path(sys.executable)
    return overlay_python(version, root)


def overlay_python(version: str, root: Path = OVERLAYS) -> Path:
    """The interpreter of release `version`'s overlay venv, made first if it is not there or holds another release."""
    venv = root / version
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.exists() and stamp.read_text().strip() == version and python.exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one (an install cut short) is made again
    # Without pip: the overlay never installs anything itself (.venv's pip installs into it, below).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    overlay_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       check=True, capture_output=True, text=True).stdout.strip())
    # .venv's packages after the overlay's own, so the overlay's tinker shadows .venv's (constraints.txt's) release.
    (overlay_site / "zz_repo_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--target", str(overlay_site), f"tinker=={version}"], check=True, timeout=INSTALL_TIMEOUT_S)
    found = subprocess.run([str(python), "-c", "import tinker; print(tinker.__version__, tinker.__file__)"],
                           check=True, capture_output=True, text=True).stdout.split()
    if found[0] != version or not Path(found[1]).is_relative_to(venv):
        raise RuntimeError(f"the overlay for tinker {version} imports tinker {found[0]} from {found[1]}")
    stamp.write_text(version + "\n")
    return python
