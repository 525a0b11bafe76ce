"""scripts/gpu-image-check: the GPU image (Dockerfile, EXTRA=gpu: CUDA torch and vLLM from PyPI) built on this
machine and checked inside, without a GPU. Not run by CI: it downloads several GB.

    scripts/gpu-image-check                # build grpo-server:gpu, then the checks
    scripts/gpu-image-check --no-build     # the checks on the image as it is

Build: `docker build --network host` with BASE_IMAGE (default grpo-server-base:bookworm, made by
scripts/make-base-image where missing, as scripts/compose-check does) and EXTRA=gpu. Nothing else is passed to
pip: the gpu extra's wheels are all on PyPI (the CUDA torch included), so no find-links or extra index.
The build's wall time and the image's size go to the log and to runs/gpu-image-check.json.

Checks, each `docker run --rm --network none` (nothing may be fetched at start):
  imports   vllm, torch (a CUDA build), deepspeed, peft import, at the versions constraints.txt pins
  cli       `grpo-server serve --help` answers; torchrun, `python -m grpo_server.cli` and curl are there (the Helm
            chart's multi-node learner and its probe)
  model     the embedded model was prepared at build time: `grpo-server model prepare` finds it ready (offline)
            and the folder holds an HF config and safetensors weights
  secret    the workers' secret is refused on the command line: `serve` has no option for it (argparse exits
            2, "unrecognized arguments"), and a worker role without it in its environment exits 2 naming
            GRPO_SERVER_WORKER_SECRET (grpo_server/serve.py check_role)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCAL_BASE = "grpo-server-base:bookworm"
SECRET_ENV = "GRPO_SERVER_WORKER_SECRET"  # grpo_server/protocol/worker_auth.py (not imported: no .venv needed)
START = time.monotonic()


def log(message: str) -> None:
    print(f"[gpu-image-check {time.monotonic() - START:6.0f}s] {message}", flush=True)


def pins() -> dict[str, str]:
    """constraints.txt's exact versions, by lower-case name."""
    found = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^;\s]+)\s*$", line)
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def build(image: str, base_image: str, log_path: Path) -> float:
    if base_image == LOCAL_BASE and subprocess.run(["docker", "image", "inspect", base_image],
                                                   capture_output=True).returncode != 0:
        subprocess.run(["scripts/make-base-image"], cwd=REPO, check=True, env={**os.environ, "BASE_IMAGE": base_image})
    command = ["nice", "-n", "19", "docker", "build", "--network", "host", "-t", image,
               "--build-arg", f"BASE_IMAGE={base_image}", "--build-arg", "EXTRA=gpu", "."]
    log(f"{' '.join(command)} (log: {log_path})")
    started = time.monotonic()
    with log_path.open("w") as out:
        result = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=3 * 3600)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        print("".join(log_path.read_text().splitlines(keepends=True)[-40:]))
        raise SystemExit(f"gpu-image-check: docker build failed (exit {result.returncode}) after {seconds:.0f} s; "
                         f"the whole log: {log_path}")
    log(f"built in {seconds:.0f} s")
    return seconds


def in_image(image: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "run", "--rm", "--network", "none", image, *command], capture_output=True,
                          text=True, timeout=600)


def expect(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    log(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        failures.append(name)


IMPORTS = """
import json, vllm, torch, deepspeed, peft, transformers
print(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                  "deepspeed": deepspeed.__version__, "peft": peft.__version__,
                  "transformers": transformers.__version__}))
"""

MODEL = """
import json, sys
from grpo_server.workers.model_prep import embedded_model_dir, is_prepared
folder = embedded_model_dir()
print(json.dumps({"folder": str(folder), "ready": is_prepared(folder),
                  "files": sorted(p.name for p in folder.iterdir()) if folder.is_dir() else [],
                  "bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0}))
"""


def checks(image: str) -> tuple[list[str], dict]:
    failures: list[str] = []
    found: dict = {}

    r = in_image(image, "python", "-c", IMPORTS)
    versions = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}
    found["versions"] = versions
    pinned = pins()
    wrong = {k: (v, pinned[k]) for k, v in versions.items() if k in pinned and v.split("+")[0] != pinned[k]}
    expect("imports", r.returncode == 0 and bool(versions.get("cuda")) and not wrong,
           f"{versions} (constraints.txt differs: {wrong})" if r.returncode == 0 else r.stderr[-2000:], failures)

    r = in_image(image, "grpo-server", "serve", "--help")
    expect("cli", r.returncode == 0 and "--role" in r.stdout, "grpo-server serve --help" if r.returncode == 0
           else r.stderr[-2000:], failures)

    # What the Helm chart runs besides `grpo-server`: torchrun -m grpo_server.cli (a learner over several nodes) and
    # curl (its probe on those pods, as compose's healthchecks).
    r = in_image(image, "sh", "-c",
                 "command -v torchrun && command -v curl && python -m grpo_server.cli serve --help >/dev/null")
    expect("chart commands", r.returncode == 0, " ".join(r.stdout.split()) or r.stderr[-500:], failures)

    r = in_image(image, "python", "-c", MODEL)
    model = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}
    found["model"] = model
    again = in_image(image, "grpo-server", "model", "prepare")
    files = model.get("files", [])
    expect("model", r.returncode == 0 and model.get("ready") is True and "config.json" in files
           and any(f.endswith(".safetensors") for f in files) and again.returncode == 0
           and again.stdout.strip() == model.get("folder"),
           f"{model.get('folder')}: {files}, {model.get('bytes', 0) / 2**20:.0f} MiB; prepare (offline) -> "
           f"{again.stdout.strip() or again.stderr[-500:]}", failures)

    secret = "s" * 32
    r = in_image(image, "grpo-server", "serve", "--role", "sampler", "--worker-secret", secret)
    expect("secret: no option", r.returncode == 2 and "unrecognized arguments" in r.stderr,
           f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"[:300], failures)
    r = in_image(image, "grpo-server", "serve", "--role", "sampler", "--config", "configs/compose/gpus-2.yaml")
    expect("secret: required in the environment", r.returncode == 2 and SECRET_ENV in r.stderr,
           f"exit {r.returncode}: {r.stderr.strip()[-300:]}", failures)
    return failures, found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-build", action="store_true", help="check the image as it is")
    parser.add_argument("--image", default="grpo-server:gpu")
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE", LOCAL_BASE))
    args = parser.parse_args()
    out_dir = REPO / "runs"
    out_dir.mkdir(exist_ok=True)
    result: dict = {"image": args.image, "base_image": args.base_image}
    if not args.no_build:
        result["build_s"] = round(build(args.image, args.base_image, out_dir / "gpu-image-build.log"))
    size = int(subprocess.run(["docker", "image", "inspect", args.image, "--format", "{{.Size}}"],
                              capture_output=True, text=True, check=True).stdout.strip())
    result["size_bytes"] = size
    log(f"{args.image}: {size / 1e9:.2f} GB ({size / 2**30:.2f} GiB)")
    failures, found = checks(args.image)
    result.update(found, failures=failures)
    (out_dir / "gpu-image-check.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"{'FAILED: ' + ', '.join(failures) if failures else 'all checks passed'} (runs/gpu-image-check.json)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
