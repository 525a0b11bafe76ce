"""Tinker wire data types (SDK 0.38): tensors, model inputs, datums, and the forward/sample results.

Named as in the SDK (`tinker.types`). A `TensorData` is a flat value list plus a dtype and shape (dense, or sparse
CSR); a `ModelInput` is a list of chunks, of which this server reads only `encoded_text`. Requests reach these
types two ways: `forward_backward` as protobuf (protobuf.decode_forward_backward_request), `asample`'s prompt
and `target_prompt_logprobs` as JSON (schema.SampleRequest). The result types here are the server's own
representation of what protobuf.py encodes back. The RestClient's checkpoint and training-run records (JSON) are
at the end; schema.py re-exports them.
"""

from __future__ import annotations

import base64
import math
from typing import Annotated, Any, Literal

from datetime import datetime

from pydantic import (BaseModel, ConfigDict, Field, WithJsonSchema, field_serializer, field_validator,
                      model_validator)

TensorDtype = Literal["int64", "float32"]
# A tensor's shape is checked before anything is built from it (issue 46: a shape of 40,000 large entries held the
# event loop for seconds multiplying them, and a 16-byte CSR shape made `flat` allocate gigabytes): at most
# MAX_DIMS dimensions, each at most MAX_DIM (more than any context length or vocabulary this server runs), and a
# dense size, CSR included, of at most MAX_DENSE_VALUES (a sequence's full-vocabulary rows: 256 x 64k).
MAX_DIMS = 4
MAX_DIM = 1 << 20
MAX_DENSE_VALUES = 1 << 24
# What one request may hold, counted before anything is built from it (issue 57: the bound above is per tensor, and
# a 16 KB body of many CSR tensors made the front end build 12.5 GiB of lists). Datums: the SDK sends at most its
# `fwdbwd_max_chunk_len` (1024) a call. Chunks: a model input is a few runs of text. Loss inputs: the built-in losses
# read at most five per-position tensors (target_tokens, weights, logprobs, advantages, mask), and every dense
# value of a request's loss inputs counts against LOSS_VALUES_PER_POSITION x its token cap (service.py).
MAX_DATUMS_PER_CALL = 1024
MAX_CHUNKS_PER_INPUT = 1024
MAX_LOSS_INPUTS = 16
LOSS_VALUES_PER_POSITION = 16


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def _flatten(values: Any) -> tuple[list, list[int]]:
    """A nested rectangular list as (flat values, shape)."""
    if not isinstance(values, (list, tuple)):
        return [values], []
    if not values:
        return [], [0]
    parts = [_flatten(v) for v in values]
    inner = parts[0][1]
    if any(shape != inner for _, shape in parts):
        raise ValueError("a ragged nested list is not a tensor")
    return [x for flat, _ in parts for x in flat], [len(values), *inner]


def _nest(flat: list, shape: list[int]) -> list:
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


class TensorData(_Wire):
    """A tensor: flat row-major `data`, its `dtype` and `shape`; sparse CSR when the index lists are set."""

    data: list[int] | list[float]
    dtype: TensorDtype
    shape: list[Annotated[int, Field(ge=0, le=MAX_DIM)]] | None = Field(None, max_length=MAX_DIMS)  # None: 1-D
    sparse_crow_indices: list[int] | None = None  # CSR row pointers (nrows + 1); `data` holds only the nnz values
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> TensorData:
        if (self.sparse_crow_indices is None) != (self.sparse_col_indices is None):
            raise ValueError("sparse_crow_indices and sparse_col_indices come together")
        # Each dimension is at most MAX_DIM and there are at most MAX_DIMS: the product is a small int.
        size = math.prod(self.shape) if self.shape is not None else len(self.data)
        if size > MAX_DENSE_VALUES:
            raise ValueError(f"shape {self.shape} holds {size} values, over the {MAX_DENSE_VALUES} served")
        if self.sparse_crow_indices is not None:
            if self.shape is None or len(self.shape) != 2:
                raise ValueError("a sparse CSR tensor needs a 2-D shape")
            crow, col = self.sparse_crow_indices, self.sparse_col_indices or []
            if len(crow) != self.shape[0] + 1 or len(col) != len(self.data):
                raise ValueError("CSR index lists do not match the shape and the number of values")
            if crow[0] != 0 or crow[-1] != len(col) or any(a > b for a, b in zip(crow, crow[1:])):
                raise ValueError("CSR row pointers must rise from 0 to the number of values")
            if any(not 0 <= c < self.shape[1] for c in col):
                raise ValueError(f"a CSR column index is outside [0, {self.shape[1]})")
        elif self.shape is not None and size != len(self.data):
            raise ValueError(f"shape {self.shape} does not hold {len(self.data)} values")
        if self.dtype == "int64" and any(isinstance(v, float) and not v.is_integer() for v in self.data):
            raise ValueError("an int64 tensor holds a non-integer value")
        return self

    @property
    def dense_shape(self) -> list[int]:
        return list(self.shape) if self.shape is not None else [len(self.data)]

    @property
    def dense_size(self) -> int:
        """How many values `flat` builds (a CSR tensor's zeros included), known without building them."""
        return math.prod(self.dense_shape)

    def flat(self, pad_value: int | float = 0) -> list[int] | list[float]:
        """The dense values, row-major (a CSR tensor is filled with `pad_value` where nothing is listed)."""
        cast = int if self.dtype == "int64" else float
        if self.sparse_crow_indices is None:
            return [cast(v) for v in self.data]  # type: ignore[return-value]
        rows, cols = self.dense_shape
        out = [cast(pad_value)] * (rows * cols)
        crow, col = self.sparse_crow_indices, self.sparse_col_indices or []
        for r in range(rows):
            for i in range(crow[r], crow[r + 1]):
                out[r * cols + col[i]] = cast(self.data[i])
        return out  # type: ignore[return-value]

    def tolist(self, pad_value: int | float = 0) -> list:
        """The dense values as a nested Python list of `shape`."""
        return _nest(self.flat(pad_value), self.dense_shape)

    @classmethod
    def from_list(cls, values: Any, dtype: TensorDtype | None = None) -> TensorData:
        """A dense tensor from a (nested, rectangular) list; dtype int64 when every value is an int."""
        flat, shape = _flatten(values)
        if dtype is None:
            dtype = "int64" if all(isinstance(v, int) and not isinstance(v, bool) for v in flat) else "float32"
        flat = [int(v) for v in flat] if dtype == "int64" else [float(v) for v in flat]
        return cls(data=flat, dtype=dtype, shape=shape or [1])


