"""The request and response models of the workers' verbs (which verb takes and answers which: `verbs.py`).

Bodies travel as msgpack (`codec.py`) over HTTP on loopback (or the compose network). Both sides validate
with these models, so a mismatch fails loudly at the boundary. Errors: non-2xx with a msgpack body
{"error": {"code": str, "message": str}} (`errors.py`, `dispatch.py`).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpo_server.protocol.worker_config import AlgorithmConfig, LoraConfig


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# An experiment's name, the front end's rule (grpo_server/config.py ExperimentConfig.name). Both workers make
# folders of it (the learner's adapters/<name>/, a sampler's adapter-copies/.../<name>/), so a name that is a
# path ("../x", "a/b", "/abs") is refused here, a 400 before anything touches the disk.
EXPERIMENT_NAME = r"^[a-z0-9_-]{1,64}$"
ExperimentName = Annotated[str, Field(pattern=EXPERIMENT_NAME)]


class AdapterRef(WireModel):
    """One version of one experiment's adapter. The sampler maps it to its own LoRA id, named by `key`."""

    name: ExperimentName
    version: int = Field(ge=0)
    # Which life of the name (runtime/experiment/owner.py): in the key, so that no adapter, copy or cached KV of
    # one life is taken for another's (vLLM keys its prefix cache by LoRA name). The learner ignores it.
    life: str = Field("", pattern=r"^[0-9a-f]{0,16}$")

    @property
    def key(self) -> str:
        return f"{self.name}@v{self.version}" + (f".{self.life}" if self.life else "")

    @classmethod
    def from_key(cls, key: str) -> AdapterRef:
        """The AdapterRef whose `key` this is."""
        name, _, rest = key.rpartition("@v")
        version, _, life = rest.partition(".")
        return cls(name=name, version=int(version), life=life)


# --- sampler -----------------------------------------------------------------------------------


