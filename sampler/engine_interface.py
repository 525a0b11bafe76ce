"""The engine interface the sampler's HTTP layer talks to, and what both engines share.

Two engines implement it: `VllmEngine` (vLLM's in-process async engine, LoRA enabled) and `HfEngine`
(transformers + peft, for machines without vLLM). Both check requests here first, so they refuse the
same inputs with the same codes (`grpo_server/protocol/errors.py`'s `ApiError` kinds), and both report the
same `max_model_len`. Which one runs is sampler/engine_choice.py's choice; this module imports neither.
"""

from __future__ import annotations

import abc
import json
import logging
from pathlib import Path
from typing import Any

from grpo_server.protocol.errors import BadRequest, NotFound
from grpo_server.protocol.worker_config import SamplerConfig
from grpo_server.protocol.wire import (AdapterRef, GenerateRequest, GenerateResponse, PrefixCacheCounts, ScoreRequest,
                                       ScoreResponse)

log = logging.getLogger(__name__)

# config.json keys that bound the context length, in the order vLLM reads them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def adapter_not_loaded(adapter: AdapterRef) -> NotFound:
    return NotFound(f"adapter {adapter.key} is not loaded on this sampler", code="adapter_not_loaded")


class ModelLimits:
    """Vocabulary size and context length of the served model, read from its config.json.

    `max_model_len` is the configured length, clamped to one less than the model's own context bound:
    vLLM refuses a prompt that fills the whole context (it needs room for one output token), and
    `score` sends prompt + completion as one prompt, so the vLLM engine starts with max_model_len + 1
    and a generated sequence of exactly max_model_len tokens can still be scored.
    """

    def __init__(self, model_path: Path, configured_max_len: int) -> None:
        data = json.loads((Path(model_path) / "config.json").read_text())
        text = data.get("text_config") or data
        self.vocab_size: int = int(text["vocab_size"])
        bound = next((int(text[key]) for key in _CONTEXT_KEYS if text.get(key)), None)
        self.max_model_len = configured_max_len
        if bound is not None and configured_max_len > bound - 1:
            self.max_model_len = bound - 1
            log.warning(
                "max_model_len %d is over the model's context (%d); serving %d",
                configured_max_len, bound, self.max_model_len,
            )

    def check_ids(self, ids: list[int], what: str) -> None:
        bad = [i for i in ids if i < 0 or i >= self.vocab_size]
        if bad:
            raise BadRequest(f"{what}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def check_generate(self, req: GenerateRequest) -> None:
        self.check_ids(req.prompt_token_ids, "prompt_token_ids")
        if req.temperature < 0:
            raise BadRequest("temperature must be >= 0")
        if not 0 < req.top_p <= 1:
            raise BadRequest("top_p must be in (0, 1]")
        if req.stop and any(not s for s in req.stop):
            raise BadRequest("stop strings must be non-empty")
        prompt_len = len(req.prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise BadRequest(
                f"the prompt has {prompt_len} tokens; max_model_len is {self.max_model_len} "
                "(prompt + max_tokens must fit)",
                code="prompt_too_long",
            )
        if prompt_len + req.max_tokens > self.max_model_len:
            raise BadRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({req.max_tokens}) is over "
                f"max_model_len ({self.max_model_len})",
            )

    def check_score(self, req: ScoreRequest) -> None:
        self.check_ids(req.prompt_token_ids, "prompt_token_ids")
        if req.temperature < 0:
            raise BadRequest("temperature must be >= 0")
        for i, completion in enumerate(req.completions_token_ids):
            self.check_ids(completion, f"completions_token_ids[{i}]")
            total = len(req.prompt_token_ids) + len(completion)
            if total > self.max_model_len:
                code = "prompt_too_long" if len(req.prompt_token_ids) >= self.max_model_len else "bad_request"
                raise BadRequest(
                    f"prompt + completions_token_ids[{i}] is {total} tokens; "
                    f"max_model_len is {self.max_model_len}",
                    code=code,
                )


def check_adapter_dir(path: str, max_rank: int) -> dict[str, Any]:
    """The adapter's peft config, after checking the folder is one both engines can load.

    Checked here so a bad push fails with a clear 400 instead of vLLM's worker traceback.
    """
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise BadRequest(f"{path}: no adapter_config.json (expected a peft adapter folder)", code="bad_adapter")
    if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise BadRequest(f"{path}: no adapter_model.safetensors", code="bad_adapter")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise BadRequest(f"{config_file}: {exc}", code="bad_adapter") from exc
    targets = config.get("target_modules") or []
    names = targets if isinstance(targets, list) else [targets]
    # vLLM leaves an lm_head LoRA out of prompt logprobs (vllm#51594): scores would silently differ.
    if any(part in str(name) for name in names for part in ("lm_head", "embed_tokens")):
        raise BadRequest(f"{path}: LoRA on lm_head / embed_tokens is not served (targets {targets})",
                         code="bad_adapter")
    ranks = [int(config.get("r") or 0), *map(int, (config.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise BadRequest(f"{path}: LoRA rank {max(ranks)} is over max_lora_rank {max_rank}", code="bad_adapter")
    return config


def completion_text(tokenizer: Any, token_ids: list[int], stop_string: str | None) -> str:
    """The text of a completion: the detokenization of its token ids, cut before a matched stop string.

    Both engines use this, so `text == tokenizer.decode(token_ids, skip_special_tokens=True)` except
    where a stop string ended the completion (then the text ends before it, as vLLM's does; the token
    ids still hold the token that completed the stop string). vLLM's own incremental text is not
    used: with byte-level tokens it can carry characters of the prompt into the completion's text.
    """
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if stop_string:
        cut = text.find(stop_string)
        if cut >= 0:
            text = text[:cut]
    return text


def torch_dtype_name(name: str) -> str:
    """The torch dtype (its name: "float32", "bfloat16", ...) a configured `dtype` means for both engines:
    'auto' is float32 on CPU (exact agreement with the learner) and bfloat16 on CUDA."""
    if name != "auto":
        return name
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


class Engine(abc.ABC):
    """The sampler's verbs. Implementations raise `ApiError` kinds for anything the caller got wrong."""

    name: str

    def __init__(self, config: SamplerConfig) -> None:
        self.config = config
        self.limits = ModelLimits(config.model_path, config.max_model_len)
        # Merged serving (the vLLM engine; sampler/merged_serving.py): the version in the weights now, and
        # why this engine never merges (None when it does).
        self.merged: str | None = None
        self.merge_unsupported: str | None = f"the {self.name} engine serves adapters as adapters"
        self.prefix_cache: PrefixCacheCounts | None = None  # the vLLM engine counts its prefix-cache hits
        self.dtype_name = torch_dtype_name(config.dtype)  # what it computes in: the front end picks its check by it
        self.compiled: bool | None = None  # whether the model runs torch.compile'd; None: not said (an engine without)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    @abc.abstractmethod
    async def score(self, req: ScoreRequest) -> ScoreResponse: ...

    @abc.abstractmethod
    async def load_adapter(self, adapter: AdapterRef, path: str) -> None: ...

    @abc.abstractmethod
    async def unload_adapter(self, adapter: AdapterRef) -> None: ...

    @abc.abstractmethod
    async def loaded_adapters(self) -> list[str]: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...

    async def pause(self, lease_s: float) -> bool:
        """Freeze running requests until `resume` (or `lease_s`), so that a train step has the cores alone: whether
        this engine did. Only vLLM's can; the others go on."""
        return False

    async def resume(self) -> None:
        return None

