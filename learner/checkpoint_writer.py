"""Checkpoints written beside the next step: the train verb copies what a checkpoint holds (the adapter's weights,
the optimizer state, the RNG: 5 ms for SmolLM2's r=16 adapter) and answers; a thread of its own writes and
fsyncs the files (learner/checkpoint.py) while the learner goes on to the push and the next step, so no step or
push waits for a disk. torch's DCP (`async_save`) and Megatron write theirs beside training for the same reason:
on a GPU host the write of a large adapter's optimizer state would hold the accelerator idle. On the 2-core CPU
box, where the write takes 0.07 s of a 2-3 s step, the two ways measured within the box's noise
(docs/benchmarks/findings.md "The weight push").

How often (`_checkpoint_due`): after an experiment's first step, then every `checkpoint_every` steps once
`checkpoint_interval_s` (30 s by default) has passed since the last checkpoint started. After every 2-3 s step of
the CPU demo, SmolLM2's r=16 checkpoint (18 MiB of weights, 55 MiB of optimizer state) wrote ~30 MB/s to disk
without pause, on a core the step wants; every 30 s it writes a tenth of that. The journal keeps every group
since, so a crash costs at most that much training again. Rank 0's clock decides for every rank: a checkpoint is
a collective (the optimizer shards).

One write at a time: a new copy waits for the write before it (which had a whole step to finish), so at most
one checkpoint is in flight and its copy is the only memory this costs.

A checkpoint counts once it is on disk: `newly_durable` hands its journal position to the train step that
finds it written (TrainMetrics.checkpointed_journal_seq), and the front end forgets journal entries only up to
there. A crash while a write is in flight leaves the checkpoint before it, and the journal since.

Whatever reads or moves an experiment's checkpoint folder waits for the write in flight first (`wait`): resume
in add_experiment, remove_experiment, the checkpoint verb and the shutdown's checkpoint_all, prune_versions.
A failed write (a full disk) is raised by the next wait: by the checkpoint verb, a page-out, the shutdown's
checkpoint_all. After a step it is logged instead (`_checkpoint_after_step`): the step stands, and a verb that failed
after moving the weights would be sent again onto weights that hold it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from grpo_server.protocol.worker_config import LoraConfig
from learner import checkpoint, ledger, rank_transfer
from learner.adapter_state import AdapterUnderTraining


log = logging.getLogger(__name__)


def copied(tree: Any) -> Any:
    """`tree` with every tensor copied and its dicts, lists and tuples rebuilt; other objects (a DeepSpeed loss
    scaler) shared. An optimizer's `state_dict()` holds its live tensors, which the next step changes."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: copied(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(copied(value) for value in tree)
    return tree


class CheckpointWriter:
    """Rank 0's writer of checkpoints (the other ranks only send it their shards)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._in_flight: Future | None = None
        self._durable: dict[str, int] = {}  # experiment -> journal position of its newest written checkpoint
        self._unwritten_lines: dict[str, list[dict[str, Any]]] = {}  # ledger lines of a write that failed
        self.last_submit_s = 0.0  # what the newest submit cost its caller: the wait for the write before, the copy

    def submit(self, name: str, state: checkpoint.CheckpointState, weights: dict[str, torch.Tensor],
               shards: list[checkpoint.RankShard], ledger_lines: list[dict[str, Any]] | None = None) -> None:
        """Copy the live `weights` and rank 0's shard (`shards[0]`; the others arrived as bytes and are
        copies already) and write them on the writer's thread, after the steps' `ledger_lines` (learner/ledger.py)."""
        started = time.perf_counter()
        ledger_lines = self._unwritten_lines.pop(name, []) + (ledger_lines or [])  # with those a failed write left
        try:
            self.wait()
        except BaseException:  # the write before failed: this one is not started, and its lines wait for the next
            self._unwritten_lines[name] = ledger_lines
            raise
        own = checkpoint.RankShard(copied(shards[0].optimizer), shards[0].rng.clone())
        weights = copied(weights)
        self._in_flight = self._pool.submit(self._write, name, state, weights, [own, *shards[1:]], ledger_lines)
        self.last_submit_s = time.perf_counter() - started

    def wait(self) -> None:
        """Until the write in flight is on disk; its failure is raised here, once."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def newly_durable(self, name: str) -> int | None:
        """The journal position of `name`'s newest checkpoint written since the last call, else None."""
        return self._durable.pop(name, None)

    def _write(self, name: str, state: checkpoint.CheckpointState, weights: dict[str, torch.Tensor],
               shards: list[checkpoint.RankShard], ledger_lines: list[dict[str, Any]]) -> None:
        started = time.perf_counter()
        try:
            try:  # first: once the checkpoint is on disk, its steps are durable, and their lines must be too
                ledger.append(checkpoint.checkpoint_root(self.run_dir, name), ledger_lines)
            except BaseException:
                self._unwritten_lines[name] = ledger_lines
                raise
            checkpoint.write(self.run_dir, name, state, weights, shards)
        except BaseException:
            log.exception("%s: the checkpoint at step %d was not written", name, state.step)
            raise
        self._durable[name] = state.journal_seq
        log.debug("%s: checkpoint at step %d written (%.2f s)", name, state.step, time.perf_counter() - started)


