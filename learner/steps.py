"""Tinker's training verbs on the learner: forward, forward_backward, optim_step, and saved states.

`TinkerSteps` is a mixin of learner/trainer.py's MultiAdapterTrainer (it uses the trainer's model, experiments
and engines, and `_get`, `_activate`, `_reset_engine`: the class names each, typed). Losses come from the table
(grpo_server/protocol/loss_table.py, learner/tinker_losses.py), datums are checked and batched by
learner/datums.py, states are written by learner/states.py.

Accumulation. A Tinker client calls forward_backward any number of times, then optim_step; when a backward runs,
nobody knows whether it is the last before a step. So no backward is an accumulation boundary: each runs with
`set_gradient_accumulation_boundary(False)`, under which ZeRO-2 keeps summing every backward's gradient into its
partition buffers and stages 0/1 leave them summed in the parameters' .grad. optim_step then closes the window
the way DeepSpeed's own unmanaged accumulation (`managed_gradient_accumulation: false`, which the native `train`
cannot use: it sets the boundary itself) closes it in step(): boundary on, ZeRO-2's
`finalize_gradient_accumulation_boundary()` (stages 0/1: `allreduce_gradients()`), then one `engine.step()`.
The engine divides nothing (`gradient_accumulation_steps` 1, `scale_wrt_gas=False`) and the losses are sums (or,
for the GRPO family, whole-call shares), so two calls then one step are one call over both calls' datums then
one step; tests/test_learner_steps.py checks that and a plain torch AdamW loop, at ZeRO stages 0, 1 and 2.

Per-step hyperparameters. optim_step's AdamParams go into the optimizer's param groups (lr, betas, eps,
weight_decay) and its grad_clip_norm into the clip DeepSpeed reads at that step (ZeRO-1/2: the optimizer's
`clip_grad`; stage 0: the engine config's `gradient_clipping`); both go back to the experiment's AlgorithmConfig
values afterwards, so its native `train` steps and checkpoints keep what it was created with.

Several ranks: each verb that moves weights or writes optimizer state would need its share of the datums, its
optimizer shard, and a gather of the answers on every rank. Not done yet: those verbs answer 409
`multi_rank_unsupported` before touching anything, and `forward` and the state listing run on rank 0 alone
(learner/lockstep.py), like `logprobs`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from grpo_server.protocol.errors import ApiError, Conflict
from grpo_server.protocol.wire import (DeleteStateRequest, ForwardBackwardOutput, ForwardBackwardRequest,
                                       LoadStateRequest, OptimStepRequest, OptimStepResponse, SavedState, SavedStates,
                                       SaveStateRequest, StatesRequest)
from grpo_server.protocol.worker_config import LearnerConfig, LoraConfig
from learner import checkpoint, resume, states
from learner.adapter_state import AdapterUnderTraining
from learner.datums import DatumBatch, check_request, loss_spec, make_datum_batches, resolve_config, trained_positions
from learner.engine import optimizer_step
from learner.policy_loss import BatchNormalizer, mismatch_kl_sum, token_logprobs
from learner.tinker_losses import LOSS_FUNCTIONS, LossInput, LossOutput, needs_reference


log = logging.getLogger(__name__)

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


class TinkerSteps:
    """Tinker's verbs, one method each, over the trainer's experiments (see the module's docstring)."""

    # What it uses of its host, MultiAdapterTrainer (the last two are Checkpointing's, its other mixin).
    config: LearnerConfig
    model: Any  # the PeftModel
    device: torch.device
    autocast: bool  # the train steps run in bf16 autocast
    vocab_size: int
    world_size: int
    _lora_configs: dict[str, LoraConfig]
    _get: Callable[[str], AdapterUnderTraining]
    _activate: Callable[[str, list[torch.nn.Parameter]], None]
    _reset_engine: Callable[[AdapterUnderTraining], None]
    _checkpoint_after_step: Callable[[AdapterUnderTraining], None]

    # --- verbs -------------------------------------------------------------------------------------

    def forward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        """The loss and each position's logprob under the current weights, without gradient."""
        return self._score(request, backward=False)

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        """As forward, and the loss's gradient added to what earlier calls left since the last optim_step."""
        self._one_rank("forward_backward")
        return self._score(request, backward=True)

    def optim_step(self, request: OptimStepRequest) -> OptimStepResponse:
        self._one_rank("optim_step")
        exp = self._get(request.name)
        if exp.pending_backwards == 0:
            raise Conflict(f"experiment {exp.name!r} has no gradients: no forward_backward since its last step",
                           code="no_gradients")
        adam = request.adam_params
        engine = exp.engine
        kept = _apply_adam(engine, adam)
        try:
            engine.set_gradient_accumulation_boundary(True)
            if engine.zero_optimization_partition_gradients():
                engine.optimizer.finalize_gradient_accumulation_boundary()
            else:
                engine.allreduce_gradients()
            grad_norm = optimizer_step(engine, exp.params)
        except BaseException:
            log.exception("%s: optim_step failed; resetting its optimizer (AdamW state and gradients lost)", exp.name)
            self._drop_gradients(exp)
            raise
        finally:
            _restore_adam(engine, kept)
        exp.pending_backwards = 0
        exp.step += 1
        exp.changes += 1
        exp.weights_version = None
        exp.ledger.record(exp.step, "optim_step")
        # As durable as a native step: checkpointed by the same policy (learner/checkpoint_writer.py), so a
        # restart resumes its AdamW state and step from there, not from the last pushed version.
        self._checkpoint_after_step(exp)
        log.info("%s: optim_step %d, grad norm %.4f (clip %g), lr %g", exp.name, exp.step, grad_norm,
                 adam.grad_clip_norm, adam.learning_rate)
        return OptimStepResponse(step=exp.step, metrics={"grad_norm:mean": grad_norm,
                                                         "learning_rate:mean": adam.learning_rate})

    def save_state(self, request: SaveStateRequest) -> SavedState:
        """The adapter's weights (and its AdamW state, `with_optimizer`) as state `label`; gradients summed since
        the last optim_step are not part of it."""
        from peft import get_peft_model_state_dict

        self._one_rank("save_state")
        exp = self._get(request.name)
        weights = get_peft_model_state_dict(self.model, adapter_name=exp.adapter, save_embedding_layers=False)
        shard = (checkpoint.RankShard(exp.engine.optimizer.state_dict(), torch.get_rng_state())
                 if request.with_optimizer else None)
        state = checkpoint.CheckpointState(
            step=exp.step, version=exp.version, journal_seq=exp.journal_seq, groups_trained=exp.groups_trained,
            lora=self._lora_configs[exp.name].model_dump(mode="json"), algorithm=exp.algorithm.model_dump(mode="json"),
            ranks=self.world_size)
        return states.write(self.config.run_dir, exp.name, request.label, state, weights, shard, request.overwrite)

    def load_state(self, request: LoadStateRequest) -> SavedState:
        """State `label` of `source` (default: the experiment itself) into the live experiment: its weights, and its
        AdamW state when `with_optimizer` (else AdamW starts afresh). Pending gradients are dropped; the
        experiment's own step and version numbers go on. RNG is not restored (it only drives LoRA dropout)."""
        self._one_rank("load_state")
        exp = self._get(request.name)
        source = request.source or exp.name
        saved = states.read(self.config.run_dir, source, request.label, self.world_size)
        states.check_same_shape(saved.state.lora, self._lora_configs[exp.name].model_dump(mode="json"), source,
                                request.label, exp.name)
        if request.with_optimizer and saved.optimizer is None:
            raise Conflict(f"state {request.label!r} of {source!r} was saved without its optimizer (or by "
                           f"{saved.state.ranks} ranks): load it with with_optimizer false", code="no_optimizer_state")
        resume.load_weights(self.model, exp.adapter, saved.weights, source, saved.state.version)
        # A new engine from the loaded weights: ZeRO keeps its own fp32 copy of them, which a load into the module
        # alone would leave behind (its next step would write the old weights back).
        self._drop_gradients(exp)
        if request.with_optimizer:
            checkpoint.load_optimizer_state(exp.engine.optimizer, saved.optimizer, self.world_size)
        exp.weights_version = None
        log.info("%s: loaded state %r of %s (step %d)%s", exp.name, request.label, source, saved.state.step,
                 " with its optimizer" if request.with_optimizer else "")
        return states.describe(self.config.run_dir, source, request.label)

    def list_states(self, request: StatesRequest) -> SavedStates:
        return states.listing(self.config.run_dir, request.name)

    def delete_state(self, request: DeleteStateRequest) -> SavedState:
        return states.delete(self.config.run_dir, request.name, request.label)

    # --- internals ---------------------------------------------------------------------------------

    def _one_rank(self, verb: str) -> None:
        if self.world_size > 1:
            raise ApiError(f"{verb} runs on a one-rank learner only for now (this one has {self.world_size} ranks: "
                           f"set learner.ranks to 1)", code="multi_rank_unsupported", status=409)

    def _drop_gradients(self, exp: AdapterUnderTraining) -> None:
        """Gradients summed inside ZeRO cannot be taken back one call at a time: a fresh engine over the weights."""
        exp.pending_backwards = 0
        self._reset_engine(exp)

    def _score(self, request: ForwardBackwardRequest, backward: bool) -> ForwardBackwardOutput:
        exp = self._get(request.name)
        spec = loss_spec(request.loss_fn)
        config = resolve_config(spec, request.loss_fn_config)
        check_request(request.data, spec, self.vocab_size, self.config.max_model_len)
        norm = (BatchNormalizer(len(request.data), trained_positions(request.data, spec), int(config["max_tokens"]))
                if spec.family == "grpo" else None)
        loss_fn = LOSS_FUNCTIONS[spec.name]
        reference = needs_reference(spec, config)
        self._activate(exp.adapter, exp.params)
        # forward_backward trains in train mode; forward scores the same function, unless LoRA dropout would make
        # train mode random (then eval mode: the function the samplers serve).
        self.model.train(backward or self._lora_configs[exp.name].dropout == 0)
        outputs: list[dict[str, list[float]]] = [{} for _ in request.data]
        totals = _Totals()
        try:
            for batch in make_datum_batches(request.data, exp.algorithm.micro_batch_size):
                batch = batch.to(self.device)
                if backward:
                    exp.engine.set_gradient_accumulation_boundary(False)  # see the module's docstring
                with torch.set_grad_enabled(backward), torch.autocast("cpu", dtype=torch.bfloat16,
                                                                      enabled=self.autocast):
                    ref_logp_B_T = self._datum_reference_logp(batch) if reference else None
                    logp_B_T = self._datum_logp(exp.engine if backward else self.model, batch)
                out = loss_fn(LossInput(logp_B_T, batch.valid_B_T, batch.inputs, config, norm, ref_logp_B_T))
                if backward:
                    exp.engine.backward(out.loss, scale_wrt_gas=False)
                totals.add(out, logp_B_T.detach(), batch)
                for row, index in enumerate(batch.indices):
                    n = batch.lengths[row]
                    outputs[index] = {"logprobs": logp_B_T[row, :n].tolist(),
                                      "elementwise_loss": out.elementwise_B_T[row, :n].tolist()}
        except BaseException:
            if backward:  # this call's part is mixed into the sum of the earlier calls': drop them all
                log.exception("%s: forward_backward failed; its summed gradients and AdamW state are reset", exp.name)
                self._drop_gradients(exp)
            raise
        if backward:
            exp.pending_backwards += 1
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=totals.metrics())

    def _datum_logp(self, forward: Any, batch: DatumBatch) -> torch.Tensor:
        """Each position's logprob of its target [B, T] under `forward` (the engine or the peft model), at
        temperature 1 (Tinker's). Every position's logits are kept: the answer has a logprob per position."""
        logits_B_T_V = forward(input_ids=batch.input_ids_B_T, attention_mask=batch.attention_mask_B_T,
                               use_cache=False).logits
        return token_logprobs(logits_B_T_V, batch.targets_B_T)

    def _datum_reference_logp(self, batch: DatumBatch) -> torch.Tensor:
        """The base model's (adapter off), for the GRPO family's KL penalty."""
        with torch.no_grad(), self.model.disable_adapter():
            return self._datum_logp(self.model, batch)


