"""Idle experiments paged out of the learner's memory, and back in on their next verb.

Each experiment the learner holds costs its LoRA weights inside the shared peft model, a DeepSpeed engine with
ZeRO's fp32 copy and gradient buffers, AdamW's two moments, and two saved versions' weights for the push check
(learner/previous_version.py): about 120 MiB for SmolLM2-135M at r=16 (the learner's RSS 2.0 GiB at 1, 3.9 at 16:
BENCHMARKS.md's tenants table). A tenant that has not trained for a week cost as much as a busy one. So at most
`learner.resident_experiments` are held; past that, the least recently used one is paged out, and so is one that no
verb reached for `learner.page_out_idle_s` (the idle pager, learner/app.py):

  * its state is written as a checkpoint at its current step (learner/checkpoint.py: the weights, AdamW's moments
    and ZeRO's fp32 partition, exactly), the same files a restart resumes from, and waited for; one never trained
    since it was added writes none: the version folder it was added from and an AdamW with no state are its state;
  * its engine and its saved versions' copies are dropped, and its peft adapter too, or kept as a spare for the next
    page-in (SPARE_ADAPTERS at most); a small record stays (step, version, journal position, which versions the
    push check held).

Its next verb pages it back in: an adapter (a spare, else a new one) and a new engine, the checkpoint's weights and
optimizer state loaded into them (bit-exact: tests/test_learner_paging.py compares the weights and the AdamW moments
with a learner that never paged), and the push check's versions read back from their version folders. Measured on
the 2-core box with SmolLM2 at r=16: BENCHMARKS.md's tenants table (`page_in_s`), and docs/benchmarks/findings.md
"Many tenants" for what each of these costs.

There is no middle tier in CPU memory: on a CPU host the learner's memory is CPU memory, and on a GPU host the
checkpoint's write is the same one a restart needs anyway.

Never paged: an experiment holding Tinker `forward_backward` gradients (they live in ZeRO's buffers, which a
checkpoint does not hold); while every resident one holds some, the learner holds one more than the setting
until one steps. With several ranks nothing is paged: paging is a collective (the checkpoint's optimizer shards),
and the read-only verbs (logprobs, forward) run on rank 0 alone (learner/lockstep.py).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo_server.protocol.errors import ApiError, NotFound
from grpo_server.protocol.worker_config import LearnerConfig, LoraConfig
from learner import adapter_io, checkpoint, resume
from learner.adapter_state import AdapterUnderTraining
from learner.checkpoint_writer import CheckpointWriter
from learner.engine import make_engine, release_engine
from learner.previous_version import SavedWeights

log = logging.getLogger(__name__)


def release_freed_memory() -> None:
    """Free what paged-out experiments left, and hand it back to the system.

    A released DeepSpeed engine is in a reference cycle (its ZeRO optimizer's backward-hook state holds the engine's
    bound hook), so its optimizer state and buffers go only at a full collection: 1.0 of the 1.3 GiB a learner still
    allocated with no experiment resident, after 64 of SmolLM2's had been paged out. A full collection costs ~0.4 s
    then, so it runs here, at most once per idle pager round, not at each page-out. Then the allocator's free pages:
    tcmalloc (the workers' allocator where the system has it, grpo_server/workers/allocator.py) keeps the pages of
    freed spans, glibc the top of its heap, each in the learner's RSS until later allocations reuse them."""
    gc.collect()
    process = ctypes.CDLL(None)
    for symbol in ("MallocExtension_ReleaseFreeMemory", "malloc_trim"):
        release = getattr(process, symbol, None)
        if release is not None:
            release(*([0] if symbol == "malloc_trim" else []))
            return


SPARE_ADAPTERS = 2  # paged-out experiments' peft adapters kept for the next page-ins (~20 MiB each: SmolLM2, r=16)


@dataclass
class PagedOut:
    """What stays in memory of a paged-out experiment: its record without engine and weights, and which versions
    the push check held (read back from their folders at page-in)."""

    exp: AdapterUnderTraining
    saved_version: int | None
    previous_version: int | None
    paged_at_s: float
    # Set when nothing moved its weights or optimizer in this life (`_page_out`): its state is this version's folder
    # and an AdamW not yet stepped, read back from there. Else its checkpoint at its step.
    from_version: int | None = None


class Paging:
    """A mixin of MultiAdapterTrainer: `_resident(name)` is its `_get`, paging in and out as needed."""

    # What it uses of its host, MultiAdapterTrainer (and its other mixins).
    config: LearnerConfig
    model: Any  # the PeftModel
    dtype: torch.dtype
    rank: int
    world_size: int
    experiments: dict[str, AdapterUnderTraining]  # resident, least recently used first
    _paged: dict[str, PagedOut]
    _lora_configs: dict[str, LoraConfig]
    _saved: dict[str, SavedWeights]
    _checkpoints: CheckpointWriter
    _start_checkpoint: Callable[[str], None]
    _peft_config: Callable[[LoraConfig], Any]
    _add_peft_adapter: Callable[[str, Any], None]
    _activate: Callable[[str, list[torch.nn.Parameter]], None]
    _delete_peft_adapter: Callable[[str], None]
    _adapter_parameters: Callable[[str], list[tuple[str, torch.nn.Parameter]]]

    _spares: dict[str, list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]]  # by LoraConfig (_keep_spare)
    _spare_names = 0
    _page_outs_released = 0  # page_outs at the newest release_freed_memory
    page_ins = 0
    page_outs = 0
    # Seconds the learner's verbs ran, summed (learner/app.py counts them): the idle rule counts an experiment's
    # idle time in the learner's spare time only.
    verb_seconds = 0.0
    last_page_in_s: float | None = None
    last_page_out_s: float | None = None

    @property
    def resident_limit(self) -> int | None:
        """How many experiments are held in memory at most; None: all (several ranks)."""
        return self.config.resident_experiments if self.world_size == 1 else None

    def _resident(self, name: str) -> AdapterUnderTraining:
        """The experiment, in memory (paged in if it was out), marked most recently used. NotFound if unknown."""
        exp = self.experiments.pop(name, None)
        if exp is None:
            if name not in self._paged:
                raise NotFound(f"experiment {name!r} is not loaded in the learner")
            exp = self._page_in(name)
        self.experiments[name] = exp  # to the end: most recently used
        exp.used_at_s, exp.busy_at_use_s = time.monotonic(), self.verb_seconds
        self._paged.pop(name, None)  # after: `status`, which reads both without the lock, sees it in one or both
        self._page_out_beyond_limit(keep=name)
        return exp

    def _page_out_beyond_limit(self, keep: str | None = None) -> None:
        """Page out the least recently used experiments while more than the limit are held (not `keep`, nor one
        holding Tinker gradients)."""
        limit = self.resident_limit
        if limit is None or len(self.experiments) <= limit:  # every verb asks: the usual answer costs nothing
            return
        for name in list(self.experiments):
            if len(self.experiments) <= limit:
                return
            exp = self.experiments[name]
            if name != keep and exp.pending_backwards == 0:
                self._page_out(name)

    def page_out_idle(self) -> int:
        """Page out the experiments no verb reached for `learner.page_out_idle_s` of the learner's spare time (not one
        holding Tinker gradients), then hand the memory freed by every page-out since the last call back to the
        system; how many went. The learner's idle pager calls it under the lock (learner/app.py). Without it the
        least recently used went only past `resident_experiments`, so a tenant idle for a week held its ~100 MiB
        while fewer than that many others trained since.

        Spare time, not wall time: while the learner runs other experiments' verbs back to back, an experiment
        whose next step waits in the front end's queue for its turn is not idle. Counted in wall time, 32 active
        tenants on 2 cores (each waiting a minute or more for its turn) were paged out between their own steps,
        and their page-ins (1.7 s each) made the queue longer still (the tenants benchmark)."""
        idle_s = self.config.page_out_idle_s
        if self.resident_limit is None:
            return 0
        now = time.monotonic()
        idle = [name for name, exp in self.experiments.items()
                if idle_s and self.spare_seconds_since_use(exp, now) >= idle_s and exp.pending_backwards == 0]
        for name in idle:
            self._page_out(name)
        if self.page_outs != self._page_outs_released:
            release_freed_memory()
            self._page_outs_released = self.page_outs
        return len(idle)

    def spare_seconds_since_use(self, exp: AdapterUnderTraining, now: float) -> float:
        """The seconds since `exp`'s latest verb began in which the learner ran no verb."""
        return (now - exp.used_at_s) - (self.verb_seconds - exp.busy_at_use_s)

    def _page_out(self, name: str) -> None:
        started = time.perf_counter()
        exp = self.experiments[name]
        from_version = None
        if exp.checkpointed_changes != exp.changes or exp.checkpointed_step != exp.step:
            if exp.changes == 0 and exp.weights_version is not None and exp.weights_version == exp.version:
                # Never trained or given a state since it was added: the version folder it was added from (its v0,
                # or the one it resumed) holds its weights, and its AdamW has no state yet. A checkpoint would cost
                # a third of a second for nothing: on the tenants benchmark most page-outs were of such experiments,
                # created and not yet used.
                from_version = exp.version
            else:
                self._start_checkpoint(name)  # at its current step, with its optimizer: what the page-in reads
        self._checkpoints.wait()
        saved = self._saved.pop(name, None)
        release_engine(exp.engine)
        self._keep_spare(exp.adapter, self._lora_configs[name])
        exp.engine, exp.params = None, []
        self._paged[name] = PagedOut(exp, None if saved is None else saved.version,
                                     None if saved is None else saved.previous_version, time.monotonic(), from_version)
        del self.experiments[name]  # after: `status`, which reads both without the lock, sees it in one or both
        self.page_outs += 1
        self.last_page_out_s = time.perf_counter() - started
        log.info("%s: paged out at step %d (%.2f s; %d resident, %d paged out)", name, exp.step,
                 self.last_page_out_s, len(self.experiments), len(self._paged))

    def _page_in(self, name: str) -> AdapterUnderTraining:
        started = time.perf_counter()
        paged = self._paged[name]
        exp = paged.exp
        self._checkpoints.wait()
        weights, optimizer = self._paged_state(name, paged)
        exp.adapter, named = self._adapter_for(self._lora_configs[name])
        try:
            params = [p for _, p in named]
            self._activate(exp.adapter, params)
            saved = self._read_saved(name, [n.replace(f".{exp.adapter}.", ".") for n, _ in named], paged)
            resume.load_weights(self.model, exp.adapter, weights, name, exp.version)
            engine = make_engine(self.model, params, exp.algorithm, self.config.zero_stage, self.dtype)
            if optimizer is not None:
                checkpoint.load_optimizer_state(engine.optimizer, optimizer, self.world_size)
        except BaseException:
            self._delete_peft_adapter(exp.adapter)
            raise
        exp.params, exp.engine = params, engine
        if saved is not None:
            self._saved[name] = saved
        self.page_ins += 1
        self.last_page_in_s = time.perf_counter() - started
        log.info("%s: paged in at step %d after %.0f s out (%.2f s)", name, exp.step,
                 time.monotonic() - paged.paged_at_s, self.last_page_in_s)
        return exp

    def _paged_state(self, name: str, paged: PagedOut) -> tuple[dict[str, torch.Tensor], Any]:
        """A paged-out experiment's weights and optimizer state (None: not stepped yet), from where `_page_out`
        left them."""
        exp = paged.exp
        if paged.from_version is not None:
            folder = adapter_io.version_dir(self.config.run_dir, name, paged.from_version)
            if (folder / adapter_io.WEIGHTS_FILE).is_file():
                return adapter_io.read_version(folder).tensors, None
            where = f"its version {paged.from_version}, which it was paged out as, is gone"
        else:
            found = checkpoint.read_latest(self.config.run_dir, name, self.rank, self.world_size)
            if found is not None and found.state.step == exp.step and found.optimizer is not None:
                return found.weights, found.optimizer
            where = f"its checkpoint there is gone (newest: {None if found is None else found.state.step})"
        raise ApiError(f"experiment {name!r} was paged out at step {exp.step}, but {where}; delete and restore it",
                       code="page_in_failed", status=500)

    def _keep_spare(self, adapter: str, lora: LoraConfig) -> None:
        """A paged-out experiment's peft adapter, kept for the next page-in of the same LoRA shape (SPARE_ADAPTERS
        at most, the others deleted). peft's add_adapter walks every module of the shared model several times: half
        of a page-in's 2 s with 32 of SmolLM2's r=16 adapters resident. The page-in writes every weight of it."""
        if sum(len(spares) for spares in self._spares.values()) >= SPARE_ADAPTERS:
            self._delete_peft_adapter(adapter)
            return
        named = self._adapter_parameters(adapter)
        self._spares.setdefault(lora.model_dump_json(), []).append((adapter, named))

    def _adapter_for(self, lora: LoraConfig) -> tuple[str, list[tuple[str, torch.nn.Parameter]]]:
        """A peft adapter of this shape for a page-in, and its parameters by name: a spare one, else a new one."""
        spares = self._spares.get(lora.model_dump_json())
        if spares:
            return spares.pop()
        self._spare_names += 1
        adapter = f"paged_{self._spare_names}"  # not "exp_<name>": another experiment may hold it next
        self._add_peft_adapter(adapter, self._peft_config(lora))
        return adapter, self._adapter_parameters(adapter)

    def _read_saved(self, name: str, keys: list[str], paged: PagedOut) -> SavedWeights | None:
        """The push check's copies of the versions it held, read from their folders: each parameter's tensor by its
        peft key (`keys`, in the parameters' order; what `get_peft_model_state_dict` writes). A version pruned
        meanwhile, or one whose keys do not fit, is left out."""
        copies: dict[int, list[torch.Tensor]] = {}
        for version in (paged.previous_version, paged.saved_version):
            folder = adapter_io.version_dir(self.config.run_dir, name, version) if version is not None else None
            if folder is None or not (folder / adapter_io.WEIGHTS_FILE).is_file():
                continue
            tensors = adapter_io.read_version(folder).tensors
            if all(key in tensors for key in keys):
                copies[version] = [tensors[key].to(self.dtype) for key in keys]
        if paged.saved_version not in copies:
            return None
        previous = paged.previous_version if paged.previous_version in copies else None
        return SavedWeights(paged.saved_version, copies[paged.saved_version], previous,
                            None if previous is None else copies[previous])

    def residency(self) -> dict[str, Any]:
        """How many are held and paged out, and the paging counters (the learner's GET /status, `paging`)."""
        return {"resident": len(self.experiments), "paged_out": len(self._paged), "limit": self.resident_limit,
                "page_ins": self.page_ins, "page_outs": self.page_outs,
                "last_page_in_s": self.last_page_in_s, "last_page_out_s": self.last_page_out_s}
