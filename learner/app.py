"""The learner's HTTP face: msgpack verbs over aiohttp, one route table, errors mapped in one place.

All torch work runs in a worker thread under ONE lock (the model and its adapters are shared state), so
the event loop stays free: /health and /status answer while a train step runs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel, ValidationError

from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.wire import (
    AdapterVersion, AddExperimentRequest, LearnerStatus, LogprobsRequest, LogprobsResponse,
    RemoveExperimentRequest, SaveAdapterRequest, TrainRequest,
)
from learner.errors import LearnerError, bad_request

log = logging.getLogger(__name__)

TRAINER = web.AppKey("trainer", object)  # a learner.trainer.MultiAdapterTrainer
LOCK = web.AppKey("lock", asyncio.Lock)
MAX_BODY_BYTES = 512 * 1024 * 1024  # a train batch carries token ids and logprobs of every sample


def _reply(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=pack(payload), status=status, content_type=MSGPACK)


def _error(code: str, message: str, status: int) -> web.Response:
    return _reply({"error": {"code": code, "message": message}}, status)


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except LearnerError as exc:
        return _error(exc.code, exc.message, exc.status)
    except ValidationError as exc:
        return _error("bad_request", _describe(exc), 400)
    except web.HTTPException as exc:  # unknown route, wrong method, body too large
        return _error(exc.reason.lower().replace(" ", "_"), exc.text or exc.reason, exc.status)
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _error("internal", f"{type(exc).__name__}: {exc}", 500)


def _describe(exc: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:5]]
    return "invalid request: " + "; ".join(parts)


async def _parse(request: web.Request, model: type[BaseModel]) -> Any:
    raw = await request.read()  # outside the try: a body over the limit is a 413, not a bad_request
    try:
        data = unpack(raw)
    except Exception as exc:
        raise bad_request(f"the body is not msgpack: {exc}") from exc
    return model.model_validate(data)


async def _run(request: web.Request, fn: Callable[..., Any], *args: Any) -> Any:
    async with request.app[LOCK]:
        return await asyncio.to_thread(fn, *args)


async def add_experiment(request: web.Request) -> web.Response:
    body: AddExperimentRequest = await _parse(request, AddExperimentRequest)
    trainer = request.app[TRAINER]
    return _reply(await _run(request, trainer.add_experiment, body.name, body.lora, body.algorithm))


async def train(request: web.Request) -> web.Response:
    body: TrainRequest = await _parse(request, TrainRequest)
    return _reply(await _run(request, request.app[TRAINER].train, body))


async def save_adapter(request: web.Request) -> web.Response:
    body: SaveAdapterRequest = await _parse(request, SaveAdapterRequest)
    trainer = request.app[TRAINER]
    saved: AdapterVersion = await _run(request, trainer.save_adapter, body.name)
    if body.probe is not None:
        # Under exactly the saved weights: only this experiment's own next step could move them, and its
        # front end waits for this answer before sending one.
        saved.probe_logprobs = await _run(request, trainer.logprobs, LogprobsRequest(name=body.name,
                                                                                    **body.probe.model_dump()))
    return _reply(saved)


async def logprobs(request: web.Request) -> web.Response:
    body: LogprobsRequest = await _parse(request, LogprobsRequest)
    rows = await _run(request, request.app[TRAINER].logprobs, body)
    return _reply(LogprobsResponse(logprobs=rows))


async def remove_experiment(request: web.Request) -> web.Response:
    body: RemoveExperimentRequest = await _parse(request, RemoveExperimentRequest)
    await _run(request, request.app[TRAINER].remove_experiment, body.name)
    return _reply({"removed": body.name})


async def status(request: web.Request) -> web.Response:
    # No lock: a snapshot of counters, so it answers during a train step.
    return _reply(LearnerStatus(experiments=request.app[TRAINER].status()))


async def health(request: web.Request) -> web.Response:
    return _reply({"status": "ok"})


def create_app(trainer: Any) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[TRAINER] = trainer
    app[LOCK] = asyncio.Lock()
    app.add_routes([
        web.post("/add_experiment", add_experiment),
        web.post("/train", train),
        web.post("/save_adapter", save_adapter),
        web.post("/logprobs", logprobs),
        web.post("/remove_experiment", remove_experiment),
        web.get("/status", status),
        web.get("/health", health),
    ])
    return app
