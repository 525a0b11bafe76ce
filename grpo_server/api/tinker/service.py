"""The Tinker API's state and verbs, on this server's experiments (`routes.py` is the HTTP side; state.py the records
kept here; checkpoints.py the saved states and sampler weights).

A Tinker training model is an experiment: its LoRA adapter, AdamW state, versions and checkpoints are the
learner's as for any experiment, and its requests run through the same learner, samplers and turns. What
Tinker adds is held here:
  * sessions (`create_session`), the key that made each, and the models and samplers made in it;
  * models: `{session_id}:train:{model_seq_id}` (the SDK computes that id itself when it loads a checkpoint
    into a new model), the experiment behind each, and its calls run in `seq_id` order (futures.py);
  * sampler weights: a name (or an unnamed save's sampler) -> the adapter version that save pushed. Any of
    them can be sampled while newer ones exist: a version the samplers unloaded is loaded again.
Who may use what: the admin key makes models on experiments of their own; an experiment's key makes the one
model of its own experiment (its LoRA rank must match). A model, sampler or checkpoint of another key is
unknown to a caller, as other experiments are on the native routes. Sessions and models outlive a restart
(registry.py); samplers and futures do not.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections import Counter, defaultdict
from typing import Awaitable, Callable, TypeVar

from grpo_server.api.route_table import ADMIN
from grpo_server.api.tinker import schema as ts
from grpo_server.api.tinker.checkpoints import CheckpointVerbs
from grpo_server.api.tinker.data import ForwardBackwardOutput, ForwardBackwardRequest
from grpo_server.api.tinker.futures import FutureStore
from grpo_server.api.tinker.registry import TinkerRegistry
from grpo_server.api.tinker.state import Sampler, SamplerWeights, TinkerModel, parse_path
from grpo_server.config import ExperimentConfig
from grpo_server.protocol import wire
from grpo_server.protocol.errors import ApiError, BadRequest, Conflict, NotFound, TooManyRequests
from grpo_server.protocol.worker_config import LoraConfig
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.orchestrator import Orchestrator

log = logging.getLogger(__name__)
T = TypeVar("T")

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# What one key may hold in the front end's memory: beyond, its oldest sessions and samplers are forgotten
# (a forgotten sampler answers not found; its weights stay, and a new sampler on their path serves them).
MAX_SESSIONS_PER_KEY = 256
MAX_SAMPLERS_PER_KEY = 1024
_MLP = ("gate_proj", "up_proj", "down_proj")


QUEUED_CALLS = 4  # forward_backward calls of the largest size one key may have decoded and waiting at once


class Admission:
    """An amount each key's calls hold from their admission until they end (`admit` -> its release), refused with a
    429 at once beyond a cap: the walls that keep one key's queued calls from holding the server's memory or its
    samplers ahead of every other tenant's."""

    def __init__(self, what: str, setting: str, code: str):
        self.what, self.setting, self.code = what, setting, code
        self.held: Counter[str] = Counter()

    def admit(self, owner: str, amount: int, cap: int) -> Callable[[], None]:
        held = self.held[owner]
        if held + amount > cap:
            raise TooManyRequests(f"this key's {self.what} hold {held}, and {amount} more would pass the server's "
                                  f"{self.setting} ({cap}); retry once some have finished", code=self.code,
                                  retry_after=1.0)
        self.held[owner] += amount
        released = False

        def release() -> None:
            nonlocal released
            if not released:  # once, whichever path ends the call
                released = True
                self.held[owner] -= amount
                if self.held[owner] <= 0:
                    del self.held[owner]
        return release


