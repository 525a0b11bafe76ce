"""A worker's HTTP side: its verbs (`protocol/verbs.py`) as routes onto one handler object, and the one
mapping from errors to answers.

Each verb's route parses its msgpack body into the verb's request model, awaits the handler's method of
the same name, and packs what it returns. Every error answers msgpack `{"error": {"code", "message"}}`:
an `ApiError` with its own code and status, a body that is not msgpack or does not validate 400
bad_request, a body over the limit 413 payload_too_large, aiohttp's own others (unknown route, wrong
method) with their status, anything else a logged 500 with its message.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Iterable

from aiohttp import web
from pydantic import ValidationError

from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.errors import ApiError, BadRequest, PayloadTooLarge, describe_validation_error
from grpo_server.protocol.verbs import Verb

log = logging.getLogger(__name__)


def reply(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=pack(payload), status=status, content_type=MSGPACK)


def error_reply(error: ApiError) -> web.Response:
    return reply(error.body(), error.status)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_reply(exc)
    except ValidationError as exc:
        return error_reply(BadRequest("invalid request: " + describe_validation_error(exc, most=5)))
    except web.HTTPRequestEntityTooLarge as exc:  # the front end's code for it too
        return error_reply(PayloadTooLarge(exc.text or "request body too large"))
    except web.HTTPException as exc:
        return error_reply(ApiError(exc.text or exc.reason, code=exc.reason.lower().replace(" ", "_"),
                                    status=exc.status))
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return error_reply(ApiError(f"{type(exc).__name__}: {exc}", code="internal", status=500))


def _route(verb: Verb, method: Callable[..., Awaitable[Any]]) -> web.RouteDef:
    async def handle(request: web.Request) -> web.Response:
        if verb.request is None:
            return reply(await method())
        raw = await request.read()  # outside the try: a body over the limit is a 413, not a bad_request
        try:
            data = unpack(raw)
        except Exception as exc:  # msgpack raises several unrelated types for a bad body
            raise BadRequest(f"the body is not msgpack: {exc}") from exc
        return reply(await method(verb.request.model_validate(data)))

    path = f"/{verb.name}"
    return web.get(path, handle) if verb.method == "GET" else web.post(path, handle)  # web.get answers HEAD too


def worker_app(verbs: Iterable[Verb], handler: object, max_body_bytes: int) -> web.Application:
    """An app whose route /<verb> awaits `handler.<verb>(request model)` (no argument for a GET verb)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app.add_routes([_route(verb, getattr(handler, verb.name)) for verb in verbs])
    return app
