"""`stream: true` on the OpenAI routes: the same group as the plain answer, sent as server-sent events in
OpenAI's framing (`data: <chunk JSON>\\n\\n` each, `data: [DONE]\\n\\n` last), through `aiohttp_sse`.

The sampler answers a request whole (the worker protocol is request/response), so a stream is the plain
answer cut into pieces, not tokens as they are sampled:

- **Before sampling** every check runs as for a plain call, so a 401/403/404/400/422/429 is still a plain
  JSON error with its status. The group is named before it is sampled (`Experiment.complete(group_id=...)`),
  so the headers (`X-Group-Id`, or `X-Episode-Id` for an episode's turn) and a first chunk per choice (the
  assistant role, or empty text, with `group_id`) go out as soon as the request is admitted
  (`complete(admitted=...)`), before a possibly long wait for the sampler.
- **After sampling** each choice's text follows in pieces of one token (its ids decoded incrementally, as
  vLLM streams them), with that piece's `token_ids` and logprobs; the pieces always add up to exactly the
  plain answer's text (where decoding alone would differ, say at a stop string, the rest comes in the
  last piece). Tool calls come whole, one `tool_calls` delta per call. A choice's last chunk has its
  `finish_reason`; with `stream_options.include_usage` a last chunk holds `usage` and no choices.
  `policy_version` is on every chunk once known, `prompt_token_ids` on the first chunk after sampling.
- **Errors after the headers** (a worker failed) end the stream with `data: {"error": {code, message, type, param}}`,
  which the `openai` package raises as `APIError`; no `[DONE]` follows.
- **A client that leaves** is noticed when a chunk fails to go out (nothing is written while the sampler
  works, and the sampler cannot be stopped mid-request anyway). Once its group is sampled, the group is
  dropped (`Experiment.abandon`, logged), so it neither holds a `max_pending_groups` slot nor expires later
  as unrated; an episode's turn is undone, so that a retry continues from the turn before. Sampling still
  running when the handler ends (the client left during the first chunks, the server stops, or aiohttp's
  `handler_cancellation`, which `serve` leaves off, cancelled the handler) is cancelled and awaited, and
  stores nothing: nothing outlives the request.

aiohttp_sse fits OpenAI's framing with `sep="\\n"`: its events are `data:` lines only (JSON holds no raw
newline, so one line each), and its keep-alive pings are SSE comments (`: ping`), which the `openai`
package and browsers skip; they keep proxies from cutting a stream that waits long for the sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator, Literal, Sequence, TypeVar

import aiohttp_sse
from aiohttp import web
from pydantic import BaseModel, Field

from grpo_server.api.openai.models import (ChatChoice, ChatChoiceLogprobs, ChatCompletionResponse,
                                           CompletionChoice, CompletionLogprobs, TextCompletionResponse,
                                           Usage)
from grpo_server.api_models import CompletionsRequest, CompletionsResponse
from grpo_server.protocol.errors import ApiError
from grpo_server.runtime.experiment import Experiment

log = logging.getLogger(__name__)

T = TypeVar("T")
Decode = Callable[[Sequence[int]], str]  # token ids -> text, as the sampler decodes a completion
YIELD_EVERY = 64  # chunks cut on a thread at a time (decoding is CPU work: `events_off_loop`)
# aiohttp_sse 3 serves GET only unless told; 2.2 (pinned for Python 3.10) takes any method and has no flag.
_ANY_METHOD = {"allow_all_methods": True} if int(aiohttp_sse.__version__.split(".")[0]) >= 3 else {}


# ------------------------------------------------------------------------------------------------
# Chunks
# ------------------------------------------------------------------------------------------------


def _absent(value: object) -> bool:
    return value is None


class ChatDeltaFunction(BaseModel):
    name: str
    arguments: str  # JSON text: the whole arguments in one delta


class ChatDeltaToolCall(BaseModel):
    index: int  # of the call within the choice
    id: str
    type: Literal["function"] = "function"
    function: ChatDeltaFunction


class ChatDelta(BaseModel):
    """What a chunk adds to a choice's message; fields it does not add are left out, as OpenAI does."""

    role: Literal["assistant"] | None = Field(None, exclude_if=_absent)
    content: str | None = Field(None, exclude_if=_absent)
    tool_calls: list[ChatDeltaToolCall] | None = Field(None, exclude_if=_absent)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None  # on the choice's last chunk
    token_ids: list[int] = Field(default_factory=list)  # extra: the ids this chunk's piece came from


class TextChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)
    # With vLLM's `return_token_ids`: on each choice's first chunk after sampling, as vLLM streams them
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent)


class ChunkFields(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage | None = None  # only with stream_options.include_usage: null but on the last chunk
    # extra, as on the plain answer
    group_id: str | None  # None for an episode's turn: rate the episode
    episode_id: str | None = Field(None, exclude_if=_absent)
    policy_version: int | None = None  # None until the group is sampled
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent)  # on the first chunk after sampling


class ChatCompletionChunk(ChunkFields):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class TextCompletionChunk(ChunkFields):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChunkChoice]


# A token run that ends in half a UTF-8 character waits for the rest: at most this many tokens (a character is at
# most 4 bytes; byte-level BPE gives one token per byte at worst), then it goes out as decoded, U+FFFD and all.
MAX_PENDING_TOKENS = 8


def pieces(decode: Decode, token_ids: Sequence[int], text: str) -> list[tuple[list[int], str]]:
    """`text` cut at token boundaries: (ids, their text) per token that completes text, then the rest (ids
    that made no text yet, such as an end-of-turn token, and any text decoding did not reach) as a last
    piece, maybe empty. The texts always join to exactly `text`. Incremental as vLLM's detokenizer: each
    token's text is what it adds to a short window of the tokens before it (a leading space or a multi-byte
    character split over tokens comes out right), and a piece ending in U+FFFD (half a character) waits.

    Linear in the choice's length, so a stream never holds the event loop for long: the window is the last
    piece's tokens and those pending after it, where a token that adds no text (a special token, which decodes
    to nothing) is left out of the window (its id goes with the next piece), and half a character waits at
    most MAX_PENDING_TOKENS. vLLM's detokenizer, and tokenizers' DecodeStream, keep such tokens in the window,
    and their cost grows with the square of a run of them (a policy that emits special tokens over and over)."""
    out: list[tuple[list[int], str]] = []
    start = used = 0  # start: the first id of the next piece; used: characters of `text` given out
    window: list[int] = []  # ids decoded together: the last piece's (context), then the pending ones
    context = 0  # how many of `window` are the last piece's
    prefix = current = ""  # decode(window[:context]), decode(window)
    for i, token in enumerate(token_ids):
        new = decode([*window, token])
        if new == current and not current.endswith("\ufffd"):
            continue  # adds no text (a special token): left out of the window, its id goes with the next piece
        window.append(token)
        current = new
        pending = len(window) - context
        if len(new) <= len(prefix) or (new.endswith("\ufffd") and pending < MAX_PENDING_TOKENS):
            if pending > 4 * MAX_PENDING_TOKENS:  # text that shrinks as tokens come: no pieces can be cut
                break
            continue
        piece = new[len(prefix):]
        if not text.startswith(piece, used):  # decoding left `text` (a stop string cut it): the rest in one
            break
        out.append((list(token_ids[start:i + 1]), piece))
        used += len(piece)
        start = i + 1
        window = window[context:]
        context = len(window)
        prefix = current = decode(window)
    out.append((list(token_ids[start:]), text[used:]))
    return out


