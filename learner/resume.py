"""Where an added experiment starts: what an earlier learner left on disk under its name, checked and restored.

An experiment's adapter versions (learner/adapter_io.py) and checkpoints (learner/checkpoint.py) outlive
the learner. Adding an experiment whose name has a checkpoint (a restarted learner or server, an
experiment resumed from its archive: grpo_server/protocol/archive.py) resumes from the newest one exactly:
weights, optimizer state, RNG, step and the feedback journal's position (a deleted experiment's files are
archived, so a new experiment of its name finds none here). One with versions but no checkpoint (a learner
stopped before its first checkpoint reached the disk, or one removed) resumes the newest version's weights and
journal position with a fresh optimizer; one
with neither starts at v0, the peft init. Version numbers always continue past the newest on disk: no
number is ever written twice under one experiment's life.

`find` reads and checks what is on disk before the trainer touches its model, so an adapter of another
shape fails cleanly (409 adapter_mismatch); `OnDisk.start` says which weights to load and which version
to write; `load_weights` and `OnDisk.restore_optimizer` put them into the trainer's model and engine.
"""

from __future__ import annotations

import io
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_server.protocol.errors import ApiError
from learner import adapter_io, checkpoint, rank_transfer
from learner.lockstep import Outcome
from learner.plain_data import load_data, save_data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """The step and version an experiment starts at, and how its adapter gets there."""

    step: int
    version: int
    weights: dict[str, torch.Tensor] | None  # to load into the adapter; None: keep the peft init
    loaded_version: int | None  # the version `weights` are named after (for errors)
    write_version: bool  # write `version` from the adapter's weights once they are in place
    journal_seq: int = 0  # the newest feedback-journal entry the weights include: the front end replays the rest
    groups_trained: int = 0


@dataclass(frozen=True)
class OnDisk:
    """What an earlier learner left under an experiment's name."""

    latest: int | None  # the newest adapter version's number
    saved: adapter_io.SavedVersion | None  # the newest version's peft config, weights, step, journal position
    resumed: checkpoint.Checkpoint | None  # the newest checkpoint, with this rank's shard

    @property
    def source(self) -> str:
        if self.resumed is not None:
            return "checkpoint"
        return "fresh" if self.saved is None else "newest version"

    def start(self) -> Start:
        if self.saved is None and self.resumed is None:
            return Start(step=0, version=0, weights=None, loaded_version=None, write_version=True)
        if self.resumed is None:
            # No checkpoint yet (the learner stopped before its first reached the disk, or it was removed): the
            # newest version and the journal position it records, so no group is trained twice; AdamW starts over.
            return Start(step=self.saved.step, version=self.latest, weights=self.saved.tensors,
                         loaded_version=self.latest, write_version=False, journal_seq=self.saved.journal_seq,
                         groups_trained=self.saved.groups_trained)
        step, version = self.resumed.state.step, max(self.resumed.state.version, self.latest or 0)
        # Versions pushed after the checkpoint lost their steps: the resumed weights are served under a new
        # number, so that the samplers and the learner agree again.
        moved_on = self.saved is None or self.saved.step != step
        return Start(step=step, version=version + 1 if moved_on else version, weights=self.resumed.weights,
                     loaded_version=version, write_version=moved_on, journal_seq=self.resumed.state.journal_seq,
                     groups_trained=self.resumed.state.groups_trained)

    def restore_optimizer(self, engine: Any, world_size: int, name: str) -> None:
        """The checkpoint's optimizer state and RNG into a new engine, when it was written by as many ranks."""
        if self.resumed is None:
            return
        if self.resumed.optimizer is not None:
            checkpoint.load_optimizer_state(engine.optimizer, self.resumed.optimizer, world_size)
            torch.set_rng_state(self.resumed.rng)
        else:
            log.warning("%s: the checkpoint at step %d was written by %d learner ranks, this learner has %d: "
                        "resuming its weights with a fresh optimizer", name, self.resumed.state.step,
                        self.resumed.state.ranks, world_size)


def find(run_dir: Path, name: str, peft_config: Any, rank: int, world_size: int) -> OnDisk:
    """The newest version and checkpoint of `name`, each checked against the adapter asked for."""
    latest = adapter_io.latest_version(run_dir, name)
    saved = None
    if latest is not None:
        saved = adapter_io.read_version(adapter_io.version_dir(run_dir, name, latest))
        check_compatible(saved[0], peft_config, name, latest)
    resumed = checkpoint.read_latest(run_dir, name, rank, world_size)
    if resumed is not None:
        check_compatible(resumed.state.lora | {"lora_alpha": resumed.state.lora.get("alpha")}, peft_config,
                         name, resumed.state.version)
    return OnDisk(latest, saved, resumed)


