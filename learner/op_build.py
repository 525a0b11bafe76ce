"""DeepSpeed's shared-memory comm op, built before `deepspeed.init_distributed` asks for it, past a stale lock.

On CPU, DeepSpeed JIT-compiles that op the first time a learner starts (~50 s), under torch's FileBaton: a `lock`
file in the op's build folder that the builder creates and deletes when it is done. A builder killed midway (a
server stopped during its first start, an OOM kill) leaves the file behind, and every later learner waits on it
forever, never healthy: seen here, a test server's learner stuck at start-up for 6 minutes behind a build killed a
minute earlier. A file cannot say whether its owner lives, so our builders also hold an flock on a file beside it,
which the kernel releases when a process dies: a `lock` found while holding the flock is left by a dead builder,
and is removed before building. Ranks of one job build in turn (the first compiles, the others load its build).
"""

from __future__ import annotations

import fcntl
import importlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

FLOCK_NAME = ".grpo_server_build.flock"


def build_shm_op(ranks: int) -> None:
    """Build (or load the cached build of) the op now, so that `init_distributed` finds it ready. A job of one
    rank has nothing to reduce between ranks: DeepSpeed is told the op is unavailable, so the first start on a
    fresh machine (the demo's, a CI run's first server) does not wait ~50 s for a compiler."""
    import torch

    if torch.cuda.is_available():
        return  # NCCL: no shared-memory op
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm.torch, as an attribute, is torch

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return
    if ranks == 1:  # DeepSpeed's own build_shm_op returns None for an op its table calls incompatible
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
        return
    folder = build_folder(builder.name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / FLOCK_NAME, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        remove_stale_lock(folder)
        ds_comm_torch.build_shm_op()  # DeepSpeed's own: its compatibility checks, then builder.load()


def build_folder(name: str) -> Path:
    """Where torch builds extension `name` (TORCH_EXTENSIONS_DIR, else its per-Python cache folder)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def remove_stale_lock(folder: Path) -> bool:
    """With the flock held, a FileBaton `lock` in `folder` belongs to nobody alive: removed (True)."""
    lock = folder / "lock"
    if not lock.exists():
        return False
    log.warning("removing %s, left by a build of DeepSpeed's shm op that did not finish (its builder died)", lock)
    lock.unlink(missing_ok=True)
    return True
