"""OpenAI-compatible `POST /v1/responses` (the Responses API, what the Agents SDK's default model speaks), on
the chat-completions machinery: the body (`responses_models.py`) becomes the chat message list the chat path
renders (`responses_items.py`) and one `CompletionsRequest`, so a response is one group (of one, unless our
`n` asks for more) or, with `episode_id` / `X-Episode-Id`, one turn of an episode with the drift-free reuse of
sampled ids. Stored responses (`responses_store.py`) let `previous_response_id` continue a conversation.
`stream: true` answers with the Responses API's events (`responses_stream.py`).

Who may call: the admin key or the experiment's own (`model`), checked before the body's fields are (so an
experiment key learns nothing of another experiment from a 400)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from grpo_server.api.app_state import ORCHESTRATOR, RESPONSES
from grpo_server.api.edge import respond
from grpo_server.api.openai.responses_items import items_to_messages
from grpo_server.api.openai.responses_models import (LOGPROBS_INCLUDE, Echo, ResponseObject, ResponsesRequest,
                                                     chat_tool_choice, chat_tools, check_fields, conversation,
                                                     echoed_tools)
from grpo_server.api.openai.responses_store import ResponseStore, StoredResponse
from grpo_server.api.openai.responses_stream import EVENTS_TEXT, ResponseStreamEvent, stream_response
from grpo_server.api.openai.streaming import id_header
from grpo_server.api.route_table import Endpoint, Principal
from grpo_server.api_models import ChatMessage, CompletionsRequest, CompletionsResponse
from grpo_server.config import ServerConfig
from grpo_server.protocol.errors import BadRequest, Unprocessable, describe_validation_error, validation_param
from grpo_server.runtime.chat_render import tool_calling_of
from grpo_server.runtime.experiment import Experiment

EPISODE_HEADER = "X-Episode-Id"  # as on chat completions (routes.py)
# Our sampling request's fields that a Responses field of another name becomes: an error names the client's field.
SAMPLING_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}


def response_store(config: ServerConfig) -> ResponseStore:
    """The server's store, bounded as its episodes are (responses_store.py)."""
    return ResponseStore(per_experiment=config.max_pending_episodes, total=4 * config.max_pending_episodes,
                         ttl_s=config.episode_ttl_s)


def _episode_id(request: web.Request, body: ResponsesRequest) -> str | None:
    header = request.headers.get(EPISODE_HEADER)
    if header is not None and body.episode_id is not None and header != body.episode_id:
        raise BadRequest(f"the body's episode_id {body.episode_id!r} and the {EPISODE_HEADER} header {header!r} "
                         "differ: send one, or the same in both", code="episode_id_mismatch")
    return body.episode_id if body.episode_id is not None else header


def _sample(body: ResponsesRequest, messages: list[ChatMessage], episode_id: str | None) -> CompletionsRequest:
    fields: dict[str, Any] = dict(
        messages=messages, n=body.n if body.n is not None else 1, temperature=body.temperature, top_p=body.top_p,
        max_tokens=body.max_output_tokens, tools=chat_tools(body.tools), tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, episode_id=episode_id)
    try:  # our bounds (temperature in [0, 2], max tokens >= 1, the episode id's pattern, ...) are 422s
        sample = CompletionsRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        param = validation_param(exc)
        raise Unprocessable(describe_validation_error(exc), code="invalid_request",
                            param=SAMPLING_PARAMS.get(param or "", param)) from exc
    tool_calling_of(sample)  # tools_missing / unknown_tool now: in a stream they would come after the headers
    return sample


def _echo(body: ResponsesRequest, experiment: Experiment) -> Echo:
    sampling = experiment.config.sampling
    return Echo(model=body.model, instructions=body.instructions, tools=echoed_tools(body.tools),
                tool_choice=body.tool_choice or "auto", parallel_tool_calls=body.parallel_tool_calls is not False,
                temperature=sampling.temperature if body.temperature is None else body.temperature,
                top_p=body.top_p or sampling.top_p, max_output_tokens=body.max_output_tokens or sampling.max_tokens,
                previous_response_id=body.previous_response_id, store=body.store is not False,
                metadata=body.metadata or {}, user=body.user, truncation=body.truncation or "disabled",
                logprobs=LOGPROBS_INCLUDE in (body.include or ()), max_tool_calls=body.max_tool_calls,
                safety_identifier=body.safety_identifier, prompt_cache_key=body.prompt_cache_key)


async def create_response(request: web.Request, who: Principal, body: ResponsesRequest) -> web.StreamResponse:
    experiment = request.app[ORCHESTRATOR].get(body.model)  # 404 experiment_not_found before anything else
    check_fields(body)
    store = request.app[RESPONSES]
    history = list(store.get(experiment.name, experiment.created_at, body.previous_response_id).messages) \
        if body.previous_response_id else []
    messages, stored = conversation(body, history)
    sample = _sample(body, messages, _episode_id(request, body))
    echo = _echo(body, experiment)
    tokenizer = request.app[ORCHESTRATOR].prompts.tokenizer

    def answer(result: CompletionsResponse) -> ResponseObject:
        token_text = None
        if echo.logprobs:
            ids = {t for c in result.completions for t in c.token_ids}
            token_text = {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}
        return echo.answer(result, token_text)

    def keep(response: ResponseObject) -> None:
        """Stored once its client has it: its conversation, and its output read back as a client sends it."""
        if echo.store:
            reply = items_to_messages([item.model_dump() for item in response.output])
            store.put(response.id, StoredResponse(experiment.name, experiment.created_at,
                                                  tuple(stored + reply), time.monotonic()))

    if body.stream:
        return await stream_response(request, experiment, sample, echo, answer, delivered=keep,
                                     decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    result = await experiment.complete(sample)
    response = answer(result)
    keep(response)
    answered = respond(request, response)
    answered.headers.update(id_header(result.group_id, result.episode_id))
    return answered


ROUTES: tuple[Endpoint, ...] = (
    Endpoint("POST", "/v1/responses", create_response, ResponsesRequest, ResponseObject, 200,
             "OpenAI-compatible Responses API (`model` is the experiment): one completion, or one turn of an "
             "episode", "experiment", (429, 502, 503), events=ResponseStreamEvent, events_text=EVENTS_TEXT,
             scope=lambda body: body.model),
)
