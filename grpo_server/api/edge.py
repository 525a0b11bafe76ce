"""The edge every route shares, whatever its API family: the middlewares around each request (every error
becomes `{"error": {"code", "message"}}` with its status, with OpenAI's `type` and `param` besides on the
OpenAI-compatible routes, in Anthropic's shape on the Messages routes; requests are counted for /metrics), bodies
in and out (JSON, or msgpack when the client says so), and keys (the admin key manages everything; an experiment's own
key reaches that experiment only; keys are compared in constant time and never logged; an address that keeps
sending unknown keys is slowed down: `auth_limit.py`). A route authorises (`caller`, `require`), parses into a
typed model (`parse_body`), calls the experiment's owner (or the orchestrator) and answers (`respond`)."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
from typing import Any, Awaitable, Callable, Iterable, TypeVar

import msgpack
from aiohttp import web
from pydantic import BaseModel, ValidationError

from grpo_server.api.app_state import (ADMIN_KEY, AUTH_LIMITER, BODY_POOL, HTTP_COUNTER, ORCHESTRATOR, RATE_LIMITER,
                                       REFUSAL_PACER)
from grpo_server.api.route_table import ADMIN_PRINCIPAL, ERROR_SHAPE, RESOURCE, Endpoint, Principal
from grpo_server.config import ExperimentConfig
from grpo_server.protocol import log_context
from grpo_server.protocol.codec import MSGPACK
from grpo_server.protocol.log_context import CLIENT_REQUEST_ID, REQUEST_ID_HEADER, bound, new_request_id
from grpo_server.protocol.errors import (ApiError, BadRequest, Forbidden, PayloadTooLarge, Unauthorized, Unprocessable,
                                         describe_validation_error, validation_param)

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


# --- the edge -----------------------------------------------------------------------------------------------


# A body larger than this is decoded and validated on a thread: an 8 MiB body of numbers takes the parser and
# pydantic a good part of a second, which on the event loop would hold every other request (and /v1/health).
OFF_LOOP_BYTES = 64 * 1024


async def read_body(request: web.Request) -> bytes:
    """The body's bytes (413 over the server's max_body_bytes)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(f"request body over {request.client_max_size} bytes") from exc


async def parse_body(request: web.Request, model: type[M], who: Principal | None = None) -> M:
    """The body as `model`: 400 for an undecodable body, 413 too large, 422 naming each bad field. A large one is
    decoded in the caller's slot of the body pool (api/body_pool.py), and refused before it is read while that
    slot's queue is full."""
    if (request.content_length or 0) > OFF_LOOP_BYTES:
        request.app[BODY_POOL].check(_pool_owner(request, who))
    raw = await read_body(request)
    if len(raw) > OFF_LOOP_BYTES:
        return await off_loop(request, who, lambda: decode_body(raw, request.content_type, model))
    return decode_body(raw, request.content_type, model)


def off_loop(request: web.Request, who: Principal | None, decode: Callable[[], M],
             in_process: bool = False) -> Awaitable[M]:
    """`decode()` on the body pool, in the slot of `who` (a public route's caller: its address); `in_process`: in
    the pool's process (api/body_pool.py)."""
    return request.app[BODY_POOL].run(_pool_owner(request, who), decode, in_process)


def _pool_owner(request: web.Request, who: Principal | None) -> str:
    return who.owner if who is not None else f"address:{request.remote}"


