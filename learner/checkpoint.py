"""Durable training state per experiment: `run_dir/checkpoints/{name}/step{step:08d}/`.

A checkpoint is everything a learner needs to continue an experiment as if it had never stopped:
  * `adapter_model.safetensors`: the adapter's weights (peft keys, as in a version folder);
  * `optimizer.pt`: the optimizer's state (AdamW moments and step counts, plus ZeRO's fp32 partition);
  * `rng.pt`: torch's random state (LoRA dropout draws from it);
  * with N learner ranks, also `optimizer.rank{r}.pt` and `rng.rank{r}.pt` for ranks 1..N-1: ZeRO-1/2
    partition the optimizer state over the ranks, and each rank draws its own dropout. Rank 0 gathers
    them and writes the whole checkpoint; a learner resumed on another number of ranks takes the weights,
    step and journal position, and starts AdamW afresh (the partitions no longer fit);
  * `state.json`: step, newest adapter version, the feedback journal's sequence number trained through,
    groups trained, the number of ranks, and the experiment's LoRA / algorithm config.
There is no learning-rate scheduler (the rate is constant), so there is no scheduler state.

A checkpoint is written into a temporary sibling folder, fsynced, and renamed into place (the rename fsynced
too: grpo_server/protocol/durable.py), so a crash mid-write leaves the previous checkpoint as the newest whole
one, and one the front end was told about (it then forgets the journal entries it holds) stays after a power
cut. The newest `KEEP` are kept; once there are that many, the oldest one's folder becomes the next one's
temporary folder and its files are written over (0.07 s against 0.33 s for new files in the learner, median of
15 each: docs/benchmarks/findings.md "The weight push").

The `.pt` files hold plain values only (tensors, numbers, containers: the optimizer state's few DeepSpeed objects
as tagged dicts), so they read back the same on every Python, and are read with `torch.load(weights_only=True)`,
so a file put in the run directory cannot run code in the learner as a pickle could (learner/plain_data.py). The
shards other ranks send rank 0 cross the same way (`encode_shard` / `decode_shard`, carried by
learner/rank_transfer.py), not as pickled objects. A file that cannot be read is a `CheckpointUnreadable` that
names it.

Tinker's saved states (learner/states.py) are folders of the same files, written the same way, under
`run_dir/checkpoints/{name}/states/{label}/`: list_steps and the pruning above never see them, and archiving the
experiment moves them with its checkpoints.

DeepSpeed's own `save_checkpoint` is not used: it writes the module's state dict, which for a peft
model with tied embeddings holds the whole embedding matrix (113 MB for SmolLM2-135M) per checkpoint.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from grpo_server.protocol.durable import publish_folder
from learner.plain_data import load_data, save_data

KEEP = 2
WEIGHTS_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
_STEP_RE = re.compile(r"^step(\d{8,})$")


class CheckpointUnreadable(Exception):
    """A checkpoint's file that cannot be read back (damaged, or not data): the message names the file."""


@dataclass
class CheckpointState:
    step: int
    version: int  # the newest adapter version when it was written
    journal_seq: int  # feedback journal entries up to this one are in these weights (or were dropped)
    groups_trained: int
    lora: dict[str, Any]
    algorithm: dict[str, Any]
    ranks: int = 1  # optimizer and RNG shards: one per learner rank (absent from older checkpoints: 1)


@dataclass
class RankShard:
    """What each rank keeps for itself: its optimizer state (a ZeRO partition) and its random state."""

    optimizer: dict[str, Any]
    rng: torch.Tensor


@dataclass
class Checkpoint:
    state: CheckpointState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None  # this rank's; None when written by another number of ranks
    rng: torch.Tensor | None


def shard_file(base: str, rank: int) -> str:
    """`optimizer.pt` for rank 0 (as with one rank), `optimizer.rank1.pt` for rank 1, ..."""
    if rank == 0:
        return base
    stem, suffix = base.rsplit(".", 1)
    return f"{stem}.rank{rank}.{suffix}"


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
          shards: list[RankShard]) -> Path:
    """Write a checkpoint with one shard per rank (shards[r] is rank r's); keep the newest KEEP."""
    root = checkpoint_root(run_dir, name)
    root.mkdir(parents=True, exist_ok=True)
    steps = list_steps(run_dir, name)
    # Once KEEP are on disk the oldest one's files are written over for this one (`reuse`), not deleted for new
    # ones: a deleted file's page cache is freed, and a VM that hands freed memory back to its host (as the CPU
    # box's does) faults fresh pages in slowly for the next files. The newest stays whole meanwhile.
    reuse = root / f"step{steps[0]:08d}" if len(steps) >= KEEP and state.step not in steps else None
    final = write_folder(root / f"step{state.step:08d}", state, weights, shards, reuse=reuse)
    for old in list_steps(run_dir, name)[:-KEEP]:
        shutil.rmtree(root / f"step{old:08d}", ignore_errors=True)
    return final


