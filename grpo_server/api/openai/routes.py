"""OpenAI-compatible `POST /v1/chat/completions` and `POST /v1/completions`: authorise (the admin key or the
experiment's own key; the experiment is the `model` field), convert, sample one group, convert back; with
`stream: true`, the same answer as server-sent events (`streaming.py`). And `GET /v1/models` (the experiments
the key may use) and `GET /v1/models/{name}`, which agent frameworks ask first. The bodies and conversions
live in `models.py`, vLLM's extensions in `vllm_fields.py`, and vLLM's `/tokenize` and `/detokenize` in
`vllm_tokenize.py`.

Every sampling answer names what feedback needs in a header as well: `X-Group-Id`, or `X-Episode-Id` for an
episode's turn. A request's `X-Episode-Id` header makes the call a turn of that episode, as `episode_id` in
the body does (for clients that cannot add body fields); both, and different, is a 400."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

from aiohttp import web
from pydantic import ValidationError

from grpo_server.api.app_state import ORCHESTRATOR
from grpo_server.api.edge import respond
from grpo_server.api.openai.models import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, Model,
                                           ModelList, OpenAIRequest, TextCompletionResponse, chat_response,
                                           chat_to_request, completion_response, completion_to_request)
from grpo_server.api.openai.responses import ROUTES as RESPONSES_ROUTES
from grpo_server.api.openai.streaming import ChatCompletionChunk, TextCompletionChunk, id_header, stream_group
from grpo_server.api.openai.vllm_tokenize import VLLM_TOKEN_ROUTES
from grpo_server.api.route_table import Endpoint, Principal
from grpo_server.api_models import CompletionsRequest, CompletionsResponse
from grpo_server.protocol.errors import BadRequest, Unprocessable, describe_validation_error
from grpo_server.runtime.experiment import Experiment

EPISODE_HEADER = "X-Episode-Id"


def _admit(request: web.Request, body: OpenAIRequest,
           convert: Callable[..., CompletionsRequest]) -> tuple[Experiment, CompletionsRequest]:
    experiment = request.app[ORCHESTRATOR].get(body.model)  # 404 experiment_not_found before anything else
    return experiment, episode_from_header(request, convert(body))


def episode_from_header(request: web.Request, sample: CompletionsRequest) -> CompletionsRequest:
    header = request.headers.get(EPISODE_HEADER)
    if header is None or header == sample.episode_id:
        return sample
    if sample.episode_id is not None:
        raise BadRequest(f"the body's episode_id {sample.episode_id!r} and the {EPISODE_HEADER} header "
                         f"{header!r} differ: send one, or the same in both", code="episode_id_mismatch")
    try:  # validated again, so that the header meets the body field's rules
        return CompletionsRequest.model_validate({**sample.model_dump(exclude_unset=True), "episode_id": header})
    except ValidationError as exc:
        raise Unprocessable(f"{EPISODE_HEADER} header: {describe_validation_error(exc)}",
                            code="invalid_request") from exc


def _token_text(request: web.Request, result: CompletionsResponse, as_ids: bool) -> dict[int, str]:
    """Each sampled token id's own decoded string (for logprobs), or with vLLM's `return_tokens_as_token_ids`
    its id as `token_id:<id>` (a token that is half a character decodes to U+FFFD, as its neighbours may)."""
    ids = {t for c in result.completions for t in c.token_ids}
    if as_ids:
        return {t: f"token_id:{t}" for t in ids}
    tokenizer = request.app[ORCHESTRATOR].prompts.tokenizer
    return {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}


async def _answer(request: web.Request, body: ChatCompletionRequest | CompletionRequest,
                  experiment: Experiment, sample: CompletionsRequest, chat: bool,
                  logprobs: bool) -> web.StreamResponse:
    created = int(time.time())
    # Chat answers always carry vLLM's token fields; a legacy one adds its per-choice prompt ids when asked.
    convert = chat_response if chat else functools.partial(completion_response,
                                                           return_token_ids=bool(body.return_token_ids))

    def answer(result: CompletionsResponse):
        token_text = _token_text(request, result, bool(body.return_tokens_as_token_ids)) if logprobs else None
        return convert(body.model, result, created, token_text)

    if body.stream:
        tokenizer = request.app[ORCHESTRATOR].prompts.tokenizer
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_group(request, experiment, sample, chat=chat, model=body.model,
                                  include_usage=include_usage, answer=answer,
                                  decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    result = await experiment.complete(sample)
    response = respond(request, answer(result))
    response.headers.update(id_header(result.group_id, result.episode_id))
    return response


async def chat_completions(request: web.Request, who: Principal, body: ChatCompletionRequest) -> web.StreamResponse:
    experiment, sample = _admit(request, body, chat_to_request)
    return await _answer(request, body, experiment, sample, chat=True, logprobs=bool(body.logprobs))


async def completions(request: web.Request, who: Principal, body: CompletionRequest) -> web.StreamResponse:
    experiment, sample = _admit(request, body, completion_to_request)
    return await _answer(request, body, experiment, sample, chat=False, logprobs=body.logprobs is not None)


def _model(experiment: Experiment) -> Model:
    return Model(id=experiment.name, created=int(experiment.created_at))


async def list_models(request: web.Request, who: Principal, body: None) -> web.Response:
    """The experiments this key may sample: every one for the admin key, its own for an experiment's key."""
    orchestrator = request.app[ORCHESTRATOR]
    names = sorted(orchestrator.experiments) if who.is_admin else [who.experiment]
    return respond(request, ModelList(data=[_model(orchestrator.get(name)) for name in names]))


async def get_model(request: web.Request, who: Principal, body: None) -> web.Response:
    return respond(request, _model(request.app[ORCHESTRATOR].get(request.match_info["name"])))


_ROWS: tuple[Endpoint, ...] = (
    Endpoint("POST", "/v1/chat/completions", chat_completions, ChatCompletionRequest, ChatCompletionResponse, 200,
             "OpenAI-compatible chat completions (`model` is the experiment)", "experiment", (429, 502, 503),
             events=ChatCompletionChunk, scope=lambda body: body.model),
    Endpoint("POST", "/v1/completions", completions, CompletionRequest, TextCompletionResponse, 200,
             "OpenAI-compatible (legacy) completions (`model` is the experiment)", "experiment", (429, 502, 503),
             events=TextCompletionChunk, scope=lambda body: body.model),
    Endpoint("GET", "/v1/models", list_models, None, ModelList, 200,
             "OpenAI-compatible: the experiments this key may sample, as models", "key"),
    Endpoint("GET", "/v1/models/{name}", get_model, None, Model, 200, "OpenAI-compatible: one experiment as a model",
             "experiment"),
) + RESPONSES_ROUTES + VLLM_TOKEN_ROUTES  # POST /v1/responses (responses.py); vLLM's /tokenize and /detokenize
# (vllm_tokenize.py)
# The family's errors are OpenAI's error object (`type`, `param`): the openai package reads them, and the Open
# Responses spec requires them.
ROUTES: tuple[Endpoint, ...] = tuple(dataclasses.replace(row, error_shape="openai") for row in _ROWS)
