"""OpenAI-compatible bodies for `POST /v1/chat/completions` and `POST /v1/completions`, and the pure
conversions between them and our own API models (`routes.py` wires them to HTTP).

The OpenAI `model` field names the experiment. One request is one group: it becomes one
`CompletionsRequest`, the orchestrator samples and stores the group, and the answer carries the usual
OpenAI fields plus `group_id`, `policy_version`, `prompt_token_ids` and, per choice, `token_ids`, so the
client can post `{group_id, rewards}` to `/v1/experiments/{model}/feedback` as with the native API. With
`episode_id` (the SDK's `extra_body={"episode_id": ...}`) the call is one turn of that episode: the answer
carries `episode_id`, and `group_id` is null (the episode is rated as a whole).

Parameters:
- honoured: `n`, `temperature`, `top_p`, `max_tokens` (chat: `max_completion_tokens` wins over it),
  `stop` (a string or a list), `seed`, `logprobs`, `episode_id`; chat `tools` (functions),
  `tool_choice` ("none", "auto", "required" or a named function), `parallel_tool_calls`, and histories
  with assistant `tool_calls` (their `content` may be null) and `tool` messages (`tool_call_id`); unset
  ones take the experiment's `sampling` defaults (so an absent `n` is the experiment's group size, not
  OpenAI's 1). The model's calls come back as `message.tool_calls` (`arguments`: JSON text), the text
  outside them as `message.content` (null when there is none), with `finish_reason` "tool_calls".
- rejected with 400 when set to anything but their neutral value, because ignoring them would silently
  change what the caller gets: `frequency_penalty`/`presence_penalty` other than 0,
  a non-empty `logit_bias`, the legacy `functions` (non-empty) and `function_call` other than
  "none"/"auto" (send `tools` / `tool_choice`), non-text content parts, `response_format` other than
  `{"type": "text"}`, `modalities` other than ["text"], `audio`; chat `top_logprobs` > 0 (only the
  sampled token's logprob exists); legacy `logprobs` > 1, `echo: true`, a non-empty `suffix`, `best_of`
  other than 1 or `n`, more than one prompt. Tool errors are 400s with their code: `tool_choice`
  "required" or named without `tools`, a named function not in `tools` (`unknown_tool`), a `tool` message
  without `tool_call_id` (`missing_tool_call_id`) or answering no earlier call (`unknown_tool_call_id`),
  call `arguments` that are not a JSON object (`bad_tool_arguments`), `parameters` that are not a JSON
  schema of an object (`bad_tool_schema`), two tools of one name (`duplicate_tool`).
- vLLM's extensions (`return_token_ids`, `top_k`, `chat_template`, ...): `vllm_fields.py` says which are
  honoured, which rejected unless neutral, and which ignored.
- accepted and ignored: every other field, known (`user`, `metadata`, `store`, `stream_options`,
  `service_tier`, `prompt_cache_key`, `safety_identifier`, `reasoning_effort`, `verbosity`,
  `prediction`, a message's `name`, ...) or not (frameworks add their own).

No ML imports: the handler passes token strings in (it owns the tokenizer).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo_server.api.openai.convert import chat_messages
from grpo_server.api.openai.vllm_fields import (CHAT_NEUTRAL, SAMPLING_NEUTRAL, VllmChatFields, VllmFields,
                                                reject_unless_neutral)
from grpo_server.api_models import CompletionOut, CompletionsRequest, CompletionsResponse
from grpo_server.protocol.errors import BadRequest, Unprocessable, describe_validation_error

# ------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------


class OpenAIBody(BaseModel):
    """Unknown fields are dropped: OpenAI keeps adding some, and frameworks send their own."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBody):
    include_usage: bool | None = Field(None, description="A last chunk with `usage` and no choices.")


class OpenAIRequest(VllmFields, OpenAIBody):
    model: str = Field(min_length=1, description="The experiment's name.")
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None  # as ours
    seed: int | None = None
    stream: bool | None = Field(None, description="Server-sent events (api/openai/streaming.py).")
    stream_options: StreamOptions | None = None  # read only with `stream: true`
    episode_id: str | None = None  # ours: this call is a turn of that episode (checked by CompletionsRequest)
    # Rejected unless neutral (see the module docstring).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None


