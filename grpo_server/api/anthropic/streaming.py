"""`stream: true` on `POST /v1/messages`: the same message as the plain answer, sent as the Messages API's
server-sent events (`event: <type>` and `data: <event JSON>` each), through `aiohttp_sse` as the OpenAI streams
are (`openai/streaming.py`, whose helpers this reuses).

As there, the sampler answers whole requests, so:
- before sampling, every refusal is a plain JSON error (Anthropic's shape) with its status. Once the request is
  admitted the headers (`X-Group-Id` or `X-Episode-Id`) go out with a `ping` event, and another every
  PING_EVERY_S while the sampler works: the client knows it was admitted, and proxies keep the connection;
- after sampling: `message_start` (the message with no content yet, its `usage.input_tokens` the prompt's, and
  ours: `group_id` / `episode_id`, `policy_version`, `prompt_token_ids`), then per content block
  `content_block_start` (text "" or the tool_use with input {}), its deltas and `content_block_stop`: a text in
  `text_delta` pieces of a token (`openai.streaming.pieces`, adding up to exactly the text, each with the ids it
  came from), or, beside tool calls, whole; a tool call's input in one `input_json_delta` (the arguments were
  parsed after sampling); then `message_delta` (`stop_reason`, `stop_sequence`, `usage`) and `message_stop`;
- an error after the headers is an `error` event (`{"type": "error", "error": {type, message, code}}`), which the
  `anthropic` package raises; a client that leaves mid-stream leaves nothing: its group is dropped or its
  episode's turn undone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Awaitable, Callable, Iterator

import aiohttp_sse
from aiohttp import web
from pydantic import BaseModel

from grpo_server.api.anthropic.models import (AnthropicMessage, ContentBlockDeltaEvent, ContentBlockStartEvent,
                                              ContentBlockStopEvent, InputJsonDelta, MessageDelta, MessageDeltaEvent,
                                              MessageDeltaUsage, MessageStartEvent, MessageStopEvent,
                                              MessageTextBlock, MessageToolUseBlock, MessageUsage, PingEvent,
                                              TextDelta)
from grpo_server.api.openai.streaming import (_ANY_METHOD, Decode, _cancel, _stored, admitted_sampling,
                                              events_off_loop, id_header, pieces)
from grpo_server.api_models import CompletionsRequest, CompletionsResponse
from grpo_server.protocol.errors import ApiError
from grpo_server.runtime.experiment import Experiment

log = logging.getLogger(__name__)

PING_EVERY_S = 10.0  # `ping` events while the sampler works

EVENTS_TEXT = (
    "Server-sent events as the Messages API streams: `event: <type>` and `data: <event JSON>` each. `ping` as "
    "soon as sampling starts and every 10 s while it runs; once the message is sampled `message_start` (the message "
    "without content, with `usage.input_tokens` and ours: `group_id` or `episode_id`, `policy_version`, "
    "`prompt_token_ids`), per content block `content_block_start`, `content_block_delta` (`text_delta` pieces of a "
    "token, with their `token_ids`, or one `input_json_delta` of a tool call's input) and `content_block_stop`; "
    "then `message_delta` (`stop_reason`, `stop_sequence`, `usage`) and `message_stop`. An error after the headers "
    "is an `error` event; errors before them are plain JSON answers with their status.")


def body_events(message: AnthropicMessage, decode: Decode) -> Iterator[BaseModel]:
    """The sampled message's events, `message_start` to `message_stop` (see the module docstring)."""
    usage = message.usage
    yield MessageStartEvent(message=message.model_copy(update={
        "content": [], "stop_reason": None, "stop_sequence": None, "token_ids": [],
        "usage": MessageUsage(input_tokens=usage.input_tokens, output_tokens=0)}))
    called = any(isinstance(block, MessageToolUseBlock) for block in message.content)
    for index, block in enumerate(message.content):
        if isinstance(block, MessageTextBlock):
            yield ContentBlockStartEvent(index=index, content_block=MessageTextBlock(text=""))
            # The text outside tool calls is not a decoding of the ids from their start: it comes whole.
            cut = [([], block.text)] if called else pieces(decode, message.token_ids, block.text)
            for ids, text in cut:
                if text or ids:
                    yield ContentBlockDeltaEvent(index=index, delta=TextDelta(text=text), token_ids=ids)
        else:
            yield ContentBlockStartEvent(index=index, content_block=block.model_copy(update={"input": {}}))
            yield ContentBlockDeltaEvent(index=index, delta=InputJsonDelta(partial_json=json.dumps(block.input)))
        yield ContentBlockStopEvent(index=index)
    yield MessageDeltaEvent(delta=MessageDelta(stop_reason=message.stop_reason, stop_sequence=message.stop_sequence),
                            usage=MessageDeltaUsage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens))
    yield MessageStopEvent()


async def stream_message(request: web.Request, experiment: Experiment, sample: CompletionsRequest,
                         answer: Callable[[CompletionsResponse], Awaitable[AnthropicMessage]],
                         decode: Decode) -> web.StreamResponse:
    """Sample `sample` and stream `await answer(result)` (see the module docstring)."""
    episode_id = sample.episode_id
    group_id = None if episode_id is not None else experiment.groups.new_id()
    sampling = await admitted_sampling(experiment, sample, group_id, f"messages-{experiment.name}")
    done = False
    async with aiohttp_sse.sse_response(request, sep="\n", headers=id_header(group_id, episode_id),
                                        **_ANY_METHOD) as sse:

        async def send(event: BaseModel) -> None:
            await sse.send(event.model_dump_json(), event=getattr(event, "type"))

        try:
            while True:
                await send(PingEvent())
                finished, _ = await asyncio.wait({sampling}, timeout=PING_EVERY_S)
                if finished:
                    break
            message = await answer(sampling.result())
            async for event in events_off_loop(body_events(message, decode)):  # cut on a thread
                await send(event)
            done = True
        except (ConnectionError, TimeoutError):
            pass  # the client left, or stopped reading: dropped below
        except Exception as exc:  # a worker failed after the headers went out (or our own bug, logged)
            if not isinstance(exc, ApiError):
                log.exception("%s: streaming a message failed", experiment.name)
                exc = ApiError("internal error (logged on the server)", code="internal", status=500)
            with contextlib.suppress(ConnectionError, TimeoutError):  # the client may be gone too
                await sse.send(json.dumps(exc.anthropic_body()), event="error")
        finally:
            await _cancel(sampling)
            if not done:  # its id is this stream's alone; an episode's newest turn only if it is ours
                experiment.abandon(group_id, episode_id if _stored(sampling) else None)
    return sse
