"""Tinker wire JSON bodies (SDK 0.38), named as in the SDK's `tinker.types`. docs/tinker-wire.md is the reference.

Requests ignore fields this server does not read (the SDK adds some with each release); responses are what the
SDK validates strictly, so serialize them with `model_dump(mode="json", exclude_none=True)`. The calls that run
on a model answer `UntypedAPIFuture` at once; `POST /api/v1/retrieve_future` then long-polls for the result,
answering 408 (`TryAgainResponse` body) while it is pending and `RequestFailedResponse` when it failed. Results
of forward/forward_backward/sample are protobuf (protobuf.py), every other result is the JSON model named below.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The RestClient records live in data.py; they are re-exported so that every body can be imported from here.
from .data import (  # noqa: F401
    SDK_RELEASES_TESTED, Checkpoint, CheckpointsListResponse, Cursor, GetServerCapabilitiesResponse, HealthResponse,
    ModelInput, OptimizerConfig, SdkVersions, SupportedModel, TensorData, TrainingRun, WeightsInfoRequest,
    WeightsInfoResponse)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# --- client set-up and sessions ----------------------------------------------------------------------------------

class ClientConfigRequest(_Request):
    """`POST /api/v1/client/config` and `/client/dynamic_config`: the SDK's version."""

    sdk_version: str


class ClientConfigResponse(_Response):
    """Feature flags for the SDK (all optional; `{}` keeps the SDK defaults). Shown: the ones worth sending."""

    pjwt_auth_enabled: bool = False  # True makes the SDK exchange its key at /api/v1/auth/token for a JWT
    parallel_fwdbwd_chunks: bool | None = None  # False: the chunks of one forward_backward arrive in seq_id order
    fwdbwd_max_chunk_len: int | None = None  # datums per forward_backward request (SDK default 1024)
    use_pyqwest_transport: bool | None = None  # False: plain httpx transport instead of pyqwest (reqwest)
    sample_max_concurrent_requests: int | None = None  # in-flight asample requests per SamplingClient (2000)
    # SDKs before 0.25 send forward_backward as JSON and forward to /api/v1/forward unless told otherwise; this
    # server takes forward_backward as protobuf only, a forward among them (forward_only), so it tells them to.
    # Later SDKs always do so and ignore the two flags.
    proto_write_fwdbwd: bool | None = None
    fwd_via_fwdbwd: bool | None = None


class ClientDynamicConfigResponse(_Response):
    """Flags the SDK re-reads every `refresh_interval_sec` (a 404 also keeps the defaults)."""

    refresh_interval_sec: int | None = None
    sample_cancel_enabled: bool | None = None  # True: abandoned samples are cancelled via /api/v1/cancel_future


class CreateSessionRequest(_Request):
    """`POST /api/v1/create_session`: sent once per ServiceClient (lazily, on its first training/sampling call)."""

    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(_Response):
    """The new session's id; the optional messages are logged by the SDK at info/warning/error."""

    session_id: str
    type: Literal["create_session"] = "create_session"
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(_Request):
    """`POST /api/v1/session_heartbeat`, every 10 s; answering 410 stops the SDK's heartbeat loop."""

    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionHeartbeatResponse(_Response):
    """Heartbeat acknowledged."""

    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionFinishReason(_Request):
    """How the client's script ended."""

    type: Literal["success", "errored", "interrupted"]


class SessionFinishRequest(_Request):
    """`POST /api/v1/sessions/{session_id}/finish` (ServiceClient.close / `with` exit); any 2xx answer."""

    reason: SessionFinishReason
    detail: str | None = None


class TelemetrySendRequest(_Request):
    """`POST /api/v1/telemetry`: SDK event batches (TINKER_TELEMETRY=0 turns them off client-side)."""

    events: list[dict[str, Any]] = []
    platform: str = ""
    sdk_version: str = ""
    session_id: str = ""
    process_uuid: str = ""


class TelemetryResponse(_Response):
    """The only answer the SDK accepts for telemetry."""

    status: Literal["accepted"] = "accepted"


# --- futures -----------------------------------------------------------------------------------------------------