class OpenAIChatMessage(OpenAIBody):
    """`name`, `refusal` and the like are ignored; `developer` is rendered as `system`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None  # checked as api_models.MessageToolCall
    tool_call_id: str | None = None


class ChatCompletionRequest(OpenAIRequest, VllmChatFields):
    messages: list[OpenAIChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Any] | None = None  # checked as api_models.Tool
    functions: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None


class CompletionRequest(OpenAIRequest):
    """Legacy completions. `prompt`: a string, or token ids; a list of one of either is accepted too."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# ------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------


class Model(BaseModel):
    """An experiment as OpenAI's `GET /v1/models` shows a model: what `model` names in the routes above."""

    id: str
    object: Literal["model"] = "model"
    created: int  # when the experiment was created here (epoch seconds)
    owned_by: str = "grpo-server"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)  # always empty: see top_logprobs


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # JSON text (an object)


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


def _absent(value: Any) -> bool:
    return value is None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the model only called tools
    # Left out without calls, as OpenAI does.
    tool_calls: list[ResponseToolCall] | None = Field(None, exclude_if=_absent)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str
    logprobs: ChatChoiceLogprobs | None
    token_ids: list[int]  # extra: the completion's token ids (multi-turn prompts without re-tokenizing)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # extra: what feedback and exact multi-turn prompts need
    group_id: str | None  # None for an episode's turn: rate the episode
    episode_id: str | None = Field(None, exclude_if=_absent)  # only when the request named one
    policy_version: int
    prompt_token_ids: list[int]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # per token: {sampled token: its logprob}
    text_offset: list[int]  # character offsets into the completion's text (no echo)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None
    token_ids: list[int]
    # With vLLM's `return_token_ids`: where vLLM puts the prompt's ids on a legacy completion (the top-level
    # `prompt_token_ids` is ours, always there).
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent)


class TextCompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    group_id: str | None
    episode_id: str | None = Field(None, exclude_if=_absent)
    policy_version: int
    prompt_token_ids: list[int]


# ------------------------------------------------------------------------------------------------
# OpenAI request -> CompletionsRequest
# ------------------------------------------------------------------------------------------------


def _reject_common(body: OpenAIRequest) -> None:
    # `stream: true` is served (api/openai/streaming.py): the same group, sent as server-sent events.
    for field in ("frequency_penalty", "presence_penalty"):
        if getattr(body, field):
            raise BadRequest(f"{field} is not supported (only 0): the sampler applies no penalties",
                             code="unsupported_parameter")
    if body.logit_bias:
        raise BadRequest("logit_bias is not supported (only an empty one)", code="unsupported_parameter")
    reject_unless_neutral(body, SAMPLING_NEUTRAL)


def _reject_chat(body: ChatCompletionRequest) -> None:
    if body.functions or (body.function_call is not None and body.function_call not in ("none", "auto")):
        raise BadRequest("the legacy 'functions' / 'function_call' are not supported: send 'tools' and "
                         "'tool_choice'", code="tools_unsupported")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise BadRequest("response_format is not supported (only {\"type\": \"text\"}): output is not "
                         "constrained", code="unsupported_parameter")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise BadRequest("only the text modality is supported", code="unsupported_parameter")
    if body.audio is not None:
        raise BadRequest("audio output is not supported", code="unsupported_parameter")
    reject_unless_neutral(body, CHAT_NEUTRAL)
    if body.top_logprobs:
        raise BadRequest("top_logprobs must be 0 or absent: only the sampled token's logprob is available "
                         "(set logprobs: true)", code="unsupported_parameter")


def _request(**fields: Any) -> CompletionsRequest:
    """Our request from OpenAI's fields; our bounds (n >= 1, temperature >= 0, ...) answer 422."""
    try:
        return CompletionsRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise Unprocessable(describe_validation_error(exc), code="invalid_request") from exc


