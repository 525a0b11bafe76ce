"""The sampler's HTTP layer: msgpack verbs over one `Engine`.

POST /generate /score /load_adapter /unload_adapter (msgpack bodies, `grpo_server.protocol.wire` models),
GET /health. Every error answers msgpack `{"error": {"code", "message"}}`: a body that does not
validate is 400 bad_request, an `EngineError` carries its own code and status, anything else is a
logged 500 with its message. The engine starts and stops with the app (a cleanup context), so the
port only answers once the model is loaded.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.wire import (
    GenerateRequest, LoadAdapterRequest, SamplerHealth, ScoreRequest, UnloadAdapterRequest,
)
from sampler.engine import Engine, EngineError

log = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", Engine)
# Score bodies carry many completions; aiohttp's 1 MiB default is too small.
MAX_BODY_BYTES = 256 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


def reply(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=pack(obj), status=status, content_type=MSGPACK)


def error_reply(code: str, message: str, status: int) -> web.Response:
    return reply({"error": {"code": code, "message": message}}, status)


async def parse(request: web.Request, model: type[M]) -> M:
    body = await request.read()
    try:
        data = unpack(body)
    except Exception as exc:  # msgpack raises several unrelated types for a bad body
        raise EngineError("bad_request", f"the body is not msgpack: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise EngineError("bad_request", f"{model.__name__}: {exc}") from exc


@web.middleware
async def errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Domain errors map to HTTP codes here, in one place."""
    try:
        return await handler(request)
    except EngineError as exc:
        return error_reply(exc.code, exc.message, exc.status)
    except web.HTTPException as exc:  # unknown route, wrong method
        return error_reply("http_error", exc.reason, exc.status)
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return error_reply("internal", f"{type(exc).__name__}: {exc}", 500)


async def generate(request: web.Request) -> web.Response:
    req = await parse(request, GenerateRequest)
    return reply(await request.app[ENGINE].generate(req))


async def score(request: web.Request) -> web.Response:
    req = await parse(request, ScoreRequest)
    return reply(await request.app[ENGINE].score(req))


async def load_adapter(request: web.Request) -> web.Response:
    req = await parse(request, LoadAdapterRequest)
    engine = request.app[ENGINE]
    await engine.load_adapter(req.adapter, req.path)
    return reply({"adapters": await engine.loaded_adapters()})


async def unload_adapter(request: web.Request) -> web.Response:
    req = await parse(request, UnloadAdapterRequest)
    engine = request.app[ENGINE]
    await engine.unload_adapter(req.adapter)
    return reply({"adapters": await engine.loaded_adapters()})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return reply(
        SamplerHealth(
            engine=engine.name,
            model=str(engine.config.model_path),
            adapters=await engine.loaded_adapters(),
            max_model_len=engine.max_model_len,
            merged_adapter=engine.merged,
            merge_unsupported=engine.merge_unsupported,
        )
    )


async def engine_lifetime(app: web.Application) -> Any:
    engine = app[ENGINE]
    await engine.start()
    log.info("%s engine ready (max_model_len %d)", engine.name, engine.max_model_len)
    yield
    await engine.shutdown()


def create_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app.cleanup_ctx.append(engine_lifetime)
    app.add_routes(
        [
            web.post("/generate", generate),
            web.post("/score", score),
            web.post("/load_adapter", load_adapter),
            web.post("/unload_adapter", unload_adapter),
            web.get("/health", health),
        ]
    )
    return app
