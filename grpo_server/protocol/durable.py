"""Files and folders that later steps rely on, made durable: written whole under a temporary name, fsynced,
renamed into place, and the rename itself fsynced. A rename is an entry of its folder; until the folder is
fsynced a power cut can undo it (the new name gone, or the old content back), so a checkpoint the front end
was told about, or a compacted journal, could vanish after the front end acted on it.

Standard library only: the front end (feedback journal, experiment registry) and the learner (checkpoints,
adapter versions) both use it.
"""

from __future__ import annotations

import os
from pathlib import Path


# What a run directory's files and folders may be: the owner's, readable by its group (a worker running as
# another user of the same group, e.g. a pod's fsGroup), never by other users. Files 0640, folders 0750.
RUN_FILE_MODE = 0o640
RUN_UMASK = 0o027


def restrict_umask() -> int:
    """Make every file and folder this process (and what it starts) creates at most 0640 / 0750, whatever
    library creates it (safetensors, torch.save, vLLM's caches); a stricter umask the user set is kept. The
    umask before."""
    before = os.umask(RUN_UMASK)
    os.umask(before | RUN_UMASK)
    return before


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def write_atomic(path: Path, data: bytes, mode: int = RUN_FILE_MODE) -> None:
    """Replace `path` with `data`: after a crash it holds the old bytes or the new, whole. The temporary file
    is created with `mode` (0600 for a file holding secrets), never readable wider even for a moment."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def publish_folder(tmp: Path, final: Path) -> None:
    """Rename the flat folder `tmp`, written in full, onto `final` (which must not exist), durably: its files
    and its own entries first, then the rename in the parent folder."""
    tmp, final = Path(tmp), Path(final)
    for path in tmp.iterdir():
        if path.is_file():
            fsync_file(path)
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)