class UntypedAPIFuture(_Response):
    """The immediate answer of every model call; asample's also names each sample's sequence id (required)."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None  # asample only: num_samples ids, in result order


class FutureRetrieveRequest(_Request):
    """`POST /api/v1/retrieve_future` (client read timeout 45 s): long-poll one future's result."""

    request_id: str
    allow_metadata_only: bool = False  # the server may answer once with {"status": "complete_metadata", ...}


class TryAgainResponse(_Response):
    """Still pending: send with status 408 (the SDK re-polls at once, quietly; 200 re-polls but logs a warning)."""

    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class RequestErrorCategory(str, Enum):
    """Who is at fault; the SDK raises RequestFailedError either way and never retries a failed future."""

    Unknown = "unknown"
    Server = "server"
    User = "user"


class RequestFailedResponse(_Response):
    """A failed future's result (status 200): the SDK raises RequestFailedError(error, category)."""

    error: str
    category: RequestErrorCategory


class CancelFutureRequest(_Request):
    """`POST /api/v1/cancel_future`: an abandoned sample (only when sample_cancel_enabled); any 2xx answer."""

    request_id: str


# --- training models ---------------------------------------------------------------------------------------------

class LoraConfig(_Request):
    """The adapter of a new training model."""

    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(_Request):
    """`POST /api/v1/create_model` -> future of CreateModelResponse. Name the model `{session_id}:train:{seq}`."""

    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(_Response):
    """create_model's result."""

    model_id: str
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(_Request):
    """`POST /api/v1/get_info` (synchronous JSON answer, no future), once per new TrainingClient."""

    model_id: str
    type: Literal["get_info"] = "get_info"


class ModelData(_Response):
    """The base model: `model_name` feeds TrainingClient.get_tokenizer (HF AutoTokenizer of tokenizer_id or it)."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None  # an HF repo id or a local directory; text after a ':' is dropped by the SDK


class GetInfoResponse(_Response):
    """get_info's answer."""

    model_data: ModelData
    model_id: str
    type: Literal["get_info"] | None = "get_info"
    optimizer_config: OptimizerConfig = OptimizerConfig()
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


# A checkpoint's or sampler weights' name: a label, not a path or a document (it is kept in the registry and in
# folder names, and a listing returns it).
Label = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
MAX_TTL_S = 10 * 365 * 86_400  # ten years: longer is "keep", and larger numbers overflow a date


class AdamParams(_Request):
    """AdamW hyperparameters for one step (decoupled weight decay; grad_clip_norm 0 = no clipping). Bounded here, so
    that a value no optimizer takes is the client's 422, not a failed step."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    learning_rate: float = Field(1e-4, ge=0, le=10)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=10)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepRequest(_Request):
    """`POST /api/v1/optim_step` -> future of OptimStepResponse. Adam steps arrive as `adam_params`."""

    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None  # a non-Adam family's params, with its "type" (e.g. dimuon)
    type: Literal["optim_step"] = "optim_step"

    @model_validator(mode="before")
    @classmethod
    def _optim_params(cls, data: Any) -> Any:
        if isinstance(data, dict) and "optim_params" in data and "adam_params" not in data:
            data = {**data, "adam_params": data["optim_params"]}
        return data


class OptimStepResponse(_Response):
    """optim_step's result; metrics are shown to the user as-is."""

    metrics: dict[str, float] | None = None


class SaveWeightsRequest(_Request):
    """`POST /api/v1/save_weights` (save_state) -> future of SaveWeightsResponse: adapter + optimizer state."""

    model_id: str
    path: Label | None = None  # a name, not a path: the checkpoint is tinker://{model_id}/weights/{path}
    seq_id: int | None = None
    ttl_seconds: int | None = Field(None, le=MAX_TTL_S)
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsResponse(_Response):
    """save_weights' result."""

    path: str
    type: Literal["save_weights"] | None = "save_weights"


