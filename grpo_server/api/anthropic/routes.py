"""Anthropic-compatible `POST /v1/messages` (the Messages API, what the `anthropic` package and the coding-agent
harnesses and frameworks built on it speak) and `POST /v1/messages/count_tokens`, on the chat-completions
machinery: the body (`models.py`) becomes the chat messages the chat path renders and one `CompletionsRequest`
(`convert.py`), so a message is one completion: a group of one, or with `episode_id` / `X-Episode-Id` one turn of
an episode, with the drift-free reuse of sampled ids. `stream: true` answers with the Messages events
(`streaming.py`).

Who may call: the admin key or the experiment's own (`model`), as `Authorization: Bearer <key>` or `x-api-key:
<key>` (the edge takes either on every route); `anthropic-version` and `anthropic-beta` are accepted and not read.
Errors are the Messages API's `{"type": "error", "error": {"type", "message"}}`, with our `code` beside them."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from grpo_server.api.anthropic.convert import message_answer, to_sample, to_tokenize
from grpo_server.api.anthropic.models import (AnthropicMessage, MessageCountTokensRequest, MessagesRequest,
                                              MessageStreamEvent, MessageTokensCount)
from grpo_server.api.anthropic.streaming import EVENTS_TEXT, stream_message
from grpo_server.api.app_state import ORCHESTRATOR
from grpo_server.api.edge import respond
from grpo_server.api.openai.routes import episode_from_header
from grpo_server.api.openai.streaming import id_header
from grpo_server.api.route_table import Endpoint, Principal
from grpo_server.api_models import CompletionOut, CompletionsResponse
from grpo_server.runtime.chat_render import tool_calling_of


def matched_stop(prompts: Any, completion: CompletionOut, stop_sequences: list[str]) -> str | None:
    """The stop sequence that ended `completion` (finished with "stop"), or None: its end of turn. A stop string is
    cut from the text, and only then does the text differ from its ids' decoding (sampler/engine_interface.py
    `completion_text`): the decoding goes on with the sequence that matched."""
    decoded = prompts.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    if decoded == completion.text:
        return None  # its end of turn
    return next((s for s in stop_sequences if decoded.startswith(s, len(completion.text))), None)


async def create_message(request: web.Request, who: Principal, body: MessagesRequest) -> web.StreamResponse:
    orchestrator = request.app[ORCHESTRATOR]
    experiment = orchestrator.get(body.model)  # 404 experiment_not_found before anything else
    sample = episode_from_header(request, to_sample(body))
    tool_calling_of(sample)  # tools_missing / unknown_tool now: in a stream they would come after the headers
    prompts = orchestrator.prompts

    async def answer(result: CompletionsResponse) -> AnthropicMessage:
        completion, stop = result.completions[0], None
        if completion.finish_reason == "stop" and body.stop_sequences:
            stop = await prompts.off_loop(matched_stop, prompts, completion, body.stop_sequences)
        return message_answer(body.model, result, stop)

    if body.stream:
        return await stream_message(request, experiment, sample, answer,
                                    decode=lambda ids: prompts.tokenizer.decode(ids, skip_special_tokens=True))
    result = await experiment.complete(sample)
    response = respond(request, await answer(result))
    response.headers.update(id_header(result.group_id, result.episode_id))
    return response


async def count_tokens(request: web.Request, who: Principal, body: MessageCountTokensRequest) -> web.Response:
    """The prompt's tokens, rendered as a call with this conversation and these tools would render them."""
    orchestrator = request.app[ORCHESTRATOR]
    orchestrator.get(body.model)  # 404 experiment_not_found
    counted = await orchestrator.tokenize(to_tokenize(body))
    return respond(request, MessageTokensCount(input_tokens=counted.count))


ROUTES: tuple[Endpoint, ...] = (
    Endpoint("POST", "/v1/messages", create_message, MessagesRequest, AnthropicMessage, 200,
             "Anthropic-compatible Messages API (`model` is the experiment): one completion, or one turn of an "
             "episode", "experiment", (429, 502, 503), events=MessageStreamEvent, events_text=EVENTS_TEXT,
             scope=lambda body: body.model, error_shape="anthropic"),
    Endpoint("POST", "/v1/messages/count_tokens", count_tokens, MessageCountTokensRequest, MessageTokensCount, 200,
             "Anthropic-compatible: the tokens of the prompt a message call would sample from (`model` is the "
             "experiment)", "experiment", scope=lambda body: body.model, error_shape="anthropic"),
)
