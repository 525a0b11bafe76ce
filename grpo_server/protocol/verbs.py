"""Every worker verb, typed once: its name (the path), its request model and its answer model; and the
front end's typed clients, `SamplerClient` and `LearnerClient`, one method per verb.

A client sends through a `Transport` (the front end's is `grpo_server/workers/pool.py`: one replica's HTTP
connection, or the balanced set of sampler replicas). The worker's side of the same table is
`protocol/dispatch.py`. Bodies are msgpack (`protocol/codec.py`); errors are `protocol/errors.py`'s shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel

from grpo_server.protocol.wire import (AdamParams, AdapterRef, AdapterVersion, AddExperimentRequest,
                                       DeleteStateRequest, ExperimentName, ForwardBackwardOutput,
                                       ForwardBackwardRequest, GenerateRequest, GenerateResponse, LearnerStatus,
                                       LoadAdapterRequest, LoadStateRequest, LogprobsRequest, LogprobsResponse,
                                       OptimStepRequest, OptimStepResponse, Paused, PauseRequest, PrunedVersions,
                                       PruneVersionsRequest, RemoveExperimentRequest, ResumeRequest, SamplerHealth,
                                       SaveAdapterRequest, SavedState, SavedStates, SaveStateRequest, ScoredVersion,
                                       ScoreRequest, ScoreResponse, ScoreVersionRequest, StatesRequest, TrainMetrics,
                                       TrainRequest, UnloadAdapterRequest, VersionProbe, WireModel)
from grpo_server.protocol.worker_config import AlgorithmConfig, LoraConfig

Req = TypeVar("Req", bound=BaseModel)
Ans = TypeVar("Ans", bound=BaseModel)


@dataclass(frozen=True)
class Verb(Generic[Req, Ans]):
    """POST /<name> with a `request` body, or GET /<name> when `request` is None; answers `answer`."""

    name: str
    request: type[Req] | None
    answer: type[Ans]

    @property
    def method(self) -> str:
        return "GET" if self.request is None else "POST"


class AdapterList(WireModel):
    """The adapters a sampler holds after a load or an unload (`AdapterRef.key`s)."""

    adapters: list[str]


class Removed(WireModel):
    removed: str


class Healthy(WireModel):
    status: str


class ArchiveRequest(WireModel):
    """An experiment's files on the learner's disk (adapter versions, checkpoints), moved into or out of
    `run_dir/archive/{label}/` (grpo_server/protocol/archive.py). The learner must not hold the experiment."""

    name: ExperimentName  # the front end's name rule, checked here too: the name becomes a path
    label: str | None = None  # archive: the label to make (required); restore: the one to take (None: newest)
    keep: int | None = None  # archive: then remove all but the newest `keep` archives (the server's archives_kept)


class Archived(WireModel):
    label: str | None  # the archive moved into or out of; None: nothing was moved
    live: bool = False  # restore: the experiment already had files outside the archive (they are resumed)


class SamplerVerbs:
    generate = Verb("generate", GenerateRequest, GenerateResponse)
    score = Verb("score", ScoreRequest, ScoreResponse)
    load_adapter = Verb("load_adapter", LoadAdapterRequest, AdapterList)
    unload_adapter = Verb("unload_adapter", UnloadAdapterRequest, AdapterList)
    health = Verb("health", None, SamplerHealth)
    pause = Verb("pause", PauseRequest, Paused)
    resume = Verb("resume", ResumeRequest, Paused)
    ALL = (generate, score, load_adapter, unload_adapter, health, pause, resume)


class LearnerVerbs:
    add_experiment = Verb("add_experiment", AddExperimentRequest, AdapterVersion)
    train = Verb("train", TrainRequest, TrainMetrics)
    save_adapter = Verb("save_adapter", SaveAdapterRequest, AdapterVersion)
    score_version = Verb("score_version", ScoreVersionRequest, ScoredVersion)
    logprobs = Verb("logprobs", LogprobsRequest, LogprobsResponse)
    remove_experiment = Verb("remove_experiment", RemoveExperimentRequest, Removed)
    archive_experiment = Verb("archive_experiment", ArchiveRequest, Archived)
    restore_experiment = Verb("restore_experiment", ArchiveRequest, Archived)
    prune_versions = Verb("prune_versions", PruneVersionsRequest, PrunedVersions)
    status = Verb("status", None, LearnerStatus)
    health = Verb("health", None, Healthy)
    # Tinker's training verbs (learner/steps.py): gradients accumulate over forward_backward calls until optim_step.
    forward = Verb("forward", ForwardBackwardRequest, ForwardBackwardOutput)
    forward_backward = Verb("forward_backward", ForwardBackwardRequest, ForwardBackwardOutput)
    optim_step = Verb("optim_step", OptimStepRequest, OptimStepResponse)
    save_state = Verb("save_state", SaveStateRequest, SavedState)
    load_state = Verb("load_state", LoadStateRequest, SavedState)
    list_states = Verb("list_states", StatesRequest, SavedStates)
    delete_state = Verb("delete_state", DeleteStateRequest, SavedState)
    ALL = (add_experiment, train, save_adapter, score_version, logprobs, remove_experiment, archive_experiment,
           restore_experiment, prune_versions, status, health, forward, forward_backward, optim_step, save_state,
           load_state, list_states, delete_state)


class Transport(Protocol):
    """Sends one verb and returns its validated answer. `syncing_ok`: the call re-syncs a restarted worker,
    so it may reach the worker before clients do. `timeout_s` None: the transport's default."""

    name: str

    async def request(self, verb: Verb[Any, Ans], body: BaseModel | None, *, timeout_s: float | None = None,
                      syncing_ok: bool = False) -> Ans: ...


