"""Responses API `input` items as the chat messages the chat path renders (`convert.chat_message`), so that a
Responses call and a chat call with the same conversation get the same prompt ids, and an episode's turns keep
the drift-free reuse of sampled ids (`runtime/episodes.py` compares histories message by message).

- a message item (`{"role", "content"}`, `type` "message" or absent): roles user, system, developer (as
  system) and assistant; `content` a string or a list of `input_text` / `output_text` parts (joined with
  "\\n", as the chat path joins text parts);
- a `function_call` item (call_id, name, arguments): a call of an assistant turn. An assistant message and the
  function calls right after it are ONE assistant turn (`content` + `tool_calls`), which is how our own output
  lists a completion that wrote text and calls (`responses_models.output_items`): merging them back is what
  makes a replayed history equal the previous turn's reply;
- a `function_call_output` item (call_id, output): a `tool` message answering that call.
Anything else (reasoning, web_search_call, computer_call, item_reference, image or file parts, ...) is a 400
naming the item and its type: the model could not see it, and dropping it silently would change the
conversation. A known item with a wrong shape is a 422 naming the field, as schema errors are elsewhere.

Pure and free of ML imports.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo_server.api.openai.convert import chat_message
from grpo_server.api_models import ChatMessage
from grpo_server.protocol.errors import BadRequest, Unprocessable, describe_validation_error, validation_param


class _Item(BaseModel):
    """Item fields we do not read (`id`, `status`, `annotations`, `logprobs`, ...) are ignored: clients send our
    own output items back as they got them."""

    model_config = ConfigDict(extra="ignore")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any]  # JSON text; an object is taken as its JSON text (as convert._tool_call does)


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


_KINDS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                  "function_call_output": FunctionCallOutputItem}
_TEXT_PARTS = ("input_text", "output_text", "text")  # "text": what some clients write for input_text
_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "input_video")


class _ChatShape(BaseModel):
    """What `convert.chat_message` reads of a chat message."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


def _text(where: str, content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in _MEDIA_PARTS:  # said plainly: the experiment's model is a text model, whatever the part holds
            raise BadRequest(f"{where}.content.{j}: {kind} parts are not supported: the model reads text only (send "
                             "input_text parts)", code="unsupported_content", param=f"{where}.content.{j}")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content.{j}: only text parts (input_text, output_text) are supported, not "
                             f"{kind!r}", code="unsupported_content", param=f"{where}.content.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_item(index: int, raw: Any) -> _Item:
    where = f"input.{index}"
    if not isinstance(raw, dict):
        raise Unprocessable(f"{where}: an item is an object", code="invalid_request", param=where)
    kind = raw.get("type", "message" if "role" in raw else None)
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise BadRequest(f"{where}: items of type {kind!r} are not supported (only message, function_call and "
                         "function_call_output)", code="unsupported_item", param=where)
    try:
        return model.model_validate({**raw, "type": kind})
    except ValidationError as exc:
        inner = validation_param(exc)
        raise Unprocessable(f"{where}: {describe_validation_error(exc)}", code="invalid_request",
                            param=f"{where}.{inner}" if inner else where) from exc


def _arguments(item: FunctionCallItem) -> str:
    return item.arguments if isinstance(item.arguments, str) else json.dumps(item.arguments)


def items_to_messages(items: list[Any], start: int = 0) -> list[ChatMessage]:
    """The chat messages of these input items (see the module docstring); `start` numbers them in errors."""
    messages: list[ChatMessage] = []
    turn: dict[str, Any] | None = None  # the assistant turn being built (text, then its calls)

    def close() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(chat_message(turn.pop("index"), _ChatShape(**turn)))
            turn = None

    for offset, raw in enumerate(items):
        index = start + offset
        item = parse_item(index, raw)
        if isinstance(item, FunctionCallItem):
            if turn is None:
                turn = {"index": index, "role": "assistant", "content": None, "tool_calls": []}
            turn["tool_calls"].append({"id": item.call_id, "type": "function",
                                       "function": {"name": item.name, "arguments": _arguments(item)}})
            continue
        close()
        if isinstance(item, MessageItem) and item.role == "assistant":
            turn = {"index": index, "role": "assistant", "content": _text(f"input.{index}", item.content),
                    "tool_calls": []}
        elif isinstance(item, MessageItem):
            messages.append(chat_message(index, _ChatShape(role=item.role,
                                                           content=_text(f"input.{index}", item.content))))
        else:  # a function_call_output
            assert isinstance(item, FunctionCallOutputItem)
            messages.append(chat_message(index, _ChatShape(role="tool", tool_call_id=item.call_id,
                                                           content=_text(f"input.{index}.output", item.output))))
    close()
    return messages
