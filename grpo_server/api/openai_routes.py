"""OpenAI-compatible `POST /v1/chat/completions` and `POST /v1/completions`: authorise (the admin key or the
experiment's own key; the experiment is the `model` field), convert, sample one group, convert back. And
`GET /v1/models` (the experiments the key may use) and `GET /v1/models/{name}`, which agent frameworks ask
first. The bodies and conversions live in `openai_models.py`."""

from __future__ import annotations

import time
from typing import Callable

from aiohttp import web

from grpo_server.api.app_keys import ORCHESTRATOR
from grpo_server.api.handlers import ADMIN, caller, parse_body, require, respond
from grpo_server.api.openai_models import (ChatCompletionRequest, CompletionRequest, Model, ModelList, OpenAIRequest,
                                           chat_response, chat_to_request, completion_response, completion_to_request)
from grpo_server.api_models import CompletionsRequest, CompletionsResponse
from grpo_server.runtime.experiment import Experiment


async def _sample(request: web.Request, who: str, body: OpenAIRequest,
                  convert: Callable[..., CompletionsRequest]) -> CompletionsResponse:
    require(who, body.model)
    experiment = request.app[ORCHESTRATOR].get(body.model)  # 404 experiment_not_found before anything else
    return await experiment.complete(convert(body))


def _token_text(request: web.Request, result: CompletionsResponse) -> dict[int, str]:
    """Each sampled token id's own decoded string (for logprobs)."""
    tokenizer = request.app[ORCHESTRATOR].prompts.tokenizer
    ids = {t for c in result.completions for t in c.token_ids}
    return {t: tokenizer.decode([t], skip_special_tokens=False) for t in ids}


async def chat_completions(request: web.Request) -> web.Response:
    who = caller(request)  # 401 before the body is looked at
    body = await parse_body(request, ChatCompletionRequest)
    result = await _sample(request, who, body, chat_to_request)
    token_text = _token_text(request, result) if body.logprobs else None
    return respond(request, chat_response(body.model, result, int(time.time()), token_text))


async def completions(request: web.Request) -> web.Response:
    who = caller(request)
    body = await parse_body(request, CompletionRequest)
    result = await _sample(request, who, body, completion_to_request)
    token_text = _token_text(request, result) if body.logprobs is not None else None
    return respond(request, completion_response(body.model, result, int(time.time()), token_text))


def _model(experiment: Experiment) -> Model:
    return Model(id=experiment.name, created=int(experiment.created_at))


async def list_models(request: web.Request) -> web.Response:
    """The experiments this key may sample: every one for the admin key, its own for an experiment's key."""
    who = caller(request)
    orchestrator = request.app[ORCHESTRATOR]
    names = sorted(orchestrator.experiments) if who == ADMIN else [who]
    return respond(request, ModelList(data=[_model(orchestrator.get(name)) for name in names]))


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require(caller(request), name)
    return respond(request, _model(request.app[ORCHESTRATOR].get(name)))