class _Client:
    def __init__(self, transport: Transport):
        self.transport = transport

    @property
    def name(self) -> str:
        return self.transport.name


class SamplerClient(_Client):
    """A sampler replica, or the balanced set of them, as typed methods."""

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        return await self.transport.request(SamplerVerbs.generate, request)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        return await self.transport.request(SamplerVerbs.score, request)

    async def load_adapter(self, adapter: AdapterRef, path: str, *, source_url: str | None = None,
                           fingerprint: str | None = None, syncing_ok: bool = False) -> AdapterList:
        """`source_url`: the learner, to copy the version from where `path` is not readable (LoadAdapterRequest)."""
        request = LoadAdapterRequest(adapter=adapter, path=path, source_url=source_url, fingerprint=fingerprint)
        return await self.transport.request(SamplerVerbs.load_adapter, request, syncing_ok=syncing_ok)

    async def unload_adapter(self, adapter: AdapterRef, *, syncing_ok: bool = False) -> AdapterList:
        return await self.transport.request(SamplerVerbs.unload_adapter, UnloadAdapterRequest(adapter=adapter),
                                            syncing_ok=syncing_ok)

    async def health(self, *, syncing_ok: bool = False) -> SamplerHealth:
        return await self.transport.request(SamplerVerbs.health, None, syncing_ok=syncing_ok)

    async def pause(self, lease_s: float) -> Paused:
        return await self.transport.request(SamplerVerbs.pause, PauseRequest(lease_s=lease_s))

    async def resume(self) -> Paused:
        return await self.transport.request(SamplerVerbs.resume, ResumeRequest())


