"""The Anthropic Messages API's bodies for `POST /v1/messages` and `POST /v1/messages/count_tokens`: the requests,
the message answer and the events of its stream, with the field names the `anthropic` package uses. What becomes
of each field is `convert.py`'s (its docstring lists what is served and what is refused); `routes.py` wires them
to HTTP. No ML imports.

Requests ignore unknown fields, as the OpenAI chat route does: frameworks send the API's newer and beta fields
(`cache_control`, `service_tier`, `context_management`, ...) whether or not they matter; the known ones that
would change what is sampled and cannot be honoured are refused by name (`convert.check_fields`). A content
block is read by its `type` in `convert.py`, so that an unsupported one is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel

from grpo_server.api.openapi import AnthropicErrorDetail

# ------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------


class MessagesBody(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputMessage(MessagesBody):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(description=(
        "Text, or content blocks: `text`, `tool_use` (assistant), `tool_result` (user)."))


class MessageCountTokensRequest(MessagesBody):
    """What `count_tokens` takes: the prompt's parts (Anthropic's MessageCountTokensParams)."""

    model: str = Field(min_length=1, description="The experiment's name.")
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = Field(None, description="Text, or `text` blocks: the system "
                                                                        "message first.")
    tools: list[dict[str, Any]] | None = Field(None, description="Custom tools {name, description, input_schema}.")
    tool_choice: dict[str, Any] | None = Field(None, description="{type: auto | any | tool (with name) | none}, "
                                                                 "and disable_parallel_tool_use.")
    # Refused unless absent or off (convert.check_fields).
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    output_format: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(MessageCountTokensRequest):
    max_tokens: int = Field(ge=1, le=1_048_576)
    stop_sequences: list[str] | None = None
    stream: bool | None = Field(None, description="Server-sent events, as the Messages API streams them.")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="Refused: the learner scores under temperature and top_p only.")
    metadata: dict[str, Any] | None = Field(None, description="Accepted and ignored (`user_id`).")
    episode_id: str | None = Field(None, description=(
        "Ours: this call is a turn of that episode (also the X-Episode-Id header)."))


# ------------------------------------------------------------------------------------------------
# The answer
# ------------------------------------------------------------------------------------------------


def _absent(value: Any) -> bool:
    return value is None


class MessageTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessageToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str  # toolu_...
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[Union[MessageTextBlock, MessageToolUseBlock], Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    input_tokens: int  # the prompt's tokens
    output_tokens: int  # the sampled tokens


class AnthropicMessage(BaseModel):
    """The Messages API's `Message`, and ours beside its fields (the `anthropic` package keeps them as extras)."""

    id: str  # msg_...
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None  # the one that ended the message (stop_reason "stop_sequence")
    usage: MessageUsage
    # ours: what feedback and exact multi-turn prompts need
    group_id: str | None  # None for an episode's turn: rate the episode
    episode_id: str | None = Field(None, exclude_if=_absent)
    policy_version: int
    prompt_token_ids: list[int]
    token_ids: list[int]


class MessageTokensCount(BaseModel):
    input_tokens: int


# ------------------------------------------------------------------------------------------------
# The stream's events (as anthropic.types names them: RawMessageStreamEvent, ping, error)
# ------------------------------------------------------------------------------------------------


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage  # no content yet, no stop_reason, output_tokens 0


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock  # empty: text "", input {}


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[Union[TextDelta, InputJsonDelta], Field(discriminator="type")]
    token_ids: list[int] = Field(default_factory=list)  # ours: the ids a text piece came from


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage  # totals, as the Messages API's


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class MessageStreamEvent(RootModel):
    """One event of a `stream: true` answer to POST /v1/messages (`event: <type>` and `data: <this>`)."""

    root: Annotated[Union[MessageStartEvent, ContentBlockStartEvent, ContentBlockDeltaEvent, ContentBlockStopEvent,
                          MessageDeltaEvent, MessageStopEvent, PingEvent, ErrorEvent], Field(discriminator="type")]
