"""A deleted experiment's files, kept apart from the live ones: `run_dir/archive/{name}-{UTC time}/`.

Deleting an experiment moves what each process keeps under its name there (the learner: its adapter versions
and checkpoints; the front end: its feedback journal and metrics log), so that a new experiment of that name
starts from nothing (version 0, step 0) and no key reaches the old weights through it. `POST /v1/experiments`
with `resume: true`, the admin's explicit choice, moves the newest archive back.

Each process moves only its own entries, under the label the front end picks: where the run directory is
shared one folder holds them all, otherwise each host's folder holds that host's part. Entries are renamed,
not copied (the archive is inside the run directory, so on the same file system), and a folder emptied by
restoring is removed.

Archives are not kept for ever: at each delete, each process removes the oldest beyond the server's
`archives_kept` from its run directory (`prune`), so that a service whose tenants come and go keeps a bounded
disk (the chaos soak's churn filled 3 GiB with 85 of them).
"""

from __future__ import annotations

import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

from grpo_server.protocol.durable import fsync_dir
from grpo_server.protocol.errors import BadRequest, Conflict

ROOT = "archive"
_STAMP = "%Y%m%dT%H%M%S%fZ"
# An experiment name (grpo_server/config.py) and the stamp: the name may itself hold dashes, the stamp may not.
_LABEL = re.compile(r"(?P<name>[a-z0-9_-]{1,64})-(?P<stamp>\d{8}T\d{12}Z)")


def new_label(name: str) -> str:
    """A fresh archive label for `name`: sortable by time, to the microsecond."""
    return f"{name}-{datetime.now(timezone.utc).strftime(_STAMP)}"


def check_label(name: str, label: str) -> str:
    """`label`, if it is an archive label of `name` (a worker gets it over the wire: no path may hide in it)."""
    match = _LABEL.fullmatch(label)
    if match is None or match["name"] != name:
        raise BadRequest(f"{label!r} is not an archive label of experiment {name!r}", code="bad_archive_label")
    return label


def folder(run_dir: Path, label: str) -> Path:
    return Path(run_dir) / ROOT / label


def labels(run_dir: Path, name: str) -> list[str]:
    """The archives of `name` in this run directory, oldest first."""
    root = Path(run_dir) / ROOT
    if not root.is_dir():
        return []
    found = [(m["stamp"], entry.name) for entry in root.iterdir()
             if (m := _LABEL.fullmatch(entry.name)) and m["name"] == name and entry.is_dir()]
    return [label for _, label in sorted(found)]


def newest(run_dir: Path, name: str, entries: dict[str, Path]) -> str | None:
    """The newest archive of `name` that holds any of `entries` (this process's part of it)."""
    holding = [label for label in labels(run_dir, name)
               if any((folder(run_dir, label) / entry).exists() for entry in entries)]
    return holding[-1] if holding else None


def prune(run_dir: Path, keep: int) -> list[str]:
    """Remove every archive of this run directory but the newest `keep` (whatever their names); the labels
    removed. Another process pruning the same shared folder at once removes the same ones: a folder already gone
    is no error."""
    root = Path(run_dir) / ROOT
    if not root.is_dir():
        return []
    found = sorted((m["stamp"], entry.name) for entry in root.iterdir()
                   if (m := _LABEL.fullmatch(entry.name)) and entry.is_dir())
    removed = [label for _, label in found[:max(len(found) - keep, 0)]]
    for label in removed:
        shutil.rmtree(root / label, ignore_errors=True)
    if removed:
        fsync_dir(root)
    return removed


def live(entries: dict[str, Path]) -> bool:
    return any(path.exists() for path in entries.values())


def move_out(run_dir: Path, label: str, entries: dict[str, Path]) -> list[str]:
    """Move each live path of `entries` (its name in the archive -> its live path) into archive `label`;
    returns the entries moved (none: nothing was there, and no folder is made)."""
    target = folder(run_dir, label)
    moved = []
    for entry, path in entries.items():
        if not path.exists():
            continue
        target.mkdir(parents=True, exist_ok=True)
        if (target / entry).exists():
            raise Conflict(f"archive {label!r} already holds {entry!r}", code="archive_exists")
        shutil.move(str(path), str(target / entry))
        fsync_dir(path.parent)
        moved.append(entry)
    if moved:
        fsync_dir(target)
    return moved


def move_back(run_dir: Path, label: str, entries: dict[str, Path]) -> list[str]:
    """Move archive `label`'s entries back to their live paths, which must be free; returns those moved. The
    folder goes once every process has taken its part back."""
    source = folder(run_dir, label)
    present = {entry: path for entry, path in entries.items() if (source / entry).exists()}
    taken = [entry for entry, path in present.items() if path.exists()]
    if taken:  # checked before anything moves: a half-restored experiment would mix two lives
        raise Conflict(f"cannot restore {label!r}: {', '.join(taken)} of a live experiment is in the way",
                       code="archive_conflict")
    for entry, path in present.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(source / entry), str(path))
        fsync_dir(path.parent)
    try:
        source.rmdir()
    except OSError:  # another process's part is still there (a shared run directory), or it never existed
        pass
    return list(present)