class TinkerService(CheckpointVerbs):
    def __init__(self, orchestrator: Orchestrator, base_model: str, futures: FutureStore):
        self.orchestrator = orchestrator
        self.base_model = base_model
        self.futures = futures
        self.registry = TinkerRegistry(orchestrator.config.run_dir)
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.models: dict[str, TinkerModel] = {}
        self.samplers: dict[str, Sampler] = {}
        # What one key's calls hold from their admission to their end (429 beyond): asample sequences, and the
        # token positions of decoded forward_backward calls.
        self.samples = Admission("sequences of asample calls", "tinker_max_samples_per_key", "too_many_samples")
        self.positions = Admission("token positions of forward_backward calls",
                                   f"{QUEUED_CALLS} x tinker_max_tokens_per_call", "too_many_tokens_queued")
        # The calls queued or running on each experiment (`on_experiment`), and those its delete cancelled.
        self._calls: defaultdict[str, set[asyncio.Task]] = defaultdict(set)
        self._deleted_under: set[asyncio.Task] = set()
        orchestrator.on_delete.append(self.forget_experiment)

    def on_experiment(self, experiment: str | None, work: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
        """`work`, a call admitted for this life of `experiment` (None: no experiment's), as its future runs it.
        A call names its experiment by name when it runs (the learner, the turns, the samplers know no other), so
        one still queued or running when the experiment is deleted would land on the next life of the name,
        maybe another tenant's: the delete cancels it instead (`forget_experiment`), and it fails as
        `model_not_found`."""
        if experiment is None:
            return work

        async def run() -> T:
            task = asyncio.current_task()
            assert task is not None
            calls = self._calls[experiment]
            calls.add(task)
            try:
                return await work()
            except asyncio.CancelledError:
                if task not in self._deleted_under:
                    raise
                raise NotFound(f"experiment {experiment!r} was deleted while this call waited or ran: it did not "
                               "run on what took the name since", code="model_not_found") from None
            finally:
                self._deleted_under.discard(task)
                calls.discard(task)
                if not calls and self._calls.get(experiment) is calls:
                    del self._calls[experiment]
        return run

    async def forget_experiment(self, name: str) -> None:
        """An experiment was deleted: its calls still queued or running are cancelled (`on_experiment`), its
        models (and their external weights' folders), the sessions and samplers its key made, and the samplers on
        its models go too. A new experiment of the name, maybe another tenant's, starts with none of them (its key
        can make its own model again), and nothing of the old life answers it or runs on it."""
        calls = self._calls.pop(name, set())
        for task in calls:
            self._deleted_under.add(task)
            task.cancel()
        if calls:  # before a new life of the name can be made (the orchestrator's delete holds its lock)
            await asyncio.wait(calls, timeout=30)
        self.futures.forget_owner(name)  # its key's results: a new key of the name must not read them
        # Its models' external weights go with them: nothing could list or delete them any more (checkpoints.py).
        for model in [m for m in self.models.values() if m.experiment == name]:
            await asyncio.to_thread(shutil.rmtree, self.external_dir(model), True)
        self.models = {i: m for i, m in self.models.items() if m.experiment != name}
        self.sessions = {i: owner for i, owner in self.sessions.items() if owner != name}
        self.samplers = {i: s for i, s in self.samplers.items()
                         if s.owner != name and (s.model is None or s.model.experiment != name)}
        await self._saved()

    def restore(self) -> None:
        """The sessions and models an earlier run in this run directory saved, once its experiments have
        resumed (a model whose experiment did not is dropped)."""
        self.sessions, self.models = self.registry.load(TinkerModel, SamplerWeights,
                                                        lambda name: name in self.orchestrator.names())
        for model in self.models.values():  # their saved sampler weights are named again: pruning keeps them
            experiment = self.orchestrator.experiments.get(model.experiment)
            for weights in model.sampler_weights.values() if experiment is not None else ():
                experiment.name_version(weights.version)

    async def _saved(self) -> None:
        await self.registry.save(self.sessions, self.models)

    # --- sessions and models -------------------------------------------------------------------------------

    async def create_session(self, owner: str) -> str:
        session_id = f"sess-{secrets.token_hex(8)}"
        self.sessions[session_id] = owner
        _forget_oldest(self.sessions, lambda o: o == owner, MAX_SESSIONS_PER_KEY)
        await self._saved()
        return session_id

    def session(self, owner: str, session_id: str) -> None:
        """404 for an unknown session or another key's."""
        if session_id not in self.sessions or (owner != ADMIN and self.sessions[session_id] != owner):
            raise NotFound(f"no session {session_id!r}", code="session_not_found")

    def model(self, owner: str, model_id: str) -> TinkerModel:
        """The caller's model (404 for an unknown one, another key's, or one whose experiment was deleted)."""
        model = self.models.get(model_id)
        if model is None or (owner != ADMIN and owner != model.owner) \
                or model.experiment not in self.orchestrator.experiments:
            raise NotFound(f"no training model {model_id!r}", code="model_not_found")
        model.last_request_at = time.time()
        return model

    def experiment_of(self, model: TinkerModel) -> Experiment:
        """The experiment behind `model`: the only way its calls reach the learner and the samplers (404 once it
        was deleted; its calls queued then were cancelled, `on_experiment`)."""
        return self.orchestrator.get(model.experiment)

    def check_base_model(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.base_model:
            raise BadRequest(f"this server trains {self.base_model!r}, not {base_model!r}", code="unknown_base_model")

    async def create_model(self, owner: str, session_id: str, model_seq_id: int, base_model: str | None,
                           lora: ts.LoraConfig) -> TinkerModel:
        self.session(owner, session_id)
        self.check_base_model(base_model)
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            return self.models[model_id]  # the SDK's retry of the same create
        if owner == ADMIN:
            name = f"tinker-{session_id.removeprefix('sess-')}-{model_seq_id}"
            targets = [*(_ATTN if lora.train_attn else ()), *(_MLP if lora.train_mlp else ())]
            if not targets:
                raise BadRequest("train_attn and train_mlp are both off: nothing to train", code="no_targets")
            seed_note = "" if lora.seed is None else f" (seed {lora.seed} is the server's: learner.seed)"
            config = ExperimentConfig(name=name, lora=LoraConfig(r=lora.rank, target_modules=targets))
            await self.orchestrator.create(config, start="fresh")
            log.info("tinker model %s: experiment %s, LoRA r=%d%s", model_id, name, lora.rank, seed_note)
        else:  # an experiment's key: its own experiment is its model
            name = owner
            if any(m.experiment == name for m in self.models.values()):
                raise Conflict(f"experiment {name!r} already has a training model; only the admin key makes more",
                               code="model_exists")
            rank = self.orchestrator.get(name).config.lora.r
            if lora.rank != rank:
                raise BadRequest(f"experiment {name!r} has LoRA rank {rank}, not {lora.rank}", code="rank_mismatch")
        model = TinkerModel(model_id=model_id, experiment=name, owner=owner, lora=lora)
        self.models[model_id] = model
        await self._saved()
        return model

    def info(self, model: TinkerModel) -> ts.GetInfoResponse:
        return ts.GetInfoResponse(model_id=model.model_id, model_data=ts.ModelData(
            arch=None, model_name=self.base_model, tokenizer_id=None), is_lora=True, lora_rank=model.lora.rank,
            model_name=self.base_model)

    # --- training ------------------------------------------------------------------------------------------

    async def forward_backward(self, model: TinkerModel, request: ForwardBackwardRequest) -> ForwardBackwardOutput:
        given = request.forward_backward_input
        try:  # lists within the call's bounds (its decoder checked them: routes.py): on a thread, not the loop
            data = await asyncio.to_thread(lambda: [
                wire.Datum(tokens=d.tokens(), loss_fn_inputs={k: v.flat() for k, v in d.loss_fn_inputs.items()})
                for d in given.data])
        except ValueError as exc:
            raise BadRequest(str(exc), code="unsupported_input") from exc
        if not data:
            raise BadRequest("forward_backward needs at least one datum", code="bad_request")
        config = None
        if given.loss_fn_config:
            try:
                config = {k: float(v) for k, v in given.loss_fn_config.items()}
            except ValueError as exc:
                raise BadRequest(f"loss_fn_config values must be numbers: {exc}", code="bad_loss_config") from exc
        first = data[0]
        targets = first.loss_fn_inputs.get("target_tokens")
        if len(first.tokens) > 1 or targets:
            model.probe_tokens = first.tokens + [int(targets[-1])] if targets else list(first.tokens)
        out = await self.experiment_of(model).forward_backward(data, given.loss_fn, config, request.forward_only)
        if not request.forward_only:
            model.gradients_pending = True
            model.learner_life = self.orchestrator.learner_restarts
        return ForwardBackwardOutput(
            loss_fn_outputs=[{k: ts.TensorData.from_list(v, "float32") for k, v in row.items()}
                             for row in out.loss_fn_outputs],
            metrics=out.metrics)

    async def optim_step(self, model: TinkerModel, request: ts.OptimStepRequest) -> ts.OptimStepResponse:
        if request.adam_params is None:
            kind = (request.optimizer_params or {}).get("type", "?")
            raise BadRequest(f"only AdamW steps (adam_params) are served, not {kind!r}", code="unsupported_optimizer")
        out = await self.experiment_of(model).optim_step(wire.AdamParams(**request.adam_params.model_dump()))
        model.step = out.step
        model.gradients_pending = False
        try:
            await self._saved()  # the step reached, so that a restart that rolls it back can say so
        except OSError as exc:  # the step was taken: failing its answer would have the client take it again
            log.error("tinker model %s: its step %d is not in the registry (%s)", model.model_id, out.step, exc)
        return ts.OptimStepResponse(metrics=out.metrics)

    def rollback(self, model: TinkerModel) -> ApiError | None:
        """A restart rolled `model` back since its last call (the learner resumed an older checkpoint, or lost
        the gradients it summed): the error its next call fails with, once (category `server`), so the client
        never goes on silently from other weights than it trained. None: nothing was lost."""
        exp = self.orchestrator.experiments.get(model.experiment)
        if exp is None:
            return None
        lost = []
        if exp.step < model.step:
            lost.append(f"rolled back from optimizer step {model.step} to step {exp.step}, its newest checkpoint "
                        "(the steps after it and their AdamW state are lost)")
        if model.gradients_pending and model.learner_life != self.orchestrator.learner_restarts:
            lost.append("the gradients summed by forward_backward since the last optim_step are lost")
        model.step = exp.step
        model.learner_life = self.orchestrator.learner_restarts
        model.gradients_pending = model.gradients_pending and not lost
        if not lost:
            return None
        log.warning("tinker model %s: a restart %s", model.model_id, "; ".join(lost))
        return ApiError(f"model {model.model_id} was restarted: {'; '.join(lost)}. Load a saved state or go on "
                        "from here knowingly; this call was not run", code="rolled_back", status=503)

    def admit_samples(self, owner: str, sequences: int) -> Callable[[], None]:
        """Admit an asample call of `sequences`: 429 `too_many_samples` while `owner` would hold more than
        tinker_max_samples_per_key; the function that releases them once the call has ended."""
        return self.samples.admit(owner, sequences, self.orchestrator.config.tinker_max_samples_per_key)

    def admit_positions(self, owner: str, positions: int) -> Callable[[], None]:
        """Admit a decoded forward_backward of `positions` token positions: 429 `too_many_tokens_queued` while
        `owner`'s calls queued or running would hold more than QUEUED_CALLS x tinker_max_tokens_per_call (each
        waits at full size in its model's seq_id lane); the function that releases them once the call ended."""
        return self.positions.admit(owner, positions,
                                    QUEUED_CALLS * self.orchestrator.config.tinker_max_tokens_per_call)

    # --- samplers ------------------------------------------------------------------------------------------

    def new_sampler(self, owner: str, model: TinkerModel | None, weights: SamplerWeights | None,
                    model_path: str | None) -> Sampler:
        sampler = Sampler(f"samp-{secrets.token_hex(8)}", owner, model, weights, model_path)
        self.samplers[sampler.sampler_id] = sampler
        self._names(sampler, +1)
        forgotten = _forget_oldest(self.samplers, lambda s: s.owner == owner, MAX_SAMPLERS_PER_KEY)
        if model is not None and weights is not None and model_path is None:
            # An unnamed save's sampler keeps its version on disk as a named one does, so they share the model's
            # tinker_max_saved_per_model: beyond, its oldest unnamed samplers are forgotten (the newest stays).
            keep = max(1, self.orchestrator.config.tinker_max_saved_per_model - len(model.sampler_weights))
            forgotten += _forget_oldest(self.samplers, lambda s: s.model is model and s.model_path is None, keep)
        for old in forgotten:
            self._names(old, -1)
        return sampler

    def _names(self, sampler: Sampler, change: int) -> None:
        """A sampler on a model's weights names their version (pruning keeps it) while the front end holds it."""
        if sampler.model is None or sampler.weights is None:
            return
        experiment = self.orchestrator.experiments.get(sampler.model.experiment)
        if experiment is not None:
            (experiment.name_version if change > 0 else experiment.unname_version)(sampler.weights.version)

    def sampler_for_path(self, owner: str, model_path: str, model: TinkerModel | None = None) -> Sampler:
        """A sampler on the sampler weights `model_path` names (`model`: its model, when the route table resolved
        it already)."""
        model_id, name = parse_path(model_path, "sampler_weights")
        model = model if model is not None else self.model(owner, model_id)
        weights = model.sampler_weights.get(name)
        if weights is None:
            raise NotFound(f"no sampler weights {model_path!r}", code="weights_not_found")
        return self.new_sampler(owner, model, weights, model_path)

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or (owner != ADMIN and owner != sampler.owner):
            raise NotFound(f"no sampler {sampler_id!r}", code="sampler_not_found")
        if sampler.model is not None:
            self.model(owner, sampler.model.model_id)  # its experiment still exists
        return sampler


def _forget_oldest(table: dict, mine, keep: int) -> list:
    """Drop the oldest entries (dicts keep insertion order) for which `mine(value)` holds, beyond `keep`; the
    values dropped."""
    held = [key for key, value in table.items() if mine(value)]
    return [table.pop(key) for key in held[:max(0, len(held) - keep)]]


def failure(error: ApiError) -> ts.RequestFailedResponse:
    """A failed call as the SDK reads it: the client's fault (4xx) is category `user`, the rest `server`."""
    category = ts.RequestErrorCategory.User if 400 <= error.status < 500 else ts.RequestErrorCategory.Server
    return ts.RequestFailedResponse(error=f"{error.code}: {error.message}", category=category)