class LearnerClient(_Client):
    """The learner (its rank 0) as typed methods."""

    async def add_experiment(self, name: str, lora: LoraConfig, algorithm: AlgorithmConfig, *,
                             resync: bool = False) -> AdapterVersion:
        """Version 0 of a new adapter (LoRA B = 0: the base model), or the newest one on disk, resumed. `resync`:
        the front end's re-sync after the learner restarted (it reaches a learner that is syncing, and an experiment
        an earlier try of it added is answered as it stands)."""
        return await self.transport.request(
            LearnerVerbs.add_experiment, AddExperimentRequest(name=name, lora=lora, algorithm=algorithm, resync=resync),
            syncing_ok=resync)

    async def train(self, request: TrainRequest, *, timeout_s: float | None = None) -> TrainMetrics:
        return await self.transport.request(LearnerVerbs.train, request, timeout_s=timeout_s)

    async def save_adapter(self, name: str) -> AdapterVersion:
        """Write the experiment's weights as its next version."""
        return await self.transport.request(LearnerVerbs.save_adapter, SaveAdapterRequest(name=name))

    async def score_version(self, name: str, version: int, probe: VersionProbe,
                            previous: bool = False) -> ScoredVersion:
        """The push check's probe under `version`, just saved (and, with `previous`, under the version before)."""
        return await self.transport.request(LearnerVerbs.score_version, ScoreVersionRequest(
            name=name, version=version, previous=previous, **probe.model_dump()))

    async def logprobs(self, request: LogprobsRequest) -> LogprobsResponse:
        return await self.transport.request(LearnerVerbs.logprobs, request)

    async def remove_experiment(self, name: str, *, syncing_ok: bool = False) -> Removed:
        return await self.transport.request(LearnerVerbs.remove_experiment, RemoveExperimentRequest(name=name),
                                            syncing_ok=syncing_ok)

    async def archive_experiment(self, name: str, label: str, keep: int | None = None) -> Archived:
        """Move a removed experiment's files into archive `label` (Archived.label None: it had none); then, with
        `keep`, remove all but the newest `keep` archives of the learner's run directory."""
        return await self.transport.request(LearnerVerbs.archive_experiment,
                                            ArchiveRequest(name=name, label=label, keep=keep))

    async def restore_experiment(self, name: str, label: str | None = None) -> Archived:
        """Move archive `label` (None: the newest) back, unless the experiment has live files (`live`)."""
        return await self.transport.request(LearnerVerbs.restore_experiment, ArchiveRequest(name=name, label=label))

    async def prune_versions(self, name: str, in_use: list[int]) -> PrunedVersions:
        """Delete the experiment's versions on the learner's disk that nothing needs (PruneVersionsRequest)."""
        return await self.transport.request(LearnerVerbs.prune_versions,
                                            PruneVersionsRequest(name=name, in_use=in_use))

    async def status(self, *, syncing_ok: bool = False) -> LearnerStatus:
        return await self.transport.request(LearnerVerbs.status, None, syncing_ok=syncing_ok)

    # --- Tinker's training verbs (learner/steps.py) -------------------------------------------------------

    async def forward(self, request: ForwardBackwardRequest, *,
                      timeout_s: float | None = None) -> ForwardBackwardOutput:
        """The loss and per-position logprobs under the current weights; no gradient."""
        return await self.transport.request(LearnerVerbs.forward, request, timeout_s=timeout_s)

    async def forward_backward(self, request: ForwardBackwardRequest, *,
                               timeout_s: float | None = None) -> ForwardBackwardOutput:
        """As forward, and adds the loss's gradient to the experiment's (summed until the next optim_step)."""
        return await self.transport.request(LearnerVerbs.forward_backward, request, timeout_s=timeout_s)

    async def optim_step(self, name: str, adam_params: AdamParams | None = None) -> OptimStepResponse:
        """One AdamW step on the gradients summed since the last one, with these hyperparameters; zeroes them."""
        request = OptimStepRequest(name=name, adam_params=adam_params or AdamParams())
        return await self.transport.request(LearnerVerbs.optim_step, request)

    async def save_state(self, name: str, label: str, *, with_optimizer: bool = True,
                         overwrite: bool = False) -> SavedState:
        return await self.transport.request(LearnerVerbs.save_state, SaveStateRequest(
            name=name, label=label, with_optimizer=with_optimizer, overwrite=overwrite))

    async def load_state(self, name: str, label: str, *, source: str | None = None,
                         with_optimizer: bool = False) -> SavedState:
        """Into live experiment `name`: state `label` of `source` (default `name`). The learner does not check who
        may read `source`: the caller must."""
        return await self.transport.request(LearnerVerbs.load_state, LoadStateRequest(
            name=name, label=label, source=source, with_optimizer=with_optimizer))

    async def list_states(self, name: str) -> SavedStates:
        return await self.transport.request(LearnerVerbs.list_states, StatesRequest(name=name))

    async def delete_state(self, name: str, label: str) -> SavedState:
        return await self.transport.request(LearnerVerbs.delete_state, DeleteStateRequest(name=name, label=label))