class Checkpointing:
    """A mixin of MultiAdapterTrainer: its checkpoints, started in a verb and written by `_checkpoints`."""

    # What it uses of its host, MultiAdapterTrainer.
    experiments: dict[str, AdapterUnderTraining]  # in memory
    _paged: dict[str, Any]  # paged out (learner/paging.py): their newest checkpoint is their state already
    _lora_configs: dict[str, LoraConfig]
    _checkpoints: CheckpointWriter
    _cpu_group: Any  # torch.distributed's gloo group, with several ranks
    model: Any  # the PeftModel
    rank: int
    world_size: int
    _get: Callable[[str], AdapterUnderTraining]

    def checkpoint(self, name: str) -> None:
        """Write the experiment's durable state (see learner/checkpoint.py); on disk when this returns."""
        if name in self._paged:
            return
        self._get(name)  # NotFound if unknown
        self._start_checkpoint(name)
        self._checkpoints.wait()

    def checkpoint_all(self) -> None:
        """At shutdown: every experiment that trained since its last checkpoint; on disk when this returns."""
        for name, exp in list(self.experiments.items()):
            if exp.checkpointed_step != exp.step:
                self._start_checkpoint(name)
                log.info("%s: checkpoint at step %d on shutdown", name, exp.step)
        self._checkpoints.wait()

    def wait_for_checkpoints(self) -> None:
        """Until the checkpoint in flight is on disk (before anything reads or moves checkpoint folders)."""
        self._checkpoints.wait()

    def _checkpoint_due(self, exp: AdapterUnderTraining) -> bool:
        """After a train step: every `checkpoint_every` steps once `checkpoint_interval_s` has passed since the
        last checkpoint started, or at once if the experiment has none since its add. Rank 0's clock decides for
        every rank: the checkpoint is a collective."""
        algo = exp.algorithm
        due = exp.step % algo.checkpoint_every == 0 and (
            # Without a checkpoint a restart would resume the newest version's weights and the journal from its
            # start, training its groups twice (learner/resume.py).
            exp.checkpointed_step < 0 or time.monotonic() - exp.checkpoint_started_s >= algo.checkpoint_interval_s)
        if self.world_size == 1:
            return due
        flag = torch.tensor([int(due)])
        dist.broadcast(flag, src=0, group=self._cpu_group)
        return bool(flag.item())

    def _start_checkpoint(self, name: str) -> None:
        """Every rank sends its shard to rank 0, which copies them and hands them to the writer (`name` is in
        memory: its verb or its page-out holds it)."""
        from peft import get_peft_model_state_dict

        exp = self.experiments[name]
        shards = self._gather_shards(checkpoint.RankShard(exp.engine.optimizer.state_dict(), torch.get_rng_state()))
        lines = exp.ledger.take()  # on every rank: rank 0's go to disk (kept by the writer if it fails), the others'
        if self.rank == 0:
            weights = get_peft_model_state_dict(self.model, adapter_name=exp.adapter, save_embedding_layers=False)
            state = checkpoint.CheckpointState(
                step=exp.step, version=exp.version, journal_seq=exp.journal_seq, groups_trained=exp.groups_trained,
                lora=self._lora_configs[name].model_dump(mode="json"), algorithm=exp.algorithm.model_dump(mode="json"),
                ranks=self.world_size)
            self._checkpoints.submit(name, state, weights, shards, lines)
        exp.checkpointed_step = exp.step
        exp.checkpointed_changes = exp.changes
        exp.checkpoint_started_s = time.monotonic()

    def _checkpoint_after_step(self, exp: AdapterUnderTraining) -> None:
        """After a step has moved the weights, a checkpoint if one is due. Its failure (a full disk, raised here by
        the write before it) must not fail the step's verb: the caller would take the step as not taken and send it
        again, onto weights that hold it. The step stands; it becomes durable with the next checkpoint that is
        written (the front end's journal keeps its groups until then), and the failure is logged."""
        if not self._checkpoint_due(exp):
            return
        try:
            self._start_checkpoint(exp.name)  # written beside what follows
        except Exception:
            log.exception("%s: no checkpoint at step %d (the step stands; the next checkpoint will hold it)",
                          exp.name, exp.step)

    def _gather_shards(self, own: checkpoint.RankShard) -> list[checkpoint.RankShard]:
        """Every rank's shard on rank 0 (in rank order; an empty list elsewhere). They cross as bytes, read
        back as data (checkpoint.decode_shard), not pickled objects: no code runs on rank 0 from what crossed
        the wire. Rank 0 keeps its own as it is (it sends nothing); the others' arrive on the CPU."""
        if self.world_size == 1:
            return [own]
        payload = b"" if self.rank == 0 else checkpoint.encode_shard(own)
        received = rank_transfer.gather_to_first(payload, self.rank, self.world_size, self._cpu_group)
        return [own, *map(checkpoint.decode_shard, received[1:])] if self.rank == 0 else []
