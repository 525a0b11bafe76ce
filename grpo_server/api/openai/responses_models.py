"""`POST /v1/responses` bodies (the OpenAI Responses API) and the pure conversions between them and our own
`CompletionsRequest` / `CompletionsResponse` (`responses.py` wires them to HTTP, `responses_stream.py` streams).

A response is ONE completion of the experiment `model` names: the Responses API has no `n` and one `output`
per response, and its main use here is agent turns (episodes: `episode_id` in the body or the `X-Episode-Id`
header, as on chat completions). Without an episode it is a group of one unless our extension field `n` asks
for more: then `output` is the first sample and `samples` lists every sample (output items, token ids, finish
reason) in the order feedback takes their rewards. A group of one trains nothing alone (its advantage is 0).

Unlike chat completions, whose unknown fields are ignored, every top-level field is checked (the Responses
API is younger and its clients, the openai package and the Agents SDK, send only its own fields): an unknown
one is a 400 `unknown_parameter`; a known one we cannot honour is a 400 `unsupported_parameter` unless it has
its neutral value (the lists below say which is which). Field names follow `openai.types.responses`, and an
answer holds every field the Open Responses spec's `ResponseResource` requires (tests/test_open_responses.py).

No ML imports: the handler passes token strings in (it owns the tokenizer).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from grpo_server.api.openai.responses_items import items_to_messages
from grpo_server.api_models import ChatMessage, CompletionOut, CompletionsResponse
from grpo_server.protocol.errors import BadRequest

# ------------------------------------------------------------------------------------------------
# The request
# ------------------------------------------------------------------------------------------------

# Known fields accepted whatever their value: hints with no effect on what is sampled here (the answer echoes
# user, safety_identifier, prompt_cache_key and max_tool_calls; service_tier is answered as the one used, "default").
IGNORED = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
           "service_tier", "stream_options", "max_tool_calls",  # max_tool_calls counts built-in tools: none here
           "reasoning",  # the model has no reasoning mode (chat ignores reasoning_effort alike)
           "background_options")  # only read with background: true, which is refused
# Known fields refused unless absent, null, false or empty: features this server does not have.
UNSUPPORTED = {"prompt": "stored prompt templates", "conversation": "the Conversations API (use "
               "previous_response_id)", "background": "background mode", "context_management": "compaction",
               "moderation": "moderation", "access_programs": "access programs", "image": "image input"}
# Known fields refused unless absent, null or 0: the sampler applies no penalties (as on chat completions).
PENALTIES = ("presence_penalty", "frequency_penalty")
FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(BaseModel):
    """Extra fields are kept to be refused by name (a 400, as OpenAI answers an unknown parameter), and the
    document says there are none."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: str = Field(min_length=1, description="The experiment's name.")
    input: str | list[dict[str, Any]] | None = Field(None, description=(
        "Text (one user message) or items: messages (user, system, developer, assistant; text parts), "
        "function_call and function_call_output."))
    instructions: str | None = Field(None, description="A system message before the input (not carried over by "
                                                       "previous_response_id, as OpenAI does).")
    previous_response_id: str | None = Field(None, description="Continue a stored response of this experiment.")
    store: bool | None = Field(None, description="Keep the response for previous_response_id (default true).")
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools "
                                                                 "{type, name, description, parameters, strict}.")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_048_576)  # ge=1 as our max_tokens (OpenAI: 16)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = None
    # Ours.
    episode_id: str | None = None  # a turn of that episode (checked by CompletionsRequest)
    n: int | None = Field(None, ge=1, le=256, description="Ours: sample a group of n (default 1); `output` is "
                                                          "the first, `samples` has them all.")
    # Accepted and ignored, or refused unless neutral (the lists above).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    context_management: list[Any] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None