def find_for_every_rank(run_dir: Path, name: str, peft_config: Any, rank: int, world_size: int,
                        group: Any) -> OnDisk:
    """`find`, read by rank 0 alone and handed to every rank (its own checkpoint shard each): ranks on other
    hosts may not see this run directory (docs/multi-host.md), and only rank 0 writes it. A collective over the
    CPU (gloo) `group`: every rank calls it at the same point of `add_experiment`; an error reading or checking
    is raised on all alike. What crosses is data (`_share_bytes`), never a pickled object."""
    if world_size == 1:
        return find(run_dir, name, peft_config, rank, world_size)
    if rank > 0:
        return _share_from_bytes(rank_transfer.scatter_from_first(None, rank, world_size, group))
    try:
        mine = find(run_dir, name, peft_config, 0, world_size)
        payloads = [b""] + [_share_bytes(OnDisk(mine.latest, mine.saved, checkpoint.read_latest(run_dir, name, r,
                                                                                                world_size)))
                            for r in range(1, world_size)]
    except Exception as exc:  # the same error on every rank: an ApiError is then a normal answer
        rank_transfer.scatter_from_first([_share_bytes(None, exc)] * world_size, 0, world_size, group)
        raise
    rank_transfer.scatter_from_first(payloads, 0, world_size, group)
    return mine


def _share_bytes(found: OnDisk | None, error: BaseException | None = None) -> bytes:
    """A rank's share (or rank 0's error, as lockstep's Outcome fields) as plain containers and tensors."""
    resumed = None if found is None else found.resumed
    body = {"error": None if error is None else Outcome.of(0, error).to_wire(),
            "latest": None if found is None else found.latest,
            "saved": None if found is None or found.saved is None else list(found.saved),
            "resumed": None if resumed is None else {"state": asdict(resumed.state), "weights": resumed.weights,
                                                     "optimizer": resumed.optimizer, "rng": resumed.rng}}
    buffer = io.BytesIO()
    save_data(body, buffer)
    return buffer.getvalue()


def _share_from_bytes(data: bytes) -> OnDisk:
    """`_share_bytes` read back as data (plain_data.load_data: weights_only, on the CPU), rank 0's error raised."""
    body = load_data(io.BytesIO(data), map_location="cpu")
    if body["error"] is not None:
        outcome = Outcome.from_wire(body["error"])
        if outcome.api_error is not None:
            code, message, status = outcome.api_error
            raise ApiError(message, code=code, status=status)
        raise RuntimeError(f"rank 0 could not read the experiment's files: {outcome.failure}")
    saved = body["saved"]
    resumed = body["resumed"]
    return OnDisk(body["latest"], None if saved is None else adapter_io.SavedVersion(*saved),
                  None if resumed is None else checkpoint.Checkpoint(
                      checkpoint.CheckpointState(**resumed["state"]), resumed["weights"], resumed["optimizer"],
                      resumed["rng"]))


def check_compatible(saved_config: dict[str, Any], peft_config: Any, name: str, version: int) -> None:
    """What is on disk must have the shape and scaling of the adapter asked for."""
    want = {"r": peft_config.r, "lora_alpha": peft_config.lora_alpha,
            "target_modules": sorted(peft_config.target_modules)}
    have = {"r": saved_config.get("r"), "lora_alpha": saved_config.get("lora_alpha"),
            "target_modules": sorted(saved_config.get("target_modules") or [])}
    if want != have:
        raise ApiError(f"experiment {name!r} has v{version} on disk with {have}, but the request asks for "
                       f"{want}; use another name or remove the old adapters", code="adapter_mismatch", status=409)


def load_weights(model: Any, adapter: str, tensors: dict[str, torch.Tensor], name: str, version: int) -> None:
    """Saved weights into the peft `model`'s `adapter`; every key must fit."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, tensors, adapter_name=adapter)
    missing = [k for k in result.missing_keys if f".{adapter}." in k]
    if missing or result.unexpected_keys:
        raise ApiError(f"{name} v{version} on disk does not fit the adapter: missing {missing[:3]}, "
                       f"unexpected {list(result.unexpected_keys)[:3]}", code="adapter_mismatch", status=409)