class ToolFunction(WireModel):
    """A function the model may call, as OpenAI's `tools[].function` (its `parameters`: a JSON schema)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolCalling(WireModel):
    """Tools offered to the model for one request: the sampler parses its output into `Completion.tool_calls`
    with the configured parser (vLLM's, `SamplerOptions.tool_parser`), and for `required` / `named` it
    constrains the output with vLLM's structured outputs so that it is a call (to `function`, if named)."""

    tools: list[ToolFunction] = Field(min_length=1)
    choice: Literal["auto", "required", "named"] = "auto"
    function: str | None = None  # with choice "named": the one function to call
    parallel: bool = True  # more than one call in a completion allowed


class GenerateRequest(WireModel):
    prompt_token_ids: list[int] = Field(min_length=1)
    n: int = Field(1, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = Field(16, ge=1)
    stop: list[str] | None = None
    seed: int | None = None
    adapter: AdapterRef | None = None
    tool_calling: ToolCalling | None = None
    # Tinker's sampling (api/tinker/): stop at these token ids too (the token is kept in the completion), or run
    # to max_tokens past EOS (`stop: []` there).
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # The engine's order among waiting requests (vLLM's priority scheduling: lower first, then by arrival). The
    # front end sets it to the sequences its experiment already has in flight (workers/pool.py): a tenant with
    # nothing in flight goes before the waiting requests of one that floods the samplers.
    priority: int = Field(0, ge=0)


class ToolCall(WireModel):
    """A call the model wrote, parsed out of its text."""

    id: str
    name: str
    arguments: str  # JSON text (an object)


class Completion(WireModel):
    text: str  # everything the model wrote, tool calls included (token_ids decoded)
    token_ids: list[int]
    logprobs: list[float]  # one per token id: log p(token | prefix) under the sampling distribution
    finish_reason: str  # "stop" | "length" | "tool_calls" | "external"
    # With tools offered: the calls parsed out of `text`, and the text outside them (None if only calls).
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    # Sampled under a grammar (a `required` or named tool call): its logprobs are renormalised over the tokens
    # the grammar allowed, so they are not the model's own, and the free sampler check skips it.
    constrained: bool = False


# How the sampler ran a request: through the LoRA adapter, on weights with the adapter merged in (the
# same function, faster on CPU), or on the base model (no adapter asked for).
ServedAs = Literal["lora", "merged", "base"]


class GenerateResponse(WireModel):
    prompt_token_ids: list[int]
    completions: list[Completion]
    served_as: ServedAs = "lora"


class ScoreRequest(WireModel):
    """Logprobs of given completions under an adapter, at a temperature (processed logprobs)."""

    prompt_token_ids: list[int] = Field(min_length=1)
    completions_token_ids: list[list[int]] = Field(min_length=1)
    temperature: float = 1.0
    adapter: AdapterRef | None = None


class ScoreResponse(WireModel):
    logprobs: list[list[float]]


class LoadAdapterRequest(WireModel):
    adapter: AdapterRef
    path: str  # a folder in peft format, new for every version (the learner's: used as is where it is readable)
    # Where it is not (a sampler on another host, with its own run directory): the learner's URL, whose
    # GET /adapters/{name}/{version}/{file} the sampler copies it from; and the version's fingerprint, which
    # tells the version from another folder at the same path (protocol/adapter_files.py).
    source_url: str | None = None
    fingerprint: str | None = None

    @field_validator("path")
    @classmethod
    def _absolute_without_dot_dot(cls, path: str) -> str:
        # The learner writes absolute paths (its run directory, resolved): a relative one would depend on the
        # sampler's working directory, and a ".." could lead out of the folder the path seems to name.
        if not path.startswith("/") or ".." in PurePosixPath(path).parts or "\0" in path:
            raise ValueError("must be an absolute path without '..'")
        return path


class UnloadAdapterRequest(WireModel):
    adapter: AdapterRef


class PauseRequest(WireModel):
    """Freeze the engine's requests where they are (none is ended or lost) until `resume`, or for `lease_s` at most:
    a front end that dies holding a pause leaves no sampler stopped."""

    lease_s: float = Field(gt=0, le=3600)


class ResumeRequest(WireModel):
    """Unfreeze what `PauseRequest` froze (nothing to say: a POST, since it changes the engine's state)."""


class Paused(WireModel):
    paused: bool  # whether the engine is paused now (an engine that cannot pause answers False)


class PrefixCacheCounts(WireModel):
    """Since the engine started: prompt tokens of its generate requests (`queries`) and how many of them
    vLLM's prefix cache supplied (`hits`): what vLLM's `vllm:prefix_cache_queries` / `_hits` count, taken per
    request from its `num_cached_tokens` (the engine runs without vLLM's stat loggers)."""

    queries: int = 0
    hits: int = 0


class SamplerHealth(WireModel):
    status: Literal["ok"] = "ok"
    engine: str
    model: str
    adapters: list[str]  # AdapterRef.key of every loaded version
    max_model_len: int
    merged_adapter: str | None = None  # the version folded into the weights now, if any
    merge_unsupported: str | None = None  # why this engine never merges (None: it merges, in turns)
    prefix_cache: PrefixCacheCounts | None = None  # None: an engine without a prefix cache (hf)
    dtype: str | None = None  # what it computes in ("float32", "bfloat16"; `dtype` auto resolved); None: not said
    compiled: bool | None = None  # whether the model runs torch.compile'd (SamplerConfig.compile); None: not said


# --- learner -----------------------------------------------------------------------------------


class AddExperimentRequest(WireModel):
    name: ExperimentName
    lora: LoraConfig
    algorithm: AlgorithmConfig
    resync: bool = False  # the front end's re-sync after a learner restart: one already added is answered as is


class AdapterVersion(WireModel):
    name: str
    version: int
    path: str  # a folder that peft and vLLM load as is
    fingerprint: str | None = None  # the id in its safetensors header (protocol/adapter_files.py)
    step: int = 0
    journal_seq: int = 0  # the newest feedback-journal entry the learner's weights include
    groups_trained: int = 0  # over the experiment's whole life (kept in its checkpoints)


class TrainSample(WireModel):
    """One completion with its group-relative advantage."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int] = Field(min_length=1)
    sampler_logprobs: list[float]  # behaviour logprobs, one per completion token
    advantage: float
    reward: float
    policy_version: int  # the version that sampled it
    temperature: float = 1.0  # the sampling temperature its logprobs were taken at (> 0)
    top_p: float = 1.0  # and the nucleus they were renormalised over (protocol/sampling_distribution.py)
    # One per completion token: 1 where the model sampled it (trained, and its sampler_logprobs are real),
    # 0 where it did not (an episode's tool results, user turns and template tokens between its turns:
    # their sampler_logprobs are placeholders). None: every token is the model's.
    loss_mask: list[int] | None = None
    constrained: bool = False  # some of it was sampled under a grammar (Completion.constrained)


class TrainRequest(WireModel):
    name: ExperimentName
    samples: list[TrainSample] = Field(min_length=1)
    max_tokens: int = Field(256, ge=1)  # the generation budget: dr_grpo's constant normaliser
    num_groups: int = 1
    journal_seq: int = 0  # the newest feedback-journal entry in (or dropped before) this batch
    # For the learner's ledger (learner/ledger.py): the ids of the groups in this batch, and of those the front end
    # passed over since its step before, with why (stale, failed, nothing_to_train).
    group_ids: list[str] = Field(default_factory=list)
    passed_over: dict[str, str] = Field(default_factory=dict)


class TrainMetrics(WireModel):
    step: int
    loss: float
    reward_mean: float
    reward_std: float
    kl: float | None  # mean k3 KL to the base model; None when beta = 0 (no reference forward is run then)
    clipped_fraction: float
    ratio_mean: float  # ratio_*: the PPO ratio; with a rollout correction, the behaviour ratio learner / sampler
    ratio_std: float
    ratio_min: float
    ratio_max: float
    grad_norm: float
    tokens: int
    seconds: float
    # The check of the samplers that costs nothing: completions in this batch sampled by the version the
    # learner's weights were at when the step began (`checked_version`, None when they were at no saved
    # version, or LoRA dropout makes the training forward differ) have sampler logprobs that must equal
    # the learner's; |difference| over their tokens.
    checked_version: int | None = None
    sampler_gap_tokens: int = 0
    sampler_gap_mean: float = 0.0
    sampler_gap_max: float = 0.0
    checkpointed_journal_seq: int | None = None  # set when this step was checkpointed: journal entries up
    # to it are durable in the weights, and the front end may forget them
    # Sampler/learner mismatch over all trained tokens (stale groups included, so it also holds their version
    # gap): mean k3 estimate of KL(sampler || learner) (learner/policy_loss.py `mismatch_kl_sum`), and the fraction of
    # trained tokens the rollout correction capped (token_tis) or masked (token_mask, sequence_mask).
    mismatch_kl: float = 0.0
    rollout_corrected_fraction: float = 0.0
    # mismatch_kl apart: over tokens sampled by the version whose weights the learner held at the step's start
    # (numeric mismatch alone: float32 ~1e-9, a bf16 sampler ~0.05), and over stale tokens (older versions: the
    # policy's change since). None when the step had no such token; the counts are trained tokens.
    mismatch_kl_fresh: float | None = None
    mismatch_fresh_tokens: int = 0
    offpolicy_kl_stale: float | None = None
    offpolicy_stale_tokens: int = 0


class VersionProbe(WireModel):
    """Completions whose logprobs under a saved version are compared on both sides (grpo_server/runtime/verification.py)."""
    prompt_token_ids: list[int]
    completions_token_ids: list[list[int]] = Field(min_length=1)
    temperature: float = 1.0


class SaveAdapterRequest(WireModel):
    name: ExperimentName


class LogprobsRequest(VersionProbe):
    """Completions of one prompt, scored under the adapter of experiment `name`."""
    name: ExperimentName


class LogprobsResponse(WireModel):
    logprobs: list[list[float]]


class ScoreVersionRequest(LogprobsRequest):
    """The push check's learner side: these logprobs under `version`, just saved and still the experiment's weights
    (else 409 weights_moved), and with `previous` under the version saved before it (nearest_version)."""
    version: int
    previous: bool = False


class ScoredVersion(LogprobsResponse):
    version: int
    previous_version: int | None = None  # with `previous`; None: no version saved before (since start or resume)
    previous_logprobs: list[list[float]] | None = None


class RemoveExperimentRequest(WireModel):
    name: ExperimentName


class PruneVersionsRequest(WireModel):
    """After a push: the versions of a live experiment the front end still uses (loaded on a sampler, awaiting
    a check, served). The learner keeps those, its checkpoints' and its newest `keep_versions`, and deletes
    the rest (learner/retention.py)."""

    name: ExperimentName
    # Far more than can be in use (max_loaded_versions is at most 256, and one version awaits its check).
    in_use: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=4096)


class PrunedVersions(WireModel):
    kept: list[int]  # on disk after the prune, oldest first
    removed: list[int]


# --- learner: Tinker's training verbs (learner/steps.py; losses: protocol/loss_table.py) -------------------

# A saved state's label: one folder name under the experiment's checkpoints (no path, no leading dot).
STATE_LABEL = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
StateLabel = Annotated[str, Field(pattern=STATE_LABEL)]


class Datum(WireModel):
    """One sequence, as Tinker's Datum: position i of `tokens` (the model input) predicts
    `loss_fn_inputs["target_tokens"][i]`; every input has one value per position (the loss table names them)."""

    tokens: list[int] = Field(min_length=1)
    loss_fn_inputs: dict[str, list[float | int]] = Field(default_factory=dict)


class ForwardBackwardRequest(WireModel):
    """`forward` and `forward_backward`: the datums, a loss of the table and its config (None: the defaults)."""

    name: ExperimentName
    data: list[Datum] = Field(min_length=1)
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class ForwardBackwardOutput(WireModel):
    # Per datum, in order: {"logprobs": the learner's logprob of each target, "elementwise_loss": each
    # position's share of the loss}, one value per position.
    loss_fn_outputs: list[dict[str, list[float]]]
    metrics: dict[str, float]  # Tinker's "name:reduction" keys: loss:sum, ... (learner/steps.py)


class AdamParams(WireModel):
    """Tinker's AdamParams (its defaults), applied to the experiment's AdamW for one optim_step."""

    learning_rate: float = Field(1e-4, ge=0, le=1.0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, ge=0, le=1.0)
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip_norm: float = Field(0.0, ge=0, le=1e6)  # the global norm to clip to; 0 = no clipping


class OptimStepRequest(WireModel):
    name: ExperimentName
    adam_params: AdamParams = Field(default_factory=AdamParams)


class OptimStepResponse(WireModel):
    step: int  # the experiment's optimizer steps after this one
    metrics: dict[str, float]  # grad_norm:mean (before clipping), learning_rate:mean


class SaveStateRequest(WireModel):
    name: ExperimentName
    label: StateLabel
    with_optimizer: bool = True  # also the AdamW state (what load_state's with_optimizer restores)
    overwrite: bool = False  # replace a state of that label (else a 409 state_exists), as Tinker's save_weights


class LoadStateRequest(WireModel):
    """Into the live experiment `name`: the state `label` saved by `source` (None: `name` itself), which must have
    the same LoRA shape (r, alpha, target_modules)."""

    name: ExperimentName
    label: StateLabel
    source: ExperimentName | None = None
    with_optimizer: bool = False


class StatesRequest(WireModel):
    name: ExperimentName


class DeleteStateRequest(WireModel):
    name: ExperimentName
    label: StateLabel


class SavedState(WireModel):
    name: str  # the experiment that saved it
    label: str
    path: str  # its folder on the learner (under the experiment's checkpoints: archived with it)
    step: int
    with_optimizer: bool
    saved_at: float  # epoch seconds
    lora: dict[str, Any]  # the saving experiment's LoraConfig: an experiment to load it into must have its shape


class SavedStates(WireModel):
    states: list[SavedState]  # oldest first


class LearnerStatus(WireModel):
    status: Literal["ok"] = "ok"
    experiments: dict[str, dict[str, Any]]  # name -> {step, version}
    dtype: str | None = None  # the base weights' dtype, which its logprobs for a push's check are computed in
    autocast: bool = False  # train steps under bf16 autocast: their forward is not the samplers' numerics
    paging: dict[str, Any] | None = None  # experiments held and paged out, page-ins and -outs (learner/paging.py)
