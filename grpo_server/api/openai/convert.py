"""An OpenAI chat history as our `ChatMessage`s: text parts joined, `developer` as `system`, assistant
`tool_calls` and `tool` results kept (how they are rendered: `grpo_server/runtime/chat_render.py`).

Pure and free of ML imports, like `models.py`, which uses it for `chat_to_request`.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from pydantic import ValidationError

from grpo_server.api_models import ChatMessage
from grpo_server.protocol.errors import BadRequest, Unprocessable, describe_validation_error

class ChatMessageIn(Protocol):
    """An OpenAI chat message as `models.OpenAIChatMessage` parses it (that module calls this one)."""

    role: str
    content: str | list[dict[str, Any]] | None
    tool_calls: list[Any] | None
    tool_call_id: str | None


def message_text(index: int, content: str | list[dict[str, Any]] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"messages.{index}.content.{j}: only text parts ({{\"type\": \"text\", \"text\": "
                             f"...}}) are supported, not {part.get('type')!r}", code="unsupported_content")
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins text parts


def _tool_call(call: Any) -> Any:
    """OpenAI's call shape; `arguments` given as an object (some frameworks do) is taken as its JSON text."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict) \
            and isinstance(call["function"].get("arguments"), dict):
        return {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
    return call


def chat_message(index: int, message: ChatMessageIn) -> ChatMessage:
    role = "system" if message.role == "developer" else message.role
    content = message_text(index, message.content)
    calls = [_tool_call(c) for c in message.tool_calls or ()] if role == "assistant" else message.tool_calls
    if role == "tool" and not message.tool_call_id:
        raise BadRequest(f"messages.{index}: a 'tool' message needs 'tool_call_id' (the id of the call it "
                         "answers)", code="missing_tool_call_id")
    if content is None and not calls:
        content = ""  # OpenAI allows an assistant turn without content; the template needs a string
    fields = {"role": role, "content": content, "tool_calls": calls or None,  # [] (some frameworks): no calls
              "tool_call_id": message.tool_call_id if role == "tool" else None}  # elsewhere ignored, as `name`
    try:
        return ChatMessage.model_validate(fields)
    except ValidationError as exc:
        raise Unprocessable(f"messages.{index}: {describe_validation_error(exc)}", code="invalid_request") from exc


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    return [chat_message(i, m) for i, m in enumerate(messages)]