def write_folder(final: Path, state: CheckpointState, weights: dict[str, torch.Tensor],
                 shards: list[RankShard] | None, reuse: Path | None = None) -> Path:
    """A checkpoint's files as folder `final` (its parent exists), whole or not at all: written into a temporary
    sibling, fsynced, renamed into place. `shards` None: weights and state only (a state saved without its
    optimizer: learner/states.py). `reuse`: a checkpoint folder beside it to become that sibling, its files
    written over (it stops being a checkpoint the moment it is renamed)."""
    if shards is not None and len(shards) != state.ranks:
        raise ValueError(f"{len(shards)} rank shards for a checkpoint of {state.ranks} ranks")
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if reuse is not None:
        os.rename(reuse, tmp)
        (tmp / STATE_FILE).unlink(missing_ok=True)
    else:
        tmp.mkdir()
    try:
        # Serialized here, before anything returns: live tensors need no copy of their own.
        written: dict[str, Any] = {WEIGHTS_FILE: save_tensors({k: v.detach().to("cpu").contiguous()
                                                               for k, v in weights.items()})}
        for rank, shard in enumerate(shards or []):
            written[shard_file(OPTIMIZER_FILE, rank)] = shard.optimizer
            written[shard_file(RNG_FILE, rank)] = shard.rng
        for file, content in written.items():
            _write_over(tmp / file, content)
        for stale in set(p.name for p in tmp.iterdir()) - set(written):  # a reused folder's other ranks' files
            (tmp / stale).unlink()
        # state.json last: list_steps only counts folders that have it.
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2, sort_keys=True))
        if final.exists():  # the same step again (a resumed learner re-saving): replace it whole
            shutil.rmtree(final)
        publish_folder(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_over(path: Path, content: Any) -> None:
    """`content` (bytes, or data for `torch.save`) as the file's whole content, written over the pages of the
    file there if any (publish_folder fsyncs it)."""
    with open(path, "r+b" if path.is_file() else "wb") as handle:
        if isinstance(content, bytes):
            handle.write(content)
        else:
            save_data(content, handle)
        handle.truncate()


def read_latest(run_dir: Path, name: str, rank: int = 0, ranks: int = 1) -> Checkpoint | None:
    """The newest checkpoint, with rank `rank`'s shard when it was written by `ranks` ranks."""
    steps = list_steps(run_dir, name)
    if not steps:
        return None
    return read_folder(checkpoint_root(run_dir, name) / f"step{steps[-1]:08d}", rank, ranks)


def read_folder(folder: Path, rank: int = 0, ranks: int = 1, optimizer_optional: bool = False) -> Checkpoint:
    """One checkpoint folder; its optimizer and RNG None when written by another number of ranks (or, with
    `optimizer_optional`, saved without them; a checkpoint's missing optimizer file is an error).
    CheckpointUnreadable, naming the file, for one that cannot be read."""
    state = CheckpointState(**_read(folder / STATE_FILE, lambda p: json.loads(p.read_text())))
    weights = _read(folder / WEIGHTS_FILE, lambda p: load_file(str(p)))
    absent = optimizer_optional and not (folder / shard_file(OPTIMIZER_FILE, rank)).is_file()
    if state.ranks != ranks or absent:
        return Checkpoint(state=state, weights=weights, optimizer=None, rng=None)
    return Checkpoint(state=state, weights=weights,
                      optimizer=_read(folder / shard_file(OPTIMIZER_FILE, rank), load_data),
                      rng=_read(folder / shard_file(RNG_FILE, rank), load_data))


def _read(path: Path, read: Any) -> Any:
    try:
        return read(path)
    except Exception as exc:
        raise CheckpointUnreadable(f"cannot read the checkpoint file {path}: {type(exc).__name__}: {exc}") from exc


def encode_shard(shard: RankShard) -> bytes:
    """A rank's shard as bytes for rank 0 (`decode_shard`): `save_data` of its two fields, so it is read with
    `load_data` like the checkpoint files it becomes. CUDA tensors are copied off the device as they are saved."""
    buffer = io.BytesIO()
    save_data({"optimizer": shard.optimizer, "rng": shard.rng}, buffer)
    return buffer.getvalue()


def decode_shard(data: bytes) -> RankShard:
    """`encode_shard`'s shard, on the CPU (a tensor read back on its saved device would land on the sending
    rank's GPU index); UnpicklingError for anything that is not data, ValueError for another shape."""
    body = load_data(io.BytesIO(data), map_location="cpu")
    if not (isinstance(body, dict) and body.keys() == {"optimizer", "rng"} and isinstance(body["optimizer"], dict)
            and isinstance(body["rng"], torch.Tensor)):
        raise ValueError(f"not a rank's shard: {type(body).__name__} {list(body) if isinstance(body, dict) else ''}")
    return RankShard(body["optimizer"], body["rng"])


def load_optimizer_state(optimizer: Any, state: dict[str, Any], ranks: int = 1) -> None:
    """This rank's state into a torch optimizer, or into DeepSpeed's ZeRO / bf16 wrappers, which take a
    list of states indexed by data-parallel rank (each rank reads its own entry from a checkpoint written
    by as many ranks) and, with `load_from_fp32_weights`, restore their fp32 master copy from it."""
    if "state_dict_list" in inspect.signature(optimizer.load_state_dict).parameters:
        optimizer.load_state_dict([state] * ranks, load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(state)