@dataclass
class Framing:
    """One stream's chunks: every chunk repeats `id`, `created`, `model` and the group's ids."""

    chat: bool  # chat.completion.chunk, else text_completion
    id: str
    created: int
    model: str
    group_id: str | None
    episode_id: str | None
    include_usage: bool

    def _chunk(self, choices: list, **fields) -> ChatCompletionChunk | TextCompletionChunk:
        kind = ChatCompletionChunk if self.chat else TextCompletionChunk
        return kind(id=self.id, created=self.created, model=self.model, group_id=self.group_id,
                    episode_id=self.episode_id, choices=choices, **fields)

    def encode(self, chunk: ChatCompletionChunk | TextCompletionChunk) -> str:
        # OpenAI leaves `usage` out of every chunk unless it was asked for.
        return chunk.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def head(self, n: int) -> Iterator[str]:
        """Before sampling: each choice's first chunk (chat: the assistant role; legacy: empty text)."""
        for i in range(n):
            yield self.encode(self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                                           if self.chat else TextChunkChoice(index=i, text="")]))

    def body(self, answer: ChatCompletionResponse | TextCompletionResponse, decode: Decode,
             announced: int) -> Iterator[str]:
        """After sampling: the plain `answer` cut into chunks; choices below `announced` had their head."""
        first = True
        for choice in answer.choices:
            cut = self._chat_choice(choice, decode) if self.chat else self._text_choice(choice, decode)
            for k, piece in enumerate(cut):
                if self.chat and k == 0 and choice.index >= announced:  # a choice the head did not expect
                    piece.delta.role = "assistant"
                yield self.encode(self._chunk([piece], policy_version=answer.policy_version,
                                              prompt_token_ids=answer.prompt_token_ids if first else None))
                first = False
        if self.include_usage:
            yield self.encode(self._chunk([], usage=answer.usage, policy_version=answer.policy_version))

    @staticmethod
    def _chat_choice(choice: ChatChoice, decode: Decode) -> Iterator[ChatChunkChoice]:
        message = choice.message
        entries = choice.logprobs.content if choice.logprobs else None
        if message.tool_calls:  # the calls come whole, after the text outside them
            calls = [ChatDeltaToolCall(index=k, id=call.id, function=ChatDeltaFunction(
                name=call.function.name, arguments=call.function.arguments))
                for k, call in enumerate(message.tool_calls)]
            yield ChatChunkChoice(index=choice.index, delta=ChatDelta(content=message.content or None,
                                                                      tool_calls=calls),
                                  logprobs=None if entries is None else ChatChoiceLogprobs(content=entries),
                                  token_ids=choice.token_ids)
            yield ChatChunkChoice(index=choice.index, delta=ChatDelta(), finish_reason=choice.finish_reason)
            return
        cut, at = pieces(decode, choice.token_ids, message.content or ""), 0
        for k, (ids, text) in enumerate(cut):
            logprobs = None if entries is None else ChatChoiceLogprobs(content=entries[at:at + len(ids)])
            yield ChatChunkChoice(index=choice.index, delta=ChatDelta(content=text or None), logprobs=logprobs,
                                  token_ids=ids, finish_reason=choice.finish_reason if k == len(cut) - 1 else None)
            at += len(ids)

    @staticmethod
    def _text_choice(choice: CompletionChoice, decode: Decode) -> Iterator[TextChunkChoice]:
        cut, at, lp = pieces(decode, choice.token_ids, choice.text), 0, choice.logprobs
        for k, (ids, text) in enumerate(cut):
            end = at + len(ids)
            logprobs = None if lp is None else CompletionLogprobs(
                tokens=lp.tokens[at:end], token_logprobs=lp.token_logprobs[at:end],
                top_logprobs=lp.top_logprobs[at:end], text_offset=lp.text_offset[at:end])
            yield TextChunkChoice(index=choice.index, text=text, logprobs=logprobs, token_ids=ids,
                                  finish_reason=choice.finish_reason if k == len(cut) - 1 else None,
                                  prompt_token_ids=choice.prompt_token_ids if k == 0 else None)
            at = end



# ------------------------------------------------------------------------------------------------
# The stream
# ------------------------------------------------------------------------------------------------


def id_header(group_id: str | None, episode_id: str | None) -> dict[str, str]:
    """The id feedback needs, as a header: `X-Group-Id`, or `X-Episode-Id` for an episode's turn."""
    return {"X-Group-Id": group_id} if group_id is not None else {"X-Episode-Id": episode_id or ""}


