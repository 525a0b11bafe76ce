"""`stream: true` on `POST /v1/responses`: the same response as the plain answer, sent as the Responses API's
server-sent events (`event: <type>` and `data: <event JSON>` each, every event with its `sequence_number`),
through `aiohttp_sse` as the chat streams are (`streaming.py`, whose helpers this reuses).

As for chat, the sampler answers whole requests, so:
- before sampling, every refusal is a plain JSON error with its status; once the request is admitted the
  headers (`X-Group-Id` or `X-Episode-Id`), `response.created` and `response.in_progress` (the response
  skeleton, with `group_id` / `episode_id`) go out, before the wait for the sampler;
- after sampling, per output item: `response.output_item.added`; for a message `response.content_part.added`,
  `response.output_text.delta` in pieces of one token (`streaming.pieces`, adding up to exactly the text;
  with the logprobs asked for, each piece's), `response.output_text.done`, `response.content_part.done`; for
  a function call one `response.function_call_arguments.delta` (the arguments whole, as they were parsed
  after sampling) and `.done`; then `response.output_item.done`. Last `response.completed`, or
  `response.incomplete` when the output was cut by max_output_tokens (OpenAI's status for that). No
  `data: [DONE]`: the Responses API ends with its terminal event.
- an error after the headers is `response.failed` (the response with `status: failed` and `error`), which the
  openai package yields and the Agents SDK raises; a client that leaves mid-stream leaves nothing: its group is
  dropped or its episode's turn undone, and the response is not stored.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Annotated, Callable, Iterator, Literal, Union

import aiohttp_sse
from aiohttp import web
from pydantic import BaseModel, Field, RootModel

from grpo_server.api.openai.responses_models import (Echo, FunctionCall, OutputItem, OutputMessage, OutputText,
                                                     ResponseError, ResponseObject, TokenLogprob)
from grpo_server.api.openai.streaming import (_ANY_METHOD, Decode, _cancel, _stored, admitted_sampling,
                                              events_off_loop, id_header, pieces)
from grpo_server.api_models import CompletionsRequest, CompletionsResponse
from grpo_server.protocol.errors import ApiError
from grpo_server.runtime.experiment import Experiment

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------
# Events (as openai.types.responses names them)
# ------------------------------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[TokenLogprob]
    token_ids: list[int] = Field(default_factory=list)  # ours: the ids this piece came from


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[TokenLogprob]


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseStreamEvent(RootModel):
    """One event of a `stream: true` answer to POST /v1/responses."""

    root: Annotated[Union[ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent,
                          TextDoneEvent, ArgumentsDeltaEvent, ArgumentsDoneEvent], Field(discriminator="type")]


EVENTS_TEXT = (
    "Server-sent events as the Responses API streams: `event: <type>` and `data: <event JSON>` each, with a "
    "`sequence_number`; comments (`: ping`) keep the connection alive. `response.created` and "
    "`response.in_progress` (with `group_id` or `episode_id`) go out as soon as sampling starts; after it, per "
    "output item `response.output_item.added`, the text in `response.output_text.delta` pieces of a token (or a "
    "function call's arguments whole), `.done` events and `response.output_item.done`; last "
    "`response.completed` (or `response.incomplete`, cut by max_output_tokens). No `[DONE]`. An error after "
    "the headers is `response.failed`; errors before them are plain JSON answers with their status.")


def item_events(index: int, item: OutputItem, token_ids: list[int], decode: Decode) -> Iterator[_Event]:
    """One output item's events (sequence numbers 0 here: `stream_response` numbers them as they go)."""
    yield OutputItemEvent(type="response.output_item.added", sequence_number=0, output_index=index,
                          item=item.model_copy(update={"status": "in_progress", **(
                              {"content": []} if isinstance(item, OutputMessage) else {"arguments": ""})}))
    if isinstance(item, FunctionCall):
        common = dict(sequence_number=0, item_id=item.id, output_index=index)
        yield ArgumentsDeltaEvent(**common, delta=item.arguments)
        yield ArgumentsDoneEvent(**common, name=item.name, arguments=item.arguments)
    else:
        part = item.content[0]
        common = dict(sequence_number=0, item_id=item.id, output_index=index, content_index=0)
        yield ContentPartEvent(type="response.content_part.added", **common, part=OutputText(text=""))
        # The text outside tool calls is not a decoding of the ids from their start: it comes whole.
        cut = pieces(decode, token_ids, part.text) if token_ids else [([], part.text)]
        at = 0
        for ids, text in cut:
            if text or ids:
                yield TextDeltaEvent(**common, delta=text, logprobs=part.logprobs[at:at + len(ids)], token_ids=ids)
            at += len(ids)
        yield TextDoneEvent(**common, text=part.text, logprobs=part.logprobs)
        yield ContentPartEvent(type="response.content_part.done", **common, part=part)
    yield OutputItemEvent(type="response.output_item.done", sequence_number=0, output_index=index, item=item)


def body_events(answer: ResponseObject, decode: Decode) -> Iterator[_Event]:
    called = any(isinstance(item, FunctionCall) for item in answer.output)
    for index, item in enumerate(answer.output):
        yield from item_events(index, item, [] if called else answer.token_ids or [], decode)
    yield ResponseLifecycleEvent(type="response.incomplete" if answer.status == "incomplete" else
                                 "response.completed", sequence_number=0, response=answer)


async def stream_response(request: web.Request, experiment: Experiment, sample: CompletionsRequest, echo: Echo,
                          answer: Callable[[CompletionsResponse], ResponseObject], decode: Decode,
                          delivered: Callable[[ResponseObject], None]) -> web.StreamResponse:
    """Sample `sample` and stream `answer(result)` (see the module docstring); `delivered(response)` once the
    client has had all of it (the handler stores it then)."""
    episode_id = sample.episode_id
    group_id = None if episode_id is not None else experiment.groups.new_id()
    sampling = await admitted_sampling(experiment, sample, group_id, f"responses-{experiment.name}")
    numbers = itertools.count()
    done = False
    async with aiohttp_sse.sse_response(request, sep="\n", headers=id_header(group_id, episode_id),
                                        **_ANY_METHOD) as sse:

        async def send(event: _Event) -> None:
            event.sequence_number = next(numbers)
            await sse.send(event.model_dump_json(), event=event.type)

        skeleton = echo.skeleton(group_id, episode_id)
        try:
            for kind in ("response.created", "response.in_progress"):
                await send(ResponseLifecycleEvent(type=kind, sequence_number=0, response=skeleton))
            response = answer(await sampling)
            async for event in events_off_loop(body_events(response, decode)):  # cut on a thread
                await send(event)
            done = True
            delivered(response)
        except (ConnectionError, TimeoutError):
            pass  # the client left, or stopped reading: dropped below
        except Exception as exc:  # a worker failed after the headers went out (or our own bug, logged)
            if not isinstance(exc, ApiError):
                log.exception("%s: streaming response %s failed", experiment.name, echo.id)
                exc = ApiError("internal error (logged on the server)", code="internal", status=500)
            failed = skeleton.model_copy(update={"status": "failed",
                                                 "error": ResponseError(code=exc.code, message=exc.message)})
            with contextlib.suppress(ConnectionError, TimeoutError):  # the client may be gone too
                await send(ResponseLifecycleEvent(type="response.failed", sequence_number=0, response=failed))
        finally:
            await _cancel(sampling)
            if not done:  # its id is this stream's alone; an episode's newest turn only if it is ours
                experiment.abandon(group_id, episode_id if _stored(sampling) else None)
    return sse