def chat_to_request(body: ChatCompletionRequest) -> CompletionsRequest:
    _reject_common(body)
    _reject_chat(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _request(messages=chat_messages(body.messages), n=body.n, temperature=body.temperature,
                    top_p=body.top_p, max_tokens=max_tokens, stop=body.stop, seed=body.seed,
                    tools=body.tools or None,  # [] (some frameworks send it): no tools
                    tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                    episode_id=body.episode_id)


def completion_to_request(body: CompletionRequest) -> CompletionsRequest:
    _reject_common(body)
    if body.echo:
        raise BadRequest("echo is not supported", code="unsupported_parameter")
    if body.suffix:
        raise BadRequest("suffix is not supported", code="unsupported_parameter")
    if body.best_of is not None and body.best_of not in (1, body.n):
        raise BadRequest("best_of is not supported (only 1 or equal to n): every sample is returned",
                         code="unsupported_parameter")
    if body.logprobs is not None and body.logprobs > 1:
        raise BadRequest("logprobs must be 0 or 1: only the sampled token's logprob is available",
                         code="unsupported_parameter")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"one prompt per request (one group): got {len(prompt)}", code="multiple_prompts")
        prompt = prompt[0]
    if isinstance(prompt, str):
        fields: dict[str, Any] = {"prompt": prompt}
    elif prompt:
        fields = {"prompt_token_ids": prompt}
    else:
        raise BadRequest("prompt is empty", code="empty_prompt")
    return _request(**fields, n=body.n, temperature=body.temperature, top_p=body.top_p,
                    max_tokens=body.max_tokens, stop=body.stop, seed=body.seed, episode_id=body.episode_id)


# ------------------------------------------------------------------------------------------------
# CompletionsResponse -> OpenAI response
# ------------------------------------------------------------------------------------------------


def _usage(result: CompletionsResponse) -> Usage:
    completion_tokens = sum(len(c.token_ids) for c in result.completions)
    prompt_tokens = len(result.prompt_token_ids)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _chat_logprobs(completion: CompletionOut, token_text: Mapping[int, str]) -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(content=[
        ChatTokenLogprob(token=token_text[t], logprob=lp, bytes=list(token_text[t].encode()))
        for t, lp in zip(completion.token_ids, completion.logprobs)])


def _response_id(result: CompletionsResponse) -> str:
    # An episode's turn has no group: its answer still gets an id of its own.
    return result.group_id or f"{result.episode_id}-{uuid.uuid4().hex[:12]}"


def _response_message(completion: CompletionOut) -> ChatResponseMessage:
    """The parsed calls and the text outside them when the model called tools; else its text."""
    if completion.tool_calls:
        return ChatResponseMessage(content=completion.content, tool_calls=[
            ResponseToolCall(id=call.id, function=ResponseFunction(name=call.name, arguments=call.arguments))
            for call in completion.tool_calls])
    return ChatResponseMessage(content=completion.text if completion.content is None else completion.content)


def chat_response(model: str, result: CompletionsResponse, created: int,
                  token_text: Mapping[int, str] | None = None) -> ChatCompletionResponse:
    """`token_text` (token id -> its decoded string) is given when logprobs were asked for."""
    return ChatCompletionResponse(
        id=f"chatcmpl-{_response_id(result)}", created=created, model=model, usage=_usage(result),
        group_id=result.group_id, episode_id=result.episode_id, policy_version=result.policy_version,
        prompt_token_ids=result.prompt_token_ids,
        choices=[ChatChoice(index=i, message=_response_message(c), finish_reason=c.finish_reason,
                            logprobs=None if token_text is None else _chat_logprobs(c, token_text),
                            token_ids=c.token_ids)
                 for i, c in enumerate(result.completions)])


def _completion_logprobs(completion: CompletionOut, token_text: Mapping[int, str]) -> CompletionLogprobs:
    tokens = [token_text[t] for t in completion.token_ids]
    offsets, offset = [], 0
    for token in tokens:  # as vLLM: offsets from the token strings' lengths
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(completion.logprobs),
                              top_logprobs=[{tok: lp} for tok, lp in zip(tokens, completion.logprobs)],
                              text_offset=offsets)


def completion_response(model: str, result: CompletionsResponse, created: int,
                        token_text: Mapping[int, str] | None = None,
                        return_token_ids: bool = False) -> TextCompletionResponse:
    prompt_ids = result.prompt_token_ids if return_token_ids else None
    return TextCompletionResponse(
        id=f"cmpl-{_response_id(result)}", created=created, model=model, usage=_usage(result),
        group_id=result.group_id, episode_id=result.episode_id, policy_version=result.policy_version,
        prompt_token_ids=result.prompt_token_ids,
        choices=[CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason, token_ids=c.token_ids,
                                  logprobs=None if token_text is None else _completion_logprobs(c, token_text),
                                  prompt_token_ids=prompt_ids)
                 for i, c in enumerate(result.completions)])