async def admitted_sampling(experiment: Experiment, sample: CompletionsRequest, group_id: str | None,
                            name: str) -> asyncio.Task:
    """`sample` sampling as a task, returned once it is admitted: a stream's headers go out after its admission,
    so that a refusal (429, 503) before a byte went out is raised here, a plain JSON error with its status. Every
    streaming family (chat and completions, Responses, Messages) starts its sampling here."""
    admitted = asyncio.Event()
    sampling = asyncio.create_task(experiment.complete(sample, group_id=group_id, admitted=admitted), name=name)
    try:
        await _first_of(sampling, admitted)
    except BaseException:
        await _cancel(sampling)
        raise
    if sampling.done():
        sampling.result()  # its error before a byte went out
    return sampling


async def stream_group(request: web.Request, experiment: Experiment, sample: CompletionsRequest, *, chat: bool,
                       model: str, include_usage: bool, decode: Decode,
                       answer: Callable[[CompletionsResponse], ChatCompletionResponse | TextCompletionResponse],
                       ) -> web.StreamResponse:
    """Sample `sample` as one group and stream `answer(result)` (the plain answer) as server-sent events
    (see the module docstring)."""
    episode_id = sample.episode_id
    group_id = None if episode_id is not None else experiment.groups.new_id()
    framing = Framing(chat, ("chatcmpl-" if chat else "cmpl-") + (group_id or f"{episode_id}-{uuid.uuid4().hex[:12]}"),
                      int(time.time()), model, group_id, episode_id, include_usage)
    sampling = await admitted_sampling(experiment, sample, group_id, f"stream-{experiment.name}")
    delivered = False
    async with aiohttp_sse.sse_response(request, sep="\n", headers=id_header(group_id, episode_id),
                                        **_ANY_METHOD) as sse:
        try:
            announced = 0
            if not sampling.done():
                # As complete() counts choices; an episode's turn is one. A wrong guess only moves the role.
                announced = 1 if episode_id is not None else sample.n or experiment.config.sampling.n
                for event in framing.head(announced):
                    await sse.send(event)
            result = await sampling
            async for event in events_off_loop(framing.body(answer(result), decode, announced)):
                await sse.send(event)
            await sse.send("[DONE]")
            delivered = True
        except (ConnectionError, TimeoutError):
            pass  # the client left, or stopped reading (aiohttp_sse's send timeout): dropped below
        except ApiError as exc:  # a worker failed after the headers went out
            await _send_quietly(sse, json.dumps(exc.openai_body()))
        except Exception:
            log.exception("%s: streaming %s failed", experiment.name, framing.id)
            await _send_quietly(sse, json.dumps(ApiError("internal error (logged on the server)",
                                                         code="internal", status=500).openai_body()))
        finally:
            await _cancel(sampling)
            if not delivered:  # its id is this stream's alone; an episode's newest turn only if it is ours
                experiment.abandon(group_id, episode_id if _stored(sampling) else None)
    return sse


async def events_off_loop(events: Iterator[T]) -> AsyncIterator[T]:
    """`events`, computed on a thread YIELD_EVERY at a time: cutting a long answer decodes every token, and a
    choice of tokens that make no text (special tokens) is one chunk that decodes all of them, so the event loop
    never waits for it (the thread gives the loop the GIL at Python's switch interval)."""
    while batch := await asyncio.to_thread(lambda: list(itertools.islice(events, YIELD_EVERY))):
        for event in batch:
            yield event


async def _first_of(sampling: asyncio.Task, admitted: asyncio.Event) -> None:
    """Until the request is admitted (checks passed, sampling starts) or answered, whichever comes first."""
    waiter = asyncio.ensure_future(admitted.wait())
    try:
        await asyncio.wait({sampling, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _stored(sampling: asyncio.Task) -> bool:
    """Whether `complete` returned, so stored its group (or turn): nothing runs between the two."""
    return sampling.done() and not sampling.cancelled() and sampling.exception() is None


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()  # a no-op once it is done
    await asyncio.gather(task, return_exceptions=True)


async def _send_quietly(sse: aiohttp_sse.EventSourceResponse, data: str) -> None:
    with contextlib.suppress(ConnectionError, TimeoutError):  # the client may be gone too
        await sse.send(data)
