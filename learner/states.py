"""Tinker's saved states on disk: `run_dir/checkpoints/{name}/states/{label}/`, a checkpoint folder each.

A state is the files of a checkpoint (learner/checkpoint.py: weights, state.json, and the optimizer and RNG shards
unless saved without them), written by the same `write_folder` (temporary sibling, fsync, rename), so a crash
leaves the previous state of that label or none, never half of one. They live under the experiment's checkpoint
folder so that archiving or resuming the experiment (learner/app.py) moves them with it, and beside its steps,
which `list_steps`, the pruning of old checkpoints and resume never mistake them for. Only rank 0 calls these.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from grpo_server.protocol.durable import fsync_dir
from grpo_server.protocol.errors import ApiError, BadRequest, Conflict, NotFound
from grpo_server.protocol.wire import STATE_LABEL, SavedState, SavedStates
from learner import checkpoint

STATES = "states"
_LABEL = re.compile(STATE_LABEL)


def states_root(run_dir: Path, name: str) -> Path:
    return checkpoint.checkpoint_root(run_dir, name) / STATES


def state_dir(run_dir: Path, name: str, label: str) -> Path:
    # The wire model checked the label already; checked again because it becomes a path.
    if not _LABEL.fullmatch(label):
        raise BadRequest(f"{label!r} is not a state label ({STATE_LABEL})")
    return states_root(run_dir, name) / label


def write(run_dir: Path, name: str, label: str, state: checkpoint.CheckpointState, weights: dict[str, torch.Tensor],
          shard: checkpoint.RankShard | None, overwrite: bool = False) -> SavedState:
    """Save state `label` of `name` (replacing one of that label only with `overwrite`); `shard` None: without the
    optimizer."""
    folder = state_dir(run_dir, name, label)
    if not overwrite and (folder / checkpoint.STATE_FILE).is_file():
        raise Conflict(f"experiment {name!r} has a saved state {label!r} already (overwrite it, or pick another "
                       f"label)", code="state_exists")
    folder.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_folder(folder, state, weights, None if shard is None else [shard])
    return describe(run_dir, name, label)


def read(run_dir: Path, name: str, label: str, ranks: int = 1) -> checkpoint.Checkpoint:
    """State `label` of `name` (its optimizer None when saved without it or by another number of ranks)."""
    folder = state_dir(run_dir, name, label)
    if not (folder / checkpoint.STATE_FILE).is_file():
        raise NotFound(f"experiment {name!r} has no saved state {label!r}", code="state_not_found")
    return checkpoint.read_folder(folder, 0, ranks, optimizer_optional=True)


def describe(run_dir: Path, name: str, label: str) -> SavedState:
    folder = state_dir(run_dir, name, label)
    state_file = folder / checkpoint.STATE_FILE
    if not state_file.is_file():
        raise NotFound(f"experiment {name!r} has no saved state {label!r}", code="state_not_found")
    state = json.loads(state_file.read_text())
    return SavedState(name=name, label=label, path=str(folder.resolve()), step=int(state["step"]),
                      with_optimizer=(folder / checkpoint.OPTIMIZER_FILE).is_file(),
                      saved_at=state_file.stat().st_mtime, lora=state["lora"])


def listing(run_dir: Path, name: str) -> SavedStates:
    """Every whole state of `name`, oldest first (a temporary folder of a write in progress or cut short is not one)."""
    root = states_root(run_dir, name)
    labels = [child.name for child in root.iterdir() if _LABEL.fullmatch(child.name)
              and (child / checkpoint.STATE_FILE).is_file()] if root.is_dir() else []
    return SavedStates(states=sorted((describe(run_dir, name, label) for label in labels),
                                     key=lambda s: (s.saved_at, s.label)))


def delete(run_dir: Path, name: str, label: str) -> SavedState:
    saved = describe(run_dir, name, label)
    shutil.rmtree(state_dir(run_dir, name, label))
    fsync_dir(states_root(run_dir, name))
    return saved


def check_same_shape(saved_lora: dict, lora: dict, source: str, label: str, name: str) -> None:
    """A state loads only into an adapter of its shape and scaling (rank, alpha, target modules)."""
    def shape(config: dict) -> dict:
        targets = sorted(config.get("target_modules") or [])
        return {"r": config.get("r"), "alpha": config.get("alpha"), "target_modules": targets}

    if shape(saved_lora) != shape(lora):
        raise ApiError(f"state {label!r} of {source!r} is an adapter of {shape(saved_lora)}, but {name!r} has "
                       f"{shape(lora)}", code="adapter_mismatch", status=409)
