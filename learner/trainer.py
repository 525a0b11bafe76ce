"""The learner's model: one base model, one LoRA adapter + DeepSpeed engine + optimizer per experiment.

The base model is loaded once. The first experiment wraps it with `get_peft_model`, later ones
`add_adapter` into the same PeftModel. peft's `set_adapter` flips `requires_grad`, and every engine
shares the module, so the active adapter and the trainable flags are set again before every use.

Adapter versions live on disk (learner/adapter_io.py), and so do checkpoints (learner/checkpoint.py):
weights, optimizer state, RNG, step and the feedback journal's position, after the first step, then every
`checkpoint_every` steps once `checkpoint_interval_s` has passed (written beside the next step:
learner/checkpoint_writer.py), and at shutdown; the front end's journal holds the groups trained since
(retrained after a crash). Adding an experiment whose
name has either on disk resumes it (learner/resume.py: from its newest checkpoint exactly, else from its
newest version's weights); version numbers always continue past the newest on disk (a deleted experiment's
are archived: learner/app.py).

With N ranks (learner/ranks.py, learner/lockstep.py) every rank holds the same trainer and runs the same
state-changing verbs in the same order; a train step splits the batch's sequences over the ranks
(learner/sharding.py) and DeepSpeed reduces their gradients. Only rank 0 writes adapter versions and
checkpoints (the weights are replicated; the optimizer shards of ZeRO-1/2 are gathered to it).

Tinker's training verbs (forward, forward_backward, optim_step, saved states) are learner/steps.py's mixin.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from grpo_server.protocol.worker_config import AlgorithmConfig, LearnerConfig, LoraConfig, resolve_rollout_correction
from grpo_server.protocol.errors import ApiError, BadRequest, Conflict, NotFound
from grpo_server.protocol.wire import AdapterVersion, LogprobsRequest, TrainMetrics, TrainRequest
from learner import adapter_io, checkpoint, ledger, resume
from learner.batching import (MicroBatch, Sequence, check_sequence, gather_completion_logp, make_micro_batches,
                              sampler_gap)
from learner.activation import AdapterSwitch
from learner.adapter_state import AdapterUnderTraining
from learner.checkpoint_writer import Checkpointing, CheckpointWriter
from learner.engine import make_engine, optimizer_step, release_engine, uses_autocast
from learner.metrics import StepStats
from learner.paging import PagedOut, Paging
from learner.policy_loss import (BatchNormalizer, LossSettings, RolloutCorrection, mismatch_kl_split, policy_loss,
                                 token_logprobs)
from learner.shm_op import skip_shm_op
from learner.previous_version import PreviousVersionScoring, SavedWeights
from learner.sharding import RankShare, rank_share
from learner.steps import TinkerSteps

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[a-z0-9_-]{1,64}$")


def torch_dtype_for(name: str, cuda: bool) -> torch.dtype:
    """The torch dtype that `LearnerConfig.dtype` names ("auto": bfloat16 on CUDA, float32 on the CPU)."""
    if name == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# Mixins: Tinker's verbs (learner/steps.py), the previous version's logprobs, the checkpoints, paging.
class MultiAdapterTrainer(TinkerSteps, PreviousVersionScoring, Checkpointing, Paging):
    def __init__(self, config: LearnerConfig):
        import deepspeed

        self.config = config
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        self.dtype = torch_dtype_for(config.dtype, cuda)
        # Train steps under bf16 autocast (float32 weights and AdamW): their logprobs are not the samplers'
        # float32 ones, so the free check is off then; the push check's probe scoring stays float32.
        self.autocast = uses_autocast(config.autocast, self.device, self.dtype, config.dtype)
        skip_shm_op()  # an op for tensor-parallel inference, which would cost a g++ build (learner/shm_op.py)
        deepspeed.init_distributed(dist_backend=None)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Barriers and the checkpoint's optimizer shards go over gloo whatever the training backend is:
        # they carry CPU objects. A collective: every rank builds its trainer.
        self._cpu_group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        base = AutoModelForCausalLM.from_pretrained(str(config.model_path), dtype=self.dtype).to(self.device)
        base.config.use_cache = False
        if config.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.base = base
        self.vocab_size = base.get_input_embeddings().num_embeddings
        # Recorded before peft wraps the layers: the names LoRA may target.
        self.linear_names = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
        self.model: Any = None  # the PeftModel, once the first adapter exists
        self._switch = AdapterSwitch()
        self.experiments: dict[str, AdapterUnderTraining] = {}  # in memory, least recently used first
        self._paged: dict[str, PagedOut] = {}  # paged out to their checkpoints (learner/paging.py)
        self._spares: dict[str, list] = {}  # their peft adapters kept for the next page-in (learner/paging.py)
        self._lora_configs: dict[str, LoraConfig] = {}
        self._saved: dict[str, SavedWeights] = {}  # each experiment's last two saved versions' weights
        self._checkpoints = CheckpointWriter(config.run_dir)  # rank 0's; the others only send it their shards
        log.info("base model %s on %s in %s%s, vocabulary %d, ZeRO stage %d, rank %d of %d", config.model_path,
                 self.device, self.dtype, " (train steps in bf16 autocast)" if self.autocast else "",
                 self.vocab_size, config.zero_stage, self.rank, self.world_size)

    # --- verbs -------------------------------------------------------------------------------------

    def add_experiment(self, name: str, lora: LoraConfig, algorithm: AlgorithmConfig,
                       resync: bool = False) -> AdapterVersion:
        """`resync`: the front end's re-sync after this learner's restart, maybe tried again (its disk was full for
        a later experiment, or an answer was lost to a timeout). One it added already is answered as it stands: no
        verb but the re-sync's reached it since, so that is still the state it resumed."""
        if not _NAME_RE.match(name):
            raise BadRequest(f"experiment name {name!r} must match {_NAME_RE.pattern}")
        if name in self.experiments or name in self._paged:
            if resync:
                return self._version_ref(name, self._get(name).version)
            raise ApiError(f"experiment {name!r} is already loaded in the learner", code="exists", status=409)
        self.wait_for_checkpoints()  # a resume reads the newest one
        missing = sorted(set(lora.target_modules) - self.linear_names)
        if missing:
            raise BadRequest(f"target_modules {missing} are not linear layers of the model "
                             f"(it has {sorted(self.linear_names)})")
        peft_config = self._peft_config(lora)
        algorithm = resolve_rollout_correction(algorithm, self.autocast)  # the front end sends it resolved
        # Read and checked before the model is touched, so that a bad folder fails cleanly.
        found = resume.find_for_every_rank(self.config.run_dir, name, peft_config, self.rank, self.world_size,
                                          self._cpu_group)
        start = found.start()
        if self.rank == 0:  # what was in the ledger after this step was rolled back (learner/ledger.py)
            ledger.resumed(checkpoint.checkpoint_root(self.config.run_dir, name), start.step)
        adapter = f"exp_{name}"
        # LoRA A's init draws from the global generator: seed it per experiment, so an experiment's v0
        # depends on (seed, name), not on which experiments were created before it.
        experiment_seed = self.config.seed * 1_000_003 + zlib.crc32(name.encode())
        torch.manual_seed(experiment_seed)
        self._add_peft_adapter(adapter, peft_config)
        if self.rank > 0:  # the same init on every rank (above); from here each draws its own dropout masks
            torch.manual_seed(experiment_seed + self.rank)
        # Every rank holds its start (rank 0 read the disk for all) before rank 0 writes to it (v0, or a
        # resumed version's new number): a start read after the write would be another version's.
        self._all_ranks_here()
        try:
            params = [p for _, p in self._adapter_parameters(adapter)]
            self._activate(adapter, params)
            if start.weights is not None:
                resume.load_weights(self.model, adapter, start.weights, name, start.loaded_version)
            if start.write_version:
                self._write_version(adapter, name, start.version, start.step, start.journal_seq,
                                    start.groups_trained)
            engine = make_engine(self.model, params, algorithm, self.config.zero_stage, self.dtype)
            found.restore_optimizer(engine, self.world_size, name)
        except BaseException:
            self._delete_peft_adapter(adapter)
            raise
        exp = AdapterUnderTraining(name, adapter, algorithm, params, engine, start.step, start.version,
                                   journal_seq=start.journal_seq, groups_trained=start.groups_trained,
                                   weights_version=start.version, busy_at_use_s=self.verb_seconds)
        if found.resumed is not None:
            exp.checkpointed_step = start.step
            if found.resumed.optimizer is not None:
                exp.checkpointed_changes = exp.changes  # the newest checkpoint holds it exactly
        self.experiments[name] = exp
        self._lora_configs[name] = lora
        self._remember_saved(name)
        log.info("experiment %s: adapter r=%d on %s, from %s at v%d (step %d, journal %d)", name, lora.r,
                 lora.target_modules, found.source, start.version, start.step, exp.journal_seq)
        self._page_out_beyond_limit(keep=name)
        return self._version_ref(name, start.version)

    def train(self, request: TrainRequest) -> TrainMetrics:
        started = time.perf_counter()
        exp = self._get(request.name)
        if request.journal_seq and request.journal_seq <= exp.journal_seq:  # in the weights already
            if exp.last_train is not None and exp.last_train[0] == request.journal_seq:
                log.warning("%s: the batch up to journal entry %d was trained at step %d, and its answer lost (the "
                            "front end timed out): answered again, not trained again", exp.name, request.journal_seq,
                            exp.last_train[1].step)
                return exp.last_train[1]
            raise Conflict(f"experiment {exp.name!r}: journal entries up to {exp.journal_seq} are in its weights "
                           f"already, and this batch ends at {request.journal_seq}", code="batch_already_trained")
        if exp.pending_backwards:  # a batch of its own: it must not step on a Tinker client's summed gradients
            raise Conflict(f"experiment {exp.name!r} holds forward_backward gradients: optim_step first",
                           code="gradients_pending")
        # With LoRA dropout or bf16 autocast the training forward is not the function the samplers serve.
        exact = self._lora_configs[exp.name].dropout == 0 and not self.autocast
        checked = exp.weights_version if exact else None
        seqs = [Sequence(s.prompt_token_ids, s.completion_token_ids, s.sampler_logprobs, s.advantage, s.temperature,
                         checked=s.policy_version == checked and not s.constrained, loss_mask=s.loss_mask,
                         top_p=s.top_p, fresh=s.policy_version == exp.weights_version)
                for s in request.samples]
        for i, seq in enumerate(seqs):
            _check_decoding(seq.temperature, seq.top_p)
            check_sequence(seq, self.vocab_size, self.config.max_model_len, f"samples[{i}]")
        algo = exp.algorithm
        settings = LossSettings(algo.loss, algo.clip_low, algo.clip_high, algo.beta, RolloutCorrection(
            algo.rollout_correction, algo.rollout_is_cap, algo.rollout_mask_low, algo.rollout_mask_high))
        # Whole-batch normalisers on every rank: each rank's loss is its exact share of the batch loss. Tokens
        # are the trained ones (loss_mask 1), as the micro-batches' masks count them.
        norm = BatchNormalizer(num_sequences=len(seqs), num_tokens=sum(sum(s.trained()) for s in seqs),
                               max_tokens=request.max_tokens)
        share = rank_share(seqs, algo.micro_batch_size, self.rank, self.world_size)
        try:
            stats, norm_before_clip = self._accumulate_and_step(exp, share, settings, norm)
        except BaseException:
            if self.world_size == 1:
                # A failure mid-batch (out of memory, say) leaves partial gradients inside ZeRO that the
                # next step would silently add in. The weights have not moved: rebuild the engine from them.
                # (With several ranks the job restarts instead: a rebuild is a collective the other ranks,
                # mid-step, would not join.)
                log.exception("%s: train step failed; resetting its optimizer (AdamW state lost)", exp.name)
                self._reset_engine(exp)
            raise
        exp.step += 1
        exp.changes += 1
        exp.weights_version = None
        exp.groups_trained += request.num_groups
        exp.journal_seq = max(exp.journal_seq, request.journal_seq)
        exp.ledger.record(exp.step, "train", request.journal_seq, request.group_ids, request.passed_over)
        self._checkpoint_after_step(exp)  # written beside what follows (learner/checkpoint_writer.py)
        metrics = stats.metrics(exp.step, [s.reward for s in request.samples], norm_before_clip,
                                time.perf_counter() - started, checked_version=checked, kl_computed=algo.beta > 0)
        metrics.checkpointed_journal_seq = self._checkpoints.newly_durable(exp.name)
        exp.last_train = (request.journal_seq, metrics)
        log.info("%s: step %d, %d sequences in %d micro-batches (+%d padding) on rank %d of %d, loss %.4f, grad "
                 "norm %.4f, %.2f s", exp.name, exp.step, len(seqs), len(share.micro_batches), share.padding_passes,
                 self.rank, self.world_size, metrics.loss, metrics.grad_norm, metrics.seconds)
        return metrics

    def save_adapter(self, name: str) -> AdapterVersion:
        exp = self._get(name)
        lines = exp.ledger.take()  # a restart without a newer checkpoint resumes this version: its steps are durable
        if self.rank == 0:
            try:
                ledger.append(checkpoint.checkpoint_root(self.config.run_dir, name), lines)
            except BaseException:  # a full disk: the lines wait for the next durable write
                exp.ledger.put_back(lines)
                raise
        self._write_version(exp.adapter, name, exp.version + 1, exp.step, exp.journal_seq, exp.groups_trained)
        exp.version += 1
        exp.weights_version = exp.version
        self._remember_saved(name)
        return self._version_ref(name, exp.version)

    def logprobs(self, request: LogprobsRequest) -> list[list[float]]:
        """Per-token logprobs of each completion under the experiment's current adapter, eval mode."""
        exp = self._get(request.name)
        _check_decoding(request.temperature)
        seqs = [Sequence(request.prompt_token_ids, c, [0.0] * len(c), temperature=request.temperature)
                for c in request.completions_token_ids]
        for i, seq in enumerate(seqs):
            check_sequence(seq, self.vocab_size, self.config.max_model_len, f"completions_token_ids[{i}]")
        self._activate(exp.adapter, exp.params)
        self.model.eval()
        out: list[list[float]] = [[] for _ in seqs]
        with torch.no_grad():
            for batch in make_micro_batches(seqs, exp.algorithm.micro_batch_size):
                logp_B_C = self._completion_logp(self.model, batch.to(self.device))
                for row, index in enumerate(batch.indices):
                    out[index] = logp_B_C[row, : len(seqs[index].completion)].tolist()
        return out

    def remove_experiment(self, name: str) -> None:
        """Forget the adapter, its engine and optimizer; its files stay on disk (archived next, on a delete)."""
        self.wait_for_checkpoints()  # its files are whole before anything moves them
        if self._paged.pop(name, None) is not None:  # its state is on disk already (learner/paging.py)
            self._lora_configs.pop(name, None)
            log.info("experiment %s removed while paged out", name)
            return
        exp = self.experiments.get(name)
        if exp is None:
            raise NotFound(f"experiment {name!r} is not loaded in the learner")
        del self.experiments[name]
        self._lora_configs.pop(name, None)
        self._forget_saved(name)
        release_engine(exp.engine)
        self._delete_peft_adapter(exp.adapter)
        log.info("experiment %s removed (its files stay in %s)", name,
                 adapter_io.adapter_root(self.config.run_dir, name))

    def status(self) -> dict[str, dict[str, Any]]:
        held = ([(e, True) for e in list(self.experiments.values())]
                + [(p.exp, False) for p in list(self._paged.values())])
        return {e.name: {"step": e.step, "version": e.version, "resident": resident,
                         "path": str(adapter_io.version_dir(self.config.run_dir, e.name, e.version))}
                for e, resident in held}

    # --- internals ---------------------------------------------------------------------------------

    def _get(self, name: str) -> AdapterUnderTraining:
        """The experiment, in memory: paged back in if it was out (learner/paging.py); NotFound if unknown."""
        return self._resident(name)

    def _version_ref(self, name: str, version: int) -> AdapterVersion:
        path = adapter_io.version_dir(self.config.run_dir, name, version)
        exp = self.experiments[name]
        return AdapterVersion(name=name, version=version, path=str(path.resolve()), step=exp.step,
                              journal_seq=exp.journal_seq, groups_trained=exp.groups_trained,
                              fingerprint=adapter_io.fingerprint(self.config.run_dir, name, version))

    def _peft_config(self, lora: LoraConfig) -> Any:
        from peft import LoraConfig as PeftLoraConfig

        alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
        return PeftLoraConfig(r=lora.r, lora_alpha=alpha, lora_dropout=lora.dropout,
                              target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
                              base_model_name_or_path=str(self.config.model_path))

    def _add_peft_adapter(self, adapter: str, peft_config: Any) -> None:
        from peft import get_peft_model

        if self.model is None:
            self.model = get_peft_model(self.base, peft_config, adapter_name=adapter)
        else:
            self.model.add_adapter(adapter, peft_config)
        self._switch.adapters_changed()

    def _adapter_parameters(self, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
        """`adapter`'s parameters in the shared model, by name, in the model's order (a walk over every parameter)."""
        return [(n, p) for n, p in self.model.named_parameters() if f".{adapter}." in n]

    def _activate(self, adapter: str, params: list[torch.nn.Parameter]) -> None:
        """Route forwards through `adapter` and make only its weights (`params`) trainable (learner/activation.py)."""
        self._switch.activate(self.model, adapter, params)

    def _delete_peft_adapter(self, adapter: str) -> None:
        with warnings.catch_warnings():  # peft warns that the active adapter went; the next verb sets one
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.model.delete_adapter(adapter)
        self._switch.adapters_changed()

    def _write_version(self, adapter: str, name: str, version: int, step: int, journal_seq: int,
                       groups_trained: int) -> None:
        """Rank 0 writes; the other ranks hold the same weights and only count the version."""
        from peft import get_peft_model_state_dict

        if self.rank != 0:
            return
        tensors = get_peft_model_state_dict(self.model, adapter_name=adapter, save_embedding_layers=False)
        config = self.model.peft_config[adapter].to_dict()
        config["inference_mode"] = True  # as peft's save_pretrained writes it
        adapter_io.write_version(adapter_io.version_dir(self.config.run_dir, name, version), config, tensors, step,
                                 journal_seq, groups_trained)

    def _accumulate_and_step(self, exp: AdapterUnderTraining, share: RankShare, settings: LossSettings,
                             norm: BatchNormalizer) -> tuple[StepStats, float]:
        self._activate(exp.adapter, exp.params)
        self.model.train()
        stats = StepStats()
        passes = [(batch, True) for batch in share.micro_batches] + [(share.padding, False)] * share.padding_passes
        for i, (batch, counts) in enumerate(passes):
            batch = batch.to(self.device)
            # Accumulate locally until the last micro-batch, then one step on the summed gradient
            # (learner/engine.py explains why this equals one step on the whole batch).
            exp.engine.set_gradient_accumulation_boundary(i == len(passes) - 1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                ref_logp_B_C = self._reference_logp(batch) if settings.beta > 0 else None
                logp_B_C = self._completion_logp(exp.engine, batch)
            loss, micro_stats = policy_loss(logp_B_C, batch.old_logp_B_C, batch.advantages_B, batch.mask_B_C,
                                            settings, norm, ref_logp_B_C)
            # DeepSpeed AVERAGES gradients over the ranks, and the ranks' shares SUM to the batch gradient:
            # times the world size, the average is that sum. A padding pass adds nothing (learner/sharding.py).
            exp.engine.backward(loss * (self.world_size if counts else 0.0), scale_wrt_gas=False)
            if counts:
                stats.add(loss, {**micro_stats, **sampler_gap(logp_B_C, batch),
                                 **mismatch_kl_split(logp_B_C, batch.old_logp_B_C, batch.mask_B_C, batch.fresh_B)})
        if self.world_size > 1:
            stats.merge_across_ranks(self.device)
        return stats, optimizer_step(exp.engine, exp.params)

    def _all_ranks_here(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self._cpu_group)

    def _reset_engine(self, exp: AdapterUnderTraining) -> None:
        exp.changes += 1  # AdamW starts afresh (and load_state's weights are in)
        release_engine(exp.engine)
        for param in exp.params:
            param.grad = None
            if hasattr(param, "grad_accum"):
                param.grad_accum = None
        self._activate(exp.adapter, exp.params)
        exp.engine = make_engine(self.model, exp.params, exp.algorithm, self.config.zero_stage, self.dtype)

    def _completion_logp(self, forward: Any, batch: MicroBatch) -> torch.Tensor:
        """Completion-token logprobs [B, C] under `forward` (the DeepSpeed engine or the peft model), in the
        distribution the batch was sampled from (its temperature and top_p)."""
        logits_B_K_V = forward(input_ids=batch.input_ids_B_L, attention_mask=batch.attention_mask_B_L,
                               logits_to_keep=batch.logits_to_keep, use_cache=False).logits
        logp_B_K = token_logprobs(logits_B_K_V, batch.targets_B_K, batch.temperature, batch.top_p)
        return gather_completion_logp(logp_B_K, batch)

    def _reference_logp(self, batch: MicroBatch) -> torch.Tensor:
        """The base model's logprobs (adapter switched off, no second model), for the KL penalty."""
        with torch.no_grad(), self.model.disable_adapter():
            return self._completion_logp(self.model, batch)


def _check_decoding(temperature: float, top_p: float = 1.0) -> None:
    if not temperature > 0:
        raise BadRequest(f"temperature must be > 0 to score tokens, got {temperature}")
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")

