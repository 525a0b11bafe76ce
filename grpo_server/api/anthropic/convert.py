"""A Messages API request as our `CompletionsRequest` (or `TokenizeRequest`, for count_tokens), and our answer as
its `Message`. The conversation becomes the chat messages the OpenAI chat path renders (`openai.convert.
chat_message`), so a Messages call and a chat call with the same conversation get the same prompt ids, and an
episode's turns keep the drift-free reuse of sampled ids (`runtime/episodes.py` compares histories message by
message, and reads a call by its name and arguments, not its id).

- `system` (text, or `text` blocks joined with "\\n"): a system message first (left out when empty);
- a user message: its `text` blocks (joined with "\\n", as chat joins text parts) as a user message, and each
  `tool_result` block (`tool_use_id`; `content` text or `text` blocks) as a `tool` message, in their order;
  `is_error` is not shown to the model (its content says what went wrong);
- an assistant message: ONE assistant turn, its `text` blocks joined as `content` and its `tool_use` blocks
  (`id`, `name`, `input`) as `tool_calls` (arguments: `input` as JSON), which is how an answer here reads back;
- `tools` (custom tools: `name`, `description`, `input_schema`, `strict`) as function tools, and `tool_choice`
  `auto`, `any` (chat's "required"), `tool` (a named function), `none`, with `disable_parallel_tool_use` as
  `parallel_tool_calls: false`;
- `max_tokens`, `temperature`, `top_p`, `stop_sequences` (chat's `stop`), `episode_id` (ours) as chat's; one
  completion per call (the Messages API has no `n`). `metadata` is accepted and ignored.

Refused with a 400 naming the field or block, because ignoring them would change what the model sees or how it
samples: other block types (`image`, `document`, `thinking`, `redacted_thinking`, `search_result`, server tool
blocks, ...: `unsupported_content`), a block in the wrong role's message, tools Anthropic defines itself (a
`type` other than `custom`: `unsupported_tool`), another `tool_choice` type (`unsupported_tool_choice`), a last
message from the assistant (a prefill: `unsupported_prefill`: the prompt here always ends in a new assistant
turn), `top_k` (the learner scores under temperature and top_p only), `thinking` unless disabled, `mcp_servers`,
and structured outputs (`output_format`, `output_config.format`: output is not constrained). A known block or
tool with a wrong shape is a 422 naming the field, as schema errors are elsewhere.

The answer: a `text` block (the whole text; with tool calls, the text outside them, left out when blank) and a
`tool_use` block per call (`id` `toolu_...`, `input` the parsed arguments: arguments that are not a JSON object,
which the model may write, come as `{"arguments": <them>}`); `stop_reason` `max_tokens` (cut), `tool_use`,
`stop_sequence` (with `stop_sequence`) or `end_turn`; `usage` `input_tokens` (the prompt) and `output_tokens`.

Pure and free of ML imports.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo_server.api.anthropic.models import (AnthropicMessage, MessageCountTokensRequest, MessagesRequest,
                                              MessageTextBlock, MessageToolUseBlock, MessageUsage, StopReason)
from grpo_server.api.openai.convert import chat_message
from grpo_server.api_models import ChatMessage, CompletionOut, CompletionsRequest, CompletionsResponse, TokenizeRequest
from grpo_server.protocol.errors import BadRequest, Unprocessable, describe_validation_error, validation_param

# Our sampling request's fields that a Messages field of another name becomes: an error names the client's field.
SAMPLING_PARAMS = {"stop": "stop_sequences"}


# ------------------------------------------------------------------------------------------------
# Content blocks
# ------------------------------------------------------------------------------------------------


class _Block(BaseModel):
    """Block fields we do not read (`cache_control`, `citations`, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextBlockParam(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlockParam(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


# The blocks each role's message may hold.
_KINDS: dict[str, dict[str, type[_Block]]] = {
    "user": {"text": TextBlockParam, "tool_result": ToolResultBlockParam},
    "assistant": {"text": TextBlockParam, "tool_use": ToolUseBlockParam},
}


def _block(where: str, raw: Any, role: str) -> _Block:
    if not isinstance(raw, dict):
        raise Unprocessable(f"{where}: a content block is an object", code="invalid_request", param=where)
    kind = raw.get("type")
    model = _KINDS[role].get(kind) if isinstance(kind, str) else None
    if model is None:
        allowed = " and ".join(_KINDS[role])
        raise BadRequest(f"{where}: {kind!r} blocks are not supported in a {role} message (only {allowed}): the "
                         "model reads text and tool calls only", code="unsupported_content", param=where)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        inner = validation_param(exc)
        raise Unprocessable(f"{where}: {describe_validation_error(exc)}", code="invalid_request",
                            param=f"{where}.{inner}" if inner else where) from exc


def _texts(where: str, content: str | list[dict[str, Any]] | None) -> str:
    """Text, or `text` blocks joined with "\\n" (a system prompt, a tool result's content)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, raw in enumerate(content):
        if not isinstance(raw, dict) or raw.get("type") != "text" or not isinstance(raw.get("text"), str):
            kind = raw.get("type") if isinstance(raw, dict) else None
            raise BadRequest(f"{where}.{j}: only text blocks are supported here, not {kind!r}",
                             code="unsupported_content", param=f"{where}.{j}")
        texts.append(raw["text"])
    return "\n".join(texts)


# ------------------------------------------------------------------------------------------------
# The conversation
# ------------------------------------------------------------------------------------------------


@dataclass
class _Turn:
    """What `openai.convert.chat_message` reads of a chat message."""

    role: str
    content: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


def _user_turns(index: int, blocks: list[_Block]) -> list[ChatMessage]:
    turns: list[ChatMessage] = []
    texts: list[str] = []

    def close_text() -> None:
        if texts:
            turns.append(chat_message(index, _Turn("user", "\n".join(texts))))
            texts.clear()

    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlockParam):
            close_text()
            content = _texts(f"messages.{index}.content.{j}.content", block.content)
            turns.append(chat_message(index, _Turn("tool", content, tool_call_id=block.tool_use_id)))
        else:
            assert isinstance(block, TextBlockParam)
            texts.append(block.text)
    close_text()
    return turns or [chat_message(index, _Turn("user", ""))]


def _assistant_turn(index: int, blocks: list[_Block]) -> ChatMessage:
    texts = [b.text for b in blocks if isinstance(b, TextBlockParam)]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlockParam)]
    return chat_message(index, _Turn("assistant", "\n".join(texts) if texts else None, tool_calls=calls or None))


def chat_history(body: MessageCountTokensRequest) -> list[ChatMessage]:
    """The system prompt and messages as chat messages (see the module docstring)."""
    history: list[ChatMessage] = []
    system = _texts("system", body.system)
    if system:
        history.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(body.messages):
        content = message.content
        raw = [{"type": "text", "text": content}] if isinstance(content, str) else content
        blocks = [_block(f"messages.{i}.content.{j}", block, message.role) for j, block in enumerate(raw)]
        if message.role == "assistant":
            history.append(_assistant_turn(i, blocks))
        else:
            history.extend(_user_turns(i, blocks))
    if body.messages[-1].role == "assistant":
        raise BadRequest("the last message is the assistant's (a prefill): not supported, the prompt ends in a new "
                         "assistant turn; end with a user message", code="unsupported_prefill",
                         param=f"messages.{len(body.messages) - 1}")
    return history


# ------------------------------------------------------------------------------------------------
# Tools and the other fields
# ------------------------------------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Custom tools as chat's function tools; None without any."""
    if not tools:
        return None
    functions = []
    for k, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise BadRequest(f"tools.{k}: {kind!r} is one of Anthropic's own tools: only custom tools ({{name, "
                             "description, input_schema}}) are supported", code="unsupported_tool", param=f"tools.{k}")
        if not isinstance(tool.get("input_schema"), dict):
            raise Unprocessable(f"tools.{k}.input_schema: a tool needs a JSON schema object", code="invalid_request",
                                param=f"tools.{k}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        function.update({key: tool[key] for key in ("description", "strict") if tool.get(key) is not None})
        functions.append({"type": "function", "function": function})
    return functions


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) for the Messages API's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise Unprocessable("tool_choice.name: type 'tool' needs the tool's name", code="invalid_request",
                                param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if chat is None:
        raise BadRequest(f"tool_choice type {kind!r} is not supported (auto, any, tool, none)",
                         code="unsupported_tool_choice", param="tool_choice.type")
    return chat, None if chat == "none" else parallel


def _refused(field: str, why: str) -> BadRequest:
    return BadRequest(f"{field} is not supported: {why}", code="unsupported_parameter", param=field)


def check_fields(body: MessageCountTokensRequest) -> None:
    """400 for the known fields that cannot be honoured unless they are off (see the module docstring)."""
    if body.thinking and body.thinking.get("type") != "disabled":
        raise _refused("thinking", "the model has no thinking mode (only {\"type\": \"disabled\"})")
    if body.mcp_servers:
        raise _refused("mcp_servers", "the server calls no MCP server for the model")
    if body.output_format or (body.output_config or {}).get("format"):
        raise _refused("output_format" if body.output_format else "output_config.format",
                       "output is not constrained to a format (a tool with tool_choice 'tool' is)")
    if isinstance(body, MessagesRequest) and body.top_k is not None:
        raise _refused("top_k", "the learner scores the sampled tokens under temperature and top_p only, so a "
                                "top-k sample's logprobs would not be the ones it trains on")


def _validated(model: type[BaseModel], fields: dict[str, Any]) -> Any:
    try:  # our bounds (temperature in [0, 2], at most 16 stop sequences, the episode id's pattern, ...) are 422s
        return model(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        param = validation_param(exc)
        raise Unprocessable(describe_validation_error(exc), code="invalid_request",
                            param=SAMPLING_PARAMS.get(param or "", param)) from exc


def to_sample(body: MessagesRequest) -> CompletionsRequest:
    """One completion of the conversation (an episode's turn with `episode_id`)."""
    check_fields(body)
    choice, parallel = chat_tool_choice(body.tool_choice)
    return _validated(CompletionsRequest, dict(
        messages=chat_history(body), n=1, temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_tokens,
        stop=body.stop_sequences or None, tools=chat_tools(body.tools), tool_choice=choice,
        parallel_tool_calls=parallel, episode_id=body.episode_id))


def to_tokenize(body: MessageCountTokensRequest) -> TokenizeRequest:
    """The prompt a call with this conversation and these tools would sample from."""
    check_fields(body)
    chat_tool_choice(body.tool_choice)  # refused as on a call, though it adds nothing to the prompt
    return _validated(TokenizeRequest, dict(messages=chat_history(body), tools=chat_tools(body.tools)))


# ------------------------------------------------------------------------------------------------
# The answer
# ------------------------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    """The Messages API's `toolu_` id for a call id of the sampler's tool parser (`chatcmpl-tool-<hex>`, ...)."""
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.rsplit("-", 1)[-1].removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def _content(completion: CompletionOut) -> list[MessageTextBlock | MessageToolUseBlock]:
    if not completion.tool_calls:
        return [MessageTextBlock(text=completion.text if completion.content is None else completion.content)]
    text = [MessageTextBlock(text=completion.content)] if (completion.content or "").strip() else []
    return text + [MessageToolUseBlock(id=tool_use_id(call.id), name=call.name, input=tool_input(call.arguments))
                   for call in completion.tool_calls]


def stop_reason(completion: CompletionOut, stop_sequence: str | None) -> StopReason:
    if completion.finish_reason == "length":
        return "max_tokens"
    if completion.tool_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def message_answer(model: str, result: CompletionsResponse, stop_sequence: str | None) -> AnthropicMessage:
    """The Message for our one completion; `stop_sequence`: the one that ended it, if one did."""
    completion = result.completions[0]
    message_id = result.group_id or f"{result.episode_id}-{uuid.uuid4().hex[:12]}"  # an episode's turn has no group
    reason = stop_reason(completion, stop_sequence)
    return AnthropicMessage(
        id=f"msg_{message_id}", content=_content(completion), model=model, stop_reason=reason,
        stop_sequence=stop_sequence if reason == "stop_sequence" else None,
        usage=MessageUsage(input_tokens=len(result.prompt_token_ids), output_tokens=len(completion.token_ids)),
        group_id=result.group_id, episode_id=result.episode_id, policy_version=result.policy_version,
        prompt_token_ids=result.prompt_token_ids, token_ids=completion.token_ids)