class EncodedTextChunk(_Wire):
    """A run of token ids."""

    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"


# Bytes travel as base64 text in JSON: the schema says so (OpenAPI has no raw binary in a JSON body).
Base64Field = Annotated[bytes, WithJsonSchema({"type": "string", "contentEncoding": "base64"})]


def _b64(value: bytes | str) -> bytes:
    return base64.b64decode(value) if isinstance(value, str) else value


class ImageChunk(_Wire):
    """An inline image (base64 in JSON, raw bytes in protobuf); refused by this text-only server."""

    data: Base64Field
    format: str  # "png" | "jpeg"
    expected_tokens: int | None = None
    type: Literal["image"] = "image"

    @field_validator("data", mode="before")
    @classmethod
    def _decode(cls, value: bytes | str) -> bytes:
        return _b64(value)

    @field_serializer("data")
    def _encode(self, value: bytes) -> str:
        return base64.b64encode(value).decode()


class ImageAssetPointerChunk(_Wire):
    """An image by location (JSON only; the protobuf request cannot carry it); refused by this server."""

    format: str
    location: str
    expected_tokens: int | None = None
    type: Literal["image_asset_pointer"] = "image_asset_pointer"


class DmelChunk(_Wire):
    """Audio tokens as serialized tensor bytes; refused by this server."""

    dmel: Base64Field
    type: Literal["dmel"] = "dmel"

    @field_validator("dmel", mode="before")
    @classmethod
    def _decode(cls, value: bytes | str) -> bytes:
        return _b64(value)

    @field_serializer("dmel")
    def _encode(self, value: bytes) -> str:
        return base64.b64encode(value).decode()


ModelInputChunk = Annotated[EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk,
                            Field(discriminator="type")]


class ModelInput(_Wire):
    """A model input: chunks concatenated in order."""

    chunks: list[ModelInputChunk] = Field(max_length=MAX_CHUNKS_PER_INPUT)

    def tokens(self) -> list[int]:
        """The token ids of all chunks, in order; ValueError for any non-text chunk."""
        return model_input_tokens(self)

    @property
    def length(self) -> int:
        """Its token positions, counted without building the list (a non-text chunk counts as none)."""
        return sum(len(c.tokens) for c in self.chunks if isinstance(c, EncodedTextChunk))


def model_input_tokens(model_input: ModelInput) -> list[int]:
    """Flatten a ModelInput to token ids; raise ValueError on image/audio chunks, which this server cannot run."""
    out: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, EncodedTextChunk):
            raise ValueError(f"model_input chunk {i} is a {chunk.type!r} chunk: this server serves a text-only "
                             "model and accepts only 'encoded_text' chunks")
        out.extend(chunk.tokens)
    return out


class ProvenanceSpan(_Wire):
    """A run of datum positions taken from a sampled sequence's prompt or sampled tokens (stable_reinforce)."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int = 0
    length: int


class Datum(_Wire):
    """One training sequence: its model input and the named per-position tensors its loss reads."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field({}, max_length=MAX_LOSS_INPUTS)
    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None

    def tokens(self) -> list[int]:
        """The model input's token ids (ValueError for non-text chunks)."""
        return model_input_tokens(self.model_input)

    def input_list(self, name: str, pad_value: int | float = 0) -> list:
        """A loss input as a flat dense list; KeyError naming the input when the datum lacks it."""
        if name not in self.loss_fn_inputs:
            raise KeyError(f"loss_fn_inputs has no {name!r} (it has {sorted(self.loss_fn_inputs)})")
        return self.loss_fn_inputs[name].flat(pad_value)


LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce",
                     "custom"]


class ForwardBackwardInput(_Wire):
    """The batch and the loss: its name and constructor kwargs (e.g. ppo's clip thresholds, dro's beta)."""

    data: list[Datum] = Field(max_length=MAX_DATUMS_PER_CALL)
    loss_fn: str  # one of LossFnType; kept open so an unknown name is a user error the server reports itself
    loss_fn_config: dict[str, float | str] | None = Field(None, max_length=MAX_LOSS_INPUTS)


class ForwardBackwardRequest(_Wire):
    """`POST /api/v1/forward_backward` (protobuf on the wire): a forward(+backward) pass on `model_id`."""

    model_id: str
    seq_id: int | None = None  # 1, 2, ... per TrainingClient, shared with optim_step and the saves/loads
    forward_only: bool = False  # TrainingClient.forward(): loss and outputs, no gradients
    forward_backward_input: ForwardBackwardInput


class ForwardBackwardOutput(_Wire):
    """A forward/forward_backward result: per-datum output tensors (`logprobs` [N]) and `name:reduction` metrics."""

    loss_fn_output_type: str = "ArrayRecord"
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = {}  # e.g. {"loss:sum": ...}; the SDK splits every key on ':' to combine chunks

    @field_validator("metrics")
    @classmethod
    def _reductions(cls, metrics: dict[str, float]) -> dict[str, float]:
        bad = [key for key in metrics if key.count(":") != 1]
        if bad:
            raise ValueError(f"metric names need exactly one ':reduction' suffix (sum, mean, min, max, ...): {bad}")
        return metrics


TopkRow = list[tuple[int, float]] | None  # up to k (token id, logprob); None where nothing was scored


class SampledSequence(_Wire):
    """One completion: its tokens (ending with the stop token/string when stop_reason is 'stop') and logprobs."""

    stop_reason: Literal["stop", "length"]
    tokens: list[int]
    logprobs: list[float] | None = None
    topk_logprobs: list[TopkRow] | None = None  # topk_sample_logprobs > 0: one row per sampled token


class SampleResponse(_Wire):
    """A sample result: `num_samples` sequences, plus prompt scoring when asked (None at position 0)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[TopkRow] | None = None
    prompt_cache_hit_tokens: int = 0
    target_prompt_logprobs: TensorData | None = None


# --- RestClient records (JSON; re-exported by schema.py) ----------------------------------------------------------

class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class OptimizerConfig(_Wire):
    """The optimizer family, fixed for the model's life: "adamw" unless the client chose another."""

    type: str = "adamw"


class HealthResponse(_Record):
    """`GET /api/v1/healthz` (no SDK client calls it in 0.38)."""

    status: Literal["ok"] = "ok"


class SupportedModel(_Record):
    """A base model the server can train and sample."""

    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


# The tinker SDK releases this server is tested with, oldest first: the newest patch of each minor release from
# the floor to the release constraints.txt pins (0.37 was never on PyPI). tests/test_tinker_sdk_range.py runs the
# SDK's documented loop with each; docs/guides/tinker.md "Supported SDK versions" says why the floor is 0.22.
SDK_RELEASES_TESTED = ("0.22.7", "0.23.4", "0.24.1", "0.25.0", "0.26.2", "0.27.2", "0.28.1", "0.29.1", "0.30.4",
                       "0.31.0", "0.32.0", "0.33.1", "0.34.0", "0.35.0", "0.36.0", "0.38.0")


class SdkVersions(_Record):
    """The tinker SDK releases this server supports: `min` to `max`, each of `tested` run by the suite."""

    min: str
    max: str
    tested: list[str]


class GetServerCapabilitiesResponse(_Record):
    """`GET /api/v1/get_server_capabilities` (RestClient). The SDK ignores fields it does not know (its response
    models allow extras), so `supported_sdk_versions` reaches a client reading the JSON, not the SDK's object."""

    supported_models: list[SupportedModel]
    supported_sdk_versions: SdkVersions | None = None


class WeightsInfoRequest(_Wire):
    """`POST /api/v1/weights_info`."""

    tinker_path: str


class WeightsInfoResponse(_Record):
    """What loading a checkpoint needs to know."""

    base_model: str
    is_lora: bool
    optimizer_config: OptimizerConfig = OptimizerConfig()
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class Checkpoint(_Record):
    """A saved checkpoint; checkpoint_id is "weights/{name}" or "sampler_weights/{name}"."""

    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class Cursor(_Record):
    """Pagination of a listing."""

    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(_Record):
    """`GET /api/v1/training_runs/{model_id}/checkpoints` (and `GET /api/v1/checkpoints` for all runs)."""

    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(_Record):
    """`GET /api/v1/training_runs/{model_id}` (cookbook: renderer and base model of a checkpoint's run)."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None
