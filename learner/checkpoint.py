"""Durable training state per experiment: `run_dir/checkpoints/{name}/step{step:08d}/`.

A checkpoint is everything a learner needs to continue an experiment as if it had never stopped:
  * `adapter_model.safetensors`: the adapter's weights (peft keys, as in a version folder);
  * `optimizer.pt`: the optimizer's state (AdamW moments and step counts, plus ZeRO's fp32 partition);
  * `rng.pt`: torch's random state (LoRA dropout draws from it);
  * `state.json`: step, newest adapter version, the feedback journal's sequence number trained through,
    groups trained, and the experiment's LoRA / algorithm config.
There is no learning-rate scheduler (the rate is constant), so there is no scheduler state.

A checkpoint is written into a temporary sibling folder and renamed into place, so a crash mid-write
leaves the previous checkpoint as the newest whole one. The newest `KEEP` are kept.

DeepSpeed's own `save_checkpoint` is not used: it writes the module's state dict, which for a peft
model with tied embeddings holds the whole embedding matrix (113 MB for SmolLM2-135M) per checkpoint.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

KEEP = 2
WEIGHTS_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
_STEP_RE = re.compile(r"^step(\d{8,})$")


@dataclass
class CheckpointState:
    step: int
    version: int  # the newest adapter version when it was written
    journal_seq: int  # feedback journal entries up to this one are in these weights (or were dropped)
    groups_trained: int
    lora: dict[str, Any]
    algorithm: dict[str, Any]


@dataclass
class Checkpoint:
    state: CheckpointState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor


def checkpoint_root(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "checkpoints" / name


def list_steps(run_dir: Path, name: str) -> list[int]:
    root = checkpoint_root(run_dir, name)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for child in root.iterdir() if (m := _STEP_RE.match(child.name))
             and (child / STATE_FILE).is_file()]
    return sorted(steps)


def write(run_dir: Path, name: str, state: CheckpointState, weights: dict[str, torch.Tensor],
          optimizer_state: dict[str, Any]) -> Path:
    root = checkpoint_root(run_dir, name)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step{state.step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file({k: v.detach().to("cpu").clone().contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS_FILE))
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        torch.save(torch.get_rng_state(), tmp / RNG_FILE)
        # state.json last: list_steps only counts folders that have it.
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2, sort_keys=True))
        for path in tmp.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        if final.exists():  # the same step again (a resumed learner re-saving): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_steps(run_dir, name)[:-KEEP]:
        shutil.rmtree(root / f"step{old:08d}", ignore_errors=True)
    return final


def read_latest(run_dir: Path, name: str) -> Checkpoint | None:
    steps = list_steps(run_dir, name)
    if not steps:
        return None
    folder = checkpoint_root(run_dir, name) / f"step{steps[-1]:08d}"
    state = CheckpointState(**json.loads((folder / STATE_FILE).read_text()))
    return Checkpoint(state=state, weights=load_file(str(folder / WEIGHTS_FILE)),
                      optimizer=torch.load(folder / OPTIMIZER_FILE, weights_only=False),
                      rng=torch.load(folder / RNG_FILE, weights_only=False))


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Into a torch optimizer, or into DeepSpeed's ZeRO / bf16 wrappers, which take one state per
    data-parallel rank and, with `load_from_fp32_weights`, restore their fp32 master copy from it."""
    if "state_dict_list" in inspect.signature(optimizer.load_state_dict).parameters:
        optimizer.load_state_dict([state], load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(state)