class _Totals:
    """A call's metrics over its micro-batches, named as Tinker names them ("name:reduction")."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.tokens = 0
        self.clipped = 0
        self.clip_tokens = 0
        self.gap_sum = 0.0
        self.gap_max = 0.0
        self.kl_sum = 0.0
        self.gap_tokens = 0

    def add(self, out: LossOutput, logp_B_T: torch.Tensor, batch: DatumBatch) -> None:
        self.loss += float(out.loss.detach())
        self.tokens += int(out.mask_B_T.sum())
        if out.clipped_B_T is not None:
            self.clipped += int(out.clipped_B_T.sum())
            self.clip_tokens += int(out.mask_B_T.sum())
        sampler_B_T = batch.inputs.get("logprobs")
        if sampler_B_T is not None:
            # Sampler vs learner on the positions with a learning signal (prompt positions hold placeholders).
            mask_B_T = out.mask_B_T
            gap_B_T = torch.where(mask_B_T, (logp_B_T.float() - sampler_B_T).abs(), torch.zeros_like(sampler_B_T))
            self.gap_sum += float(gap_B_T.sum())
            self.gap_max = max(self.gap_max, float(gap_B_T.max()) if gap_B_T.numel() else 0.0)
            self.kl_sum += float(mismatch_kl_sum(logp_B_T, sampler_B_T, mask_B_T))
            self.gap_tokens += int(mask_B_T.sum())

    def metrics(self) -> dict[str, float]:
        metrics = {"loss:sum": self.loss, "num_tokens:sum": float(self.tokens)}
        if self.clip_tokens:
            metrics["clipped_fraction:mean"] = self.clipped / self.clip_tokens
        if self.gap_tokens:
            metrics |= {"sampler_logprob_gap:mean": self.gap_sum / self.gap_tokens,
                        "sampler_logprob_gap:max": self.gap_max, "mismatch_kl:mean": self.kl_sum / self.gap_tokens}
        return metrics


def _apply_adam(engine: Any, adam: Any) -> tuple[list[dict[str, Any]], float, float | None]:
    """This step's AdamW hyperparameters and clip; returns what they replaced (`_restore_adam`)."""
    groups = engine.optimizer.param_groups
    kept = ([{key: group[key] for key in _ADAM_KEYS} for group in groups], engine._config.gradient_clipping,
            getattr(engine.optimizer, "clip_grad", None))
    for group in groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    engine._config.gradient_clipping = adam.grad_clip_norm  # stage 0: engine._take_model_step reads it (0: none)
    if kept[2] is not None:
        engine.optimizer.clip_grad = adam.grad_clip_norm  # ZeRO-1/2: read by its step (0: none)
    return kept


def _restore_adam(engine: Any, kept: tuple[list[dict[str, Any]], float, float | None]) -> None:
    values, clipping, clip_grad = kept
    for group, old in zip(engine.optimizer.param_groups, values):
        group.update(old)
    engine._config.gradient_clipping = clipping
    if clip_grad is not None:
        engine.optimizer.clip_grad = clip_grad
