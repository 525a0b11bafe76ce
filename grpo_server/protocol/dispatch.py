"""A worker's HTTP side: its verbs (`protocol/verbs.py`) as routes onto one handler object, and the one
mapping from errors to answers.

Each verb's route parses its msgpack body into the verb's request model, awaits the handler's method of
the same name, and packs what it returns. Every error answers msgpack `{"error": {"code", "message"}}`:
an `ApiError` with its own code and status, a body that is not msgpack or does not validate 400
bad_request, a body over the limit 413 payload_too_large, aiohttp's own others (unknown route, wrong
method) with their status, anything else a logged 500 with its message.

Every route answers only callers holding the workers' secret (`protocol/worker_auth.py`): without it, 401
unauthorized, before the route is even looked up (an unknown path is a 401 too, and tells nothing). The one
exception is `GET /health` with no credentials at all, which docker healthchecks and the front end's start-up
polls use: it runs the worker's own health verb and answers only `{"status": "ok"}` (503 `unhealthy` if that
fails), never the model, the adapters or the counters. A wrong secret there is a 401 like anywhere else, so a
front end given another secret than its workers finds out at its first poll.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Awaitable, Callable, Iterable

from aiohttp import web
from pydantic import ValidationError

from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.deadline import deadline_middleware
from grpo_server.protocol.log_context import bound, from_headers
from grpo_server.protocol.errors import (
    ApiError, BadRequest, PayloadTooLarge, Unauthorized, Unavailable, describe_validation_error,
)
from grpo_server.protocol.verbs import Verb
from grpo_server.protocol.worker_auth import HEADER, SECRET_ENV, check_secret, presented

log = logging.getLogger(__name__)


def reply(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=pack(payload), status=status, content_type=MSGPACK)


def error_reply(error: ApiError) -> web.Response:
    return reply(error.body(), error.status)


@web.middleware
async def context_middleware(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The caller's log context (request id, experiment, version: protocol/log_context.py), bound while the verb
    runs, so this worker's lines about a request carry the front end's id for it (outermost: errors too)."""
    with bound(**from_headers(request.headers)):
        return await handler(request)


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
        if disk_full(exc):  # not this request's fault, nor a bug: space may come back (pruning, an operator)
            log.error("%s %s failed, the disk is full: %s", request.method, request.path, exc)
            return error_reply(Unavailable(f"the run directory's disk is full: {exc}", code="disk_full",
                                           retry_after=DISK_FULL_RETRY_S))
        log.exception("%s %s failed", request.method, request.path)
        return error_reply(ApiError(f"{type(exc).__name__}: {exc}", code="internal", status=500))


DISK_FULL_RETRY_S = 30.0


def disk_full(exc: BaseException) -> bool:
    """`exc` (or what caused it) is a write refused for want of space (ENOSPC, EDQUOT). torch's writers report it
    as a RuntimeError that only names it in its text."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "file write failed" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


OPEN_PATH = "/health"
MAX_LOGGED_ADDRESSES = 1000  # a refused address is logged once; a scan of many addresses cannot fill the memory


def auth_middleware(secret: str) -> Callable:
    """Refuse every request without `secret` (401), except the open health answer (the module's docstring)."""
    check_secret(secret, "the worker secret")
    logged: set[str] = set()

    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        given = presented(request.headers.get(HEADER), secret)
        if given:
            return await handler(request)
        if given is None and request.method in ("GET", "HEAD") and request.path == OPEN_PATH:
            return await _open_health(request, handler)
        address = request.remote or "?"
        if address not in logged and len(logged) < MAX_LOGGED_ADDRESSES:
            logged.add(address)
            log.warning("refused %s %s from %s: %s worker secret (logged once per address)", request.method,
                        request.path, address, "no" if given is None else "a wrong")
        raise Unauthorized(f"{'no' if given is None else 'wrong'} worker secret: a worker answers only its front "
                           f"end, which sends {HEADER}: Bearer <the secret in {SECRET_ENV}>")

    return middleware


async def _open_health(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Response:
    try:
        response = await handler(request)
    except Exception as exc:  # its message may name what this answer keeps to the secret's holders
        log.warning("health (asked without the secret) failed: %s: %s", type(exc).__name__, exc)
        response = None
    if response is None or response.status != 200:
        raise ApiError("the worker is not healthy (its log says why)", code="unhealthy", status=503)
    return reply({"status": "ok"})


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


def worker_app(verbs: Iterable[Verb], handler: object, max_body_bytes: int, *, secret: str) -> web.Application:
    """An app whose route /<verb> awaits `handler.<verb>(request model)` (no argument for a GET verb), for
    callers that send `secret` only (routes added later too)."""
    # error_middleware outside auth: the 401 gets the usual error body.
    app = web.Application(middlewares=[context_middleware, error_middleware, auth_middleware(secret),
                                       deadline_middleware],
                          client_max_size=max_body_bytes)
    app.add_routes([_route(verb, getattr(handler, verb.name)) for verb in verbs])
    return app