def check_fields(body: ResponsesRequest) -> None:
    """400 for an unknown field and for a known one we cannot honour (see the module docstring)."""
    if body.model_extra:
        names = sorted(body.model_extra)
        raise BadRequest(f"unknown parameter(s): {', '.join(names)} (POST /v1/responses takes the Responses API's "
                         "fields, docs/guides/responses.md)", code="unknown_parameter", param=names[0])
    for name, what in UNSUPPORTED.items():
        if getattr(body, name):
            raise BadRequest(f"{name} is not supported: this server has no {what}", code="unsupported_parameter",
                             param=name)
    for name in PENALTIES:
        if getattr(body, name):
            raise BadRequest(f"{name} is not supported (only 0): the sampler applies no penalties",
                             code="unsupported_parameter", param=name)
    if body.top_logprobs:
        raise BadRequest("top_logprobs must be 0 or absent: only the sampled token's logprob is available "
                         f"(include {LOGPROBS_INCLUDE!r})", code="unsupported_parameter", param="top_logprobs")
    form = (body.text or {}).get("format") or {"type": "text"}
    if not isinstance(form, dict) or form.get("type") != "text":
        raise BadRequest("text.format is not supported (only {\"type\": \"text\"}): output is not constrained",
                         code="unsupported_parameter", param="text.format")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's `{type, function: {...}}`; built-in tools are a 400."""
    if not tools:
        return None  # [] (the Agents SDK sends it without tools): no tools
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise BadRequest(f"tools.{i}: only function tools are supported, not {kind!r}", code="unsupported_tool",
                             param=f"tools.{i}")
        extra = sorted(k for k, v in tool.items() if k not in FUNCTION_TOOL_KEYS and v not in (None, False))
        if extra:
            raise BadRequest(f"tools.{i}: {', '.join(extra)} not supported", code="unsupported_tool",
                             param=f"tools.{i}.{extra[0]}")
        out.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                     if k in FUNCTION_TOOL_KEYS - {"type"} and v is not None}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise BadRequest(f"tool_choice {choice!r} is not supported: \"none\", \"auto\", \"required\" or "
                         "{\"type\": \"function\", \"name\": ...}", code="unsupported_tool_choice", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def conversation(body: ResponsesRequest, history: list[ChatMessage]) -> tuple[list[ChatMessage], list[ChatMessage]]:
    """(the messages to render: instructions, `history` (a previous response's), the input; the conversation
    to store: the same without the instructions, which OpenAI does not carry over)."""
    raw = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input or []
    new = items_to_messages(raw)
    if not history and not new:
        raise BadRequest("input is empty: give text or items (or previous_response_id)", code="empty_input",
                         param="input")
    stored = history + new
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    return system + stored, stored


# ------------------------------------------------------------------------------------------------
# The answer
# ------------------------------------------------------------------------------------------------

Status = Literal["in_progress", "completed", "incomplete", "failed"]


class TokenLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)  # always empty: only the sampled token


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)  # with include message.output_text.logprobs


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str  # what a function_call_output answers (the parsed call's id)
    name: str
    arguments: str  # JSON text
    status: Status


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str
    message: str


class FunctionTool(BaseModel):
    """A function tool as the answer echoes it: every key, null where the request left it out (the Open
    Responses spec requires all five)."""

    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def echoed_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """The request's tools as the answer echoes them (`chat_tools` has refused any other kind, and other keys
    unless null or false)."""
    return [FunctionTool(**{key: tool.get(key) for key in FUNCTION_TOOL_KEYS - {"type"}}) for tool in tools or []]