class SaveWeightsForSamplerRequest(_Request):
    """`POST /api/v1/save_weights_for_sampler`: named (-> path) or, with sampling_session_seq_id, a new sampler."""

    model_id: str
    path: Label | None = None  # named save: tinker://{model_id}/sampler_weights/{path}
    sampling_session_seq_id: int | None = None  # unnamed save: answer a sampling_session_id serving these weights
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int | None = None
    ttl_seconds: int | None = Field(None, le=MAX_TTL_S)
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsForSamplerResponse(_Response):
    """save_weights_for_sampler's result: `path` for a named save, `sampling_session_id` for an unnamed one."""

    path: str | None = None
    sampling_session_id: str | None = None
    type: Literal["save_weights_for_sampler"] | None = "save_weights_for_sampler"


class SaveWeightsExternalRequest(_Request):
    """`POST /api/v1/save_weights_external` -> future of SaveWeightsExternalResponse: the adapter as a peft folder,
    written on the server's disk (checkpoints.py `save_external`)."""

    model_id: str
    path: Label  # the name: tinker://{model_id}/external_weights/{path}
    seq_id: int | None = None
    ttl_seconds: int | None = Field(None, le=MAX_TTL_S)
    age_encryption_recipients: list[str] | None = None  # refused: the files are not encrypted here
    type: Literal["save_weights_external"] = "save_weights_external"


class SaveWeightsExternalResponse(_Response):
    """save_weights_external's result (the SDK's SaveWeightsExternalResponseInternal)."""

    path: str
    size_bytes: int | None = None
    type: Literal["save_weights_external"] | None = "save_weights_external"


class LoadWeightsRequest(_Request):
    """`POST /api/v1/load_weights` -> future of LoadWeightsResponse.

    Create-via-load (create_training_client_from_state[_with_optimizer]): session_id + model_seq_id, no model_id
    or seq_id; the SDK itself names the model `{session_id}:train:{model_seq_id}`. Legacy load into an existing
    model: model_id + seq_id.
    """

    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str  # tinker://{model_id}/weights/{name}
    optimizer: bool  # also restore the optimizer state
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"


class LoadWeightsResponse(_Response):
    """load_weights' result."""

    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] | None = "load_weights"


# --- sampling ----------------------------------------------------------------------------------------------------

class CreateSamplingSessionRequest(_Request):
    """`POST /api/v1/create_sampling_session` (synchronous JSON): a sampler on a base model or a sampler path."""

    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None  # tinker://{model_id}/sampler_weights/{name}
    type: Literal["create_sampling_session"] = "create_sampling_session"


class CreateSamplingSessionResponse(_Response):
    """The new sampler's id."""

    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(_Response):
    """`GET /api/v1/samplers/{sampler_id}`: asked when a SamplingClient is made from a model_path."""

    sampler_id: str
    base_model: str
    model_path: str | None = None


MAX_STOPS = 16  # stop strings or ids in one request, as on the native API


class SamplingParams(_Request):
    """Decoding settings. `stop`: None = stop at EOS only; [] = never stop before max_tokens; strings or ids."""

    # The native API's ranges (api_models.CompletionsRequest): the same sampler behind both.
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: (Annotated[str, Field(min_length=1)]
           | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOPS)]
           | Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOPS)] | None) = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_k: int = -1  # -1: no limit
    top_p: float = Field(1.0, gt=0, le=1)

    def stop_strings(self) -> list[str]:
        """The stop strings (a lone string counts as one)."""
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or [] if isinstance(s, str)]

    def stop_token_ids(self) -> list[int]:
        """The stop token ids."""
        if isinstance(self.stop, str):
            return []
        return [s for s in self.stop or [] if isinstance(s, int)]


class SampleRequest(_Request):
    """`POST /api/v1/asample` -> future of the protobuf SampleResponse (and sample_sequence_ids in the future)."""

    num_samples: int = Field(1, ge=1, le=256)  # and at most the server's max_n (routes.asample)
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None  # what the SDK sends in 0.38 (never base_model/model_path)
    seq_id: int | None = None  # 0, 1, ... per SamplingClient (+1e9 x clone id for unpickled copies)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorData | None = None  # int64 [len(prompt)-1, K] of ids to score; -1 = none
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"