def decode_body(raw: bytes, content_type: str, model: type[M]) -> M:
    """`parse_body`'s work on the bytes: JSON (or msgpack) decoded, then validated as `model`."""
    try:
        if content_type == MSGPACK:
            data = msgpack.unpackb(raw, raw=False)
        else:
            data = json.loads(raw) if raw else {}
            if _has_lone_surrogate(data):
                raise ValueError("a string holds a lone UTF-16 surrogate (e.g. \\ud800): not Unicode text")
    except (ValueError, RecursionError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # RecursionError: JSON nested deeper than Python's parser goes.
        raise BadRequest(f"body is not valid {'msgpack' if content_type == MSGPACK else 'JSON'}: "
                         f"{exc}", code="malformed_body") from exc
    if not isinstance(data, dict):
        raise BadRequest("body must be an object", code="malformed_body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise Unprocessable(describe_validation_error(exc), code="invalid_request",
                            param=validation_param(exc)) from exc


def _has_lone_surrogate(data: Any) -> bool:
    """JSON can hold a lone surrogate (escaped as \\ud800, or raw: the parser decodes bytes with
    'surrogatepass'), which no UTF-8 text holds: such a string passes pydantic's `str` and then fails deep
    inside (the tokenizer, msgpack to the workers, comparing keys). Iterative: the data may be nested up to
    the JSON parser's limit."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def wants_msgpack(request: web.Request) -> bool:
    return MSGPACK in request.headers.get("Accept", "")


def respond(request: web.Request, payload: BaseModel | dict[str, Any], status: int = 200) -> web.Response:
    if wants_msgpack(request):
        data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
        return web.Response(body=msgpack.packb(data, use_bin_type=True), status=status, content_type=MSGPACK)
    if isinstance(payload, BaseModel):  # NaN / inf become null: JSON has no such numbers
        return web.Response(text=payload.model_dump_json(), status=status, content_type="application/json")
    return web.json_response(payload, status=status)


def error_response(error: ApiError, request: web.Request | None = None) -> web.Response:
    """`error` as its status and JSON body, in the shape of the route `request` reached (`Endpoint.error_shape`)."""
    headers = {"Retry-After": str(int(error.retry_after))} if error.retry_after else None
    shape = request.get(ERROR_SHAPE) if request is not None else None
    body = {"openai": error.openai_body, "anthropic": error.anthropic_body}.get(shape, error.body)()
    return web.json_response(body, status=error.status, headers=headers)


# --- middlewares: around every route ------------------------------------------------------------------------


@web.middleware
async def context_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Binds the request's id (the client's X-Request-Id when it is short and plain, else a new one) and the
    experiment in its path for every log line the request causes, here and in the workers it calls
    (grpo_server/protocol/log_context.py); the id goes back in the answer's X-Request-Id (`echo_request_id`)."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if CLIENT_REQUEST_ID.fullmatch(given) else new_request_id()
    with bound(request_id=request_id, experiment=request.match_info.get("name")):
        response = await handler(request)
    if not response.prepared:  # a stream sent its headers already, with the id (`echo_request_id`)
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: a stream's headers go out inside its handler, before its first event, in the request's
    context; they carry the id too."""
    if (request_id := log_context.current().get("request_id")) is not None:
        response.headers[REQUEST_ID_HEADER] = str(request_id)


@web.middleware
async def count_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Requests by route template and status, for /metrics (outermost: it sees the final status)."""
    response = await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[HTTP_COUNTER].add(request.method, route, response.status)
    return response


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Domain errors -> their status; aiohttp's own -> JSON; anything else -> 500 without a trace."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc, request)
    except web.HTTPRequestEntityTooLarge:
        return error_response(PayloadTooLarge("request body too large"), request)
    except web.HTTPException as exc:
        if exc.status >= 400:
            response = error_response(ApiError(exc.reason, code=exc.reason.lower().replace(" ", "_"),
                                               status=exc.status), request)
            if "Allow" in exc.headers:  # a 405 says which methods the route takes (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError("internal error (logged on the server)", code="internal", status=500),
                              request)


# --- keys ---------------------------------------------------------------------------------------------------

TINKER_KEY_HEADER = "X-API-Key"
TINKER_KEY_PREFIX = "tml-"


def _bearer(request: web.Request) -> str:
    """The key: `Authorization: Bearer <key>`, or `X-API-Key` (any case): the Tinker SDK's way, `tml-<key>`, and the
    Anthropic API's, `<key>`, on every route alike (a header is a header; the key checks are the same)."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    tinker_key = request.headers.get(TINKER_KEY_HEADER, "").strip()
    if tinker_key:
        # The SDK refuses a key without the prefix, so a Tinker client sends `tml-` + this server's key.
        return tinker_key.removeprefix(TINKER_KEY_PREFIX)
    raise Unauthorized("missing key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')", code="missing_key")


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def principal(request: web.Request, admin_key: str, experiments: Iterable[ExperimentConfig]) -> Principal:
    """The admin, or the experiment whose key was given. 401 for an unknown key."""
    token = _bearer(request)
    if _same(token, admin_key):
        return ADMIN_PRINCIPAL
    found = None
    for config in experiments:  # every key is compared, so timing does not reveal which matched
        if config.api_key is not None and _same(token, config.api_key.get_secret_value()):
            found = config.name
    if found is None:
        raise Unauthorized("invalid API key", code="invalid_key")
    return Principal("experiment", found)


def require(who: Principal, experiment: str | None = None, admin_only: bool = False) -> None:
    if who.is_admin:
        return
    if admin_only:
        raise Forbidden("this call needs the admin key", code="admin_only")
    if experiment is not None and not who.may_use(experiment):
        raise Forbidden("this key does not grant access to that experiment", code="wrong_experiment")


def caller(request: web.Request) -> Principal:
    """The admin or the experiment whose key the request carries (401 otherwise; 429 while its address has sent
    too many unknown keys)."""
    orchestrator = request.app[ORCHESTRATOR]
    limiter = request.app[AUTH_LIMITER]
    limiter.check(request.remote)
    try:
        return principal(request, request.app[ADMIN_KEY], orchestrator.configs())
    except Unauthorized as exc:
        if exc.code == "invalid_key":
            limiter.failed(request.remote)
        raise


def aiohttp_routes(endpoints: tuple[Endpoint, ...]) -> list[web.RouteDef]:
    """The table's rows as aiohttp routes, each handler behind its row's rules (`guarded`)."""
    return [web.route(e.method, e.path, guarded(e)) for e in endpoints]


async def _by_codec(request: web.Request, endpoint: Endpoint, who: Principal | None) -> BaseModel:
    """A `codec` row's body: its resource resolved from a peek at the bytes (404 before any decoding), then the
    whole body decoded on the body pool, in the caller's slot."""
    codec = endpoint.codec
    request.app[BODY_POOL].check(_pool_owner(request, who))  # a full slot refuses before the bytes are read
    raw = await read_body(request)
    try:
        peeked = codec.peek(raw)
        if endpoint.resource is not None:
            request[RESOURCE] = endpoint.resource(request, who, peeked)
        decode = codec.decoder(request)
        return await off_loop(request, who, functools.partial(decode, raw), codec.in_process)
    except codec.over_limit as exc:
        raise Unprocessable(str(exc), code="over_limit") from None  # no frame of the partial decode kept
    except (ValueError, KeyError, IndexError) as exc:  # ValueError includes pydantic's ValidationError
        raise BadRequest(f"body is not {codec.describes}: {exc}", code="malformed_body") from exc


# The refusals a key is paced on once it keeps drawing them (api/rate_limit.py `RefusalPacer`): too many requests, and
# bodies that can never pass (malformed, too large, invalid). Not 404, 408 or 409: answers a working client gets in
# the normal course (a Tinker future not ready yet is a 408 it polls again).
PACED_STATUSES = frozenset({400, 413, 422, 429})


def guarded(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`endpoint.handler` behind the row's rules, in this order: the caller's key (401 / 429) before the body is
    looked at; `admin` rows the admin's only, `experiment` rows the admin's or the experiment's own (the path's
    `{name}`, else the one the body names through `scope`: 403); then the body as the row's model. A key's
    refusals (PACED_STATUSES), whichever rule gives them, are paced once it keeps drawing them."""
    auth = endpoint.auth
    scoped_by_path = "{name}" in endpoint.path

    async def handle(request: web.Request) -> web.StreamResponse:
        request[ERROR_SHAPE] = endpoint.error_shape  # first: a 401 below is written in the row's shape too
        who = None if auth == "public" else caller(request)
        if who is None:
            return await checked(request, who)
        try:
            request.app[RATE_LIMITER].take(who)  # 429 rate_limited: this key's requests a second (api/rate_limit.py)
            return await checked(request, who)
        except ApiError as exc:  # a key that keeps being refused gets its refusals after a pause
            if exc.status in PACED_STATUSES:
                await request.app[REFUSAL_PACER].pace(who, exc.retry_after)
            raise

    async def checked(request: web.Request, who: Principal | None) -> web.StreamResponse:
        if auth == "admin":
            require(who, admin_only=True)
        elif auth == "experiment" and scoped_by_path:
            require(who, request.match_info["name"])
        if endpoint.codec is not None:
            return await endpoint.handler(request, who, await _by_codec(request, endpoint, who))
        body = await parse_body(request, endpoint.request, who) if endpoint.request is not None else None
        if auth == "experiment" and endpoint.scope is not None:
            named = endpoint.scope(body)
            if named is None and not who.is_admin:
                raise Forbidden("an experiment's key acts on its own experiment: name it", code="wrong_experiment")
            if named is not None:
                require(who, named)
        if endpoint.resource is not None:
            request[RESOURCE] = endpoint.resource(request, who, body)
        return await endpoint.handler(request, who, body)
    return handle