class Sample(BaseModel):
    """Ours (with n > 1): one sample of the group, in feedback's order; samples[0] is `output`."""

    output: list[OutputItem]
    token_ids: list[int]
    finish_reason: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None
    output: list[OutputItem]
    tools: list[FunctionTool]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    presence_penalty: float = 0.0  # refused unless 0: the sampler applies none
    frequency_penalty: float = 0.0
    top_logprobs: int = 0  # refused unless 0: only the sampled token's logprob
    max_output_tokens: int | None
    max_tool_calls: int | None = None  # echoed: it bounds built-in tools' calls, which there are none of here
    previous_response_id: str | None
    store: bool
    background: Literal[False] = False  # background: true is refused
    service_tier: Literal["default"] = "default"  # whatever the request asked: one tier here
    safety_identifier: str | None = None  # echoed
    prompt_cache_key: str | None = None  # echoed (vLLM's prefix cache needs no key)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None  # None until sampled (a stream's first events)
    # Ours: what feedback and exact multi-turn prompts need.
    group_id: str | None  # None for an episode's turn: rate the episode
    episode_id: str | None = None
    policy_version: int | None = None  # None until sampled
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None  # the output's completion
    samples: list[Sample] | None = None  # with n > 1


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(completion: CompletionOut, status: Status,
                 logprobs: list[TokenLogprob] | None = None) -> list[OutputItem]:
    """A completion as output items: its text (the text outside the calls when it called tools: the same
    `content` chat completions gives) as one message, unless empty beside calls, then one function_call per
    call. `responses_items.items_to_messages` reads them back as the one assistant turn they were."""
    items: list[OutputItem] = []
    text = completion.content if completion.tool_calls is not None else completion.text
    if text or not completion.tool_calls:
        items.append(OutputMessage(id=_new_id("msg"), status=status,
                                   content=[OutputText(text=text or "", logprobs=logprobs or [])]))
    for call in completion.tool_calls or []:
        items.append(FunctionCall(id=_new_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments,
                                  status=status))
    return items


@dataclass
class Echo:
    """What a response repeats of its request, known before sampling (a stream's first events carry it)."""

    model: str
    instructions: str | None
    tools: list[FunctionTool]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    user: str | None
    truncation: Literal["auto", "disabled"]
    logprobs: bool  # include message.output_text.logprobs
    max_tool_calls: int | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def skeleton(self, group_id: str | None, episode_id: str | None) -> ResponseObject:
        return ResponseObject(
            id=self.id, created_at=self.created_at, status="in_progress", model=self.model,
            instructions=self.instructions, output=[], tools=self.tools, tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls, temperature=self.temperature, top_p=self.top_p,
            max_output_tokens=self.max_output_tokens, previous_response_id=self.previous_response_id,
            store=self.store, metadata=self.metadata, user=self.user, truncation=self.truncation,
            max_tool_calls=self.max_tool_calls, safety_identifier=self.safety_identifier,
            prompt_cache_key=self.prompt_cache_key, group_id=group_id, episode_id=episode_id)

    def answer(self, result: CompletionsResponse, token_text: Mapping[int, str] | None) -> ResponseObject:
        """The sampled `result` as the response; `token_text` (id -> its string) when logprobs were asked."""
        samples = []
        for completion in result.completions:
            status: Status = "incomplete" if completion.finish_reason == "length" else "completed"
            logprobs = None if token_text is None else [
                TokenLogprob(token=token_text[t], bytes=list(token_text[t].encode()), logprob=lp)
                for t, lp in zip(completion.token_ids, completion.logprobs)]
            samples.append(Sample(output=output_items(completion, status, logprobs), token_ids=completion.token_ids,
                                  finish_reason=completion.finish_reason))
        first = result.completions[0]
        prompt_tokens = len(result.prompt_token_ids)
        output_tokens = sum(len(c.token_ids) for c in result.completions)
        incomplete = first.finish_reason == "length"  # OpenAI: cut by max_output_tokens
        return self.skeleton(result.group_id, result.episode_id).model_copy(update=dict(
            status="incomplete" if incomplete else "completed", completed_at=int(time.time()),
            incomplete_details=IncompleteDetails() if incomplete else None, output=samples[0].output,
            usage=ResponseUsage(input_tokens=prompt_tokens, output_tokens=output_tokens,
                                total_tokens=prompt_tokens + output_tokens),
            policy_version=result.policy_version, prompt_token_ids=result.prompt_token_ids,
            token_ids=first.token_ids, samples=samples if len(samples) > 1 else None))
