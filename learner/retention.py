"""Which adapter versions stay on the learner's disk (`LearnerOptions.keep_versions`), and the deletion of the rest.

Every push writes a version folder (learner/adapter_io.py); kept forever they fill the disk (20 GB for 1000
pushes of the embedded model's r=16 adapter). After each push the front end sends `prune_versions` with the
versions it still uses: loaded on a sampler (vLLM reads a folder again when the LoRA falls out of its cache,
merged serving at each merge, a restarted sampler at its re-sync) or awaiting a check. The learner adds what
only it knows: the versions its kept checkpoints were written at (the weights a restart resumes from) and its
live version, and the newest `keep_versions`. The split keeps each fact with its owner; the front end holds
no policy and never touches the learner's files (which may be on another host).

Nothing else reads an older version: a restart resumes from the newest version and the newest checkpoint
(learner/resume.py), and version numbers continue past the newest, which is never deleted, so a number is
still never written twice. A download of a deleted version is a 410 `version_pruned` (learner/app.py): a
missing number at or below the newest on disk can only have been pruned.

A folder is renamed to a hidden `.pruned-*` name first (atomic: no reader ever sees a version with one file
gone), then removed, then the parent folder is fsynced (grpo_server/protocol/durable.py), so a deletion the
front end was told about does not come back after a power cut. A crash between the rename and the removal
leaves a `.pruned-*` folder, which the next prune removes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from grpo_server.protocol.durable import fsync_dir
from learner import adapter_io, checkpoint

log = logging.getLogger(__name__)

PRUNED_PREFIX = ".pruned-"


def checkpoint_versions(run_dir: Path, name: str) -> set[int]:
    """The adapter version each kept checkpoint was written at (its `state.json`). All of them, not only the
    newest: should the newest be unreadable, the one before is what an operator falls back to."""
    root = checkpoint.checkpoint_root(run_dir, name)
    versions = set()
    for step in checkpoint.list_steps(run_dir, name):
        try:
            state = json.loads((root / f"step{step:08d}" / checkpoint.STATE_FILE).read_text())
            versions.add(int(state["version"]))
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: keep everything it might name
            log.warning("%s: checkpoint step %d has no readable version; keeping all versions", name, step)
            return set(adapter_io.list_versions(run_dir, name))
    return versions


def to_keep(on_disk: list[int], keep_newest: int, needed: set[int]) -> set[int]:
    """`on_disk` (oldest first) less what may go: the newest `keep_newest` (0: all) and every `needed` one."""
    if keep_newest == 0:
        return set(on_disk)
    return set(on_disk[-keep_newest:]) | (set(on_disk) & needed)


def prune(run_dir: Path, name: str, keep_newest: int, in_use: set[int], live_version: int) -> tuple[list[int],
                                                                                                     list[int]]:
    """Delete the experiment's versions outside `to_keep`; (kept, removed), oldest first."""
    root = adapter_io.adapter_root(run_dir, name)
    on_disk = adapter_io.list_versions(run_dir, name)
    needed = in_use | {live_version} | checkpoint_versions(run_dir, name)
    keep = to_keep(on_disk, keep_newest, needed)
    removed = [v for v in on_disk if v not in keep]
    leftovers = [p for p in root.glob(PRUNED_PREFIX + "*")] if root.is_dir() else []
    for version in removed:
        folder = adapter_io.version_dir(run_dir, name, version)
        hidden = root / f"{PRUNED_PREFIX}{folder.name}-{os.getpid()}"
        os.rename(folder, hidden)
        leftovers.append(hidden)
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    if removed or leftovers:
        fsync_dir(root)
        log.info("%s: pruned versions %s (kept %s)", name, removed, sorted(keep))
    return sorted(keep), removed


def was_pruned(run_dir: Path, name: str, version: int) -> bool:
    """Whether `version` is missing because a prune deleted it: version numbers are contiguous and the newest
    is never pruned, so a missing one at or below the newest on disk was."""
    newest = adapter_io.latest_version(run_dir, name)
    return newest is not None and version <= newest and version not in adapter_io.list_versions(run_dir, name)
