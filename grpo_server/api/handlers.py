"""The native API's routes, and the edge every route shares (the OpenAI routes too): the middlewares around
each request (every error becomes `{"error": {"code", "message"}}` with its status; requests are counted for
/metrics), bodies in and out (JSON, or msgpack when the client says so), and bearer keys (the admin key
manages everything; an experiment's own key reaches that experiment only; keys are compared in constant
time and never logged; an address that keeps sending unknown keys is slowed down: `auth_limit.py`). A route
authorises, parses into a typed model, calls the experiment's owner (or the orchestrator) and responds."""

from __future__ import annotations

import asyncio
import hmac
import io
import json
import logging
import secrets
import tarfile
from pathlib import Path
from typing import Any, Iterable, TypeVar

import msgpack
from aiohttp import web
from pydantic import BaseModel, SecretStr, ValidationError

from grpo_server.api import prometheus
from grpo_server.api.app_keys import ADMIN_KEY, AUTH_LIMITER, HTTP_COUNTER, METRICS_REGISTRY, MODEL_NAME, ORCHESTRATOR
from grpo_server.api.openapi import METRICS_LIMIT_DEFAULT, openapi_json
from grpo_server.api_models import (CompletionsRequest, CreatedExperiment, ExperimentList, FeedbackRequest, Health,
                                    NewExperiment, TokenizeRequest)
from grpo_server.config import ExperimentConfig
from grpo_server.protocol.codec import MSGPACK
from grpo_server.protocol.errors import (ApiError, BadRequest, Conflict, Forbidden, PayloadTooLarge, Unauthorized,
                                         Unprocessable, describe_validation_error)
from grpo_server.runtime.metrics_log import KINDS, RECENT_PER_KIND, MetricsHistory

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


# --- the edge -----------------------------------------------------------------------------------------------


async def parse_body(request: web.Request, model: type[M]) -> M:
    """The body as `model`: 400 for an undecodable body, 413 too large, 422 naming each bad field."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(f"request body over {request.client_max_size} bytes") from exc
    try:
        if request.content_type == MSGPACK:
            data = msgpack.unpackb(raw, raw=False)
        else:
            data = json.loads(raw) if raw else {}
            if _has_lone_surrogate(data):
                raise ValueError("a string holds a lone UTF-16 surrogate (e.g. \\ud800): not Unicode text")
    except (ValueError, RecursionError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # RecursionError: JSON nested deeper than Python's parser goes.
        raise BadRequest(f"body is not valid {'msgpack' if request.content_type == MSGPACK else 'JSON'}: "
                         f"{exc}", code="malformed_body") from exc
    if not isinstance(data, dict):
        raise BadRequest("body must be an object", code="malformed_body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise Unprocessable(describe_validation_error(exc), code="invalid_request") from exc


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


def error_response(error: ApiError) -> web.Response:
    headers = {"Retry-After": str(int(error.retry_after))} if error.retry_after else None
    return web.json_response(error.body(), status=error.status, headers=headers)


# --- middlewares: around every route ------------------------------------------------------------------------


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
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        return error_response(PayloadTooLarge("request body too large"))
    except web.HTTPException as exc:
        if exc.status >= 400:
            response = error_response(ApiError(exc.reason, code=exc.reason.lower().replace(" ", "_"),
                                               status=exc.status))
            if "Allow" in exc.headers:  # a 405 says which methods the route takes (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError("internal error (logged on the server)", code="internal", status=500))


# --- keys ---------------------------------------------------------------------------------------------------

ADMIN = "admin"


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing 'Authorization: Bearer <key>' header", code="missing_key")
    return token.strip()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def principal(request: web.Request, admin_key: str, experiments: Iterable[ExperimentConfig]) -> str:
    """ADMIN, or the name of the experiment whose key was given. 401 for an unknown key."""
    token = _bearer(request)
    if _same(token, admin_key):
        return ADMIN
    found = None
    for config in experiments:  # every key is compared, so timing does not reveal which matched
        if config.api_key is not None and _same(token, config.api_key.get_secret_value()):
            found = config.name
    if found is None:
        raise Unauthorized("invalid API key", code="invalid_key")
    return found


def require(who: str, experiment: str | None = None, admin_only: bool = False) -> None:
    if who == ADMIN:
        return
    if admin_only:
        raise Forbidden("this call needs the admin key", code="admin_only")
    if experiment is not None and who != experiment:
        raise Forbidden("this key does not grant access to that experiment", code="wrong_experiment")


# --- the native routes --------------------------------------------------------------------------------------

def caller(request: web.Request) -> str:
    """ADMIN, or the name of the experiment whose key the request carries (401 otherwise; 429 while its
    address has sent too many unknown keys)."""
    orchestrator = request.app[ORCHESTRATOR]
    limiter = request.app[AUTH_LIMITER]
    limiter.check(request.remote)
    try:
        return principal(request, request.app[ADMIN_KEY], (e.config for e in orchestrator.experiments.values()))
    except Unauthorized as exc:
        if exc.code == "invalid_key":
            limiter.failed(request.remote)
        raise


async def health(request: web.Request) -> web.Response:
    workers = request.app[ORCHESTRATOR].workers
    states = workers.states()
    ok = all(state == "ready" for state in states.values())
    lag = request.app[ORCHESTRATOR].loop_lag
    return respond(request, Health(status="ok" if ok else "degraded", workers=states,
                                   model=request.app[MODEL_NAME], replicas=workers.replica_health(),
                                   event_loop_lag_p99_s=lag.quantile(0.99), event_loop_lag_max_s=lag.recent_max()))


async def create_experiment(request: web.Request) -> web.Response:
    """A new experiment (an earlier one of its name stays archived), or with `resume` the deleted one again.
    Without an `api_key` the server makes one, returned in this answer only."""
    require(caller(request), admin_only=True)
    body = await parse_body(request, NewExperiment)
    config, generated = body.config(), None
    if config.api_key is None:
        generated = secrets.token_urlsafe(24)
        config = config.model_copy(update={"api_key": SecretStr(generated)})
    key = config.api_key.get_secret_value()
    taken = [request.app[ADMIN_KEY]] + [e.config.api_key.get_secret_value()
                                        for e in request.app[ORCHESTRATOR].experiments.values()
                                        if e.config.api_key is not None]
    # Every key is compared (constant time each), and the answer does not say whose it is.
    if sum(hmac.compare_digest(key.encode(), other.encode()) for other in taken):
        raise Conflict("this api_key is already in use: give each experiment its own key", code="api_key_in_use")
    status = await request.app[ORCHESTRATOR].create(config, start="resume" if body.resume else "fresh")
    return respond(request, CreatedExperiment(**dict(status), api_key=generated), status=201)


async def list_experiments(request: web.Request) -> web.Response:
    who = caller(request)
    orchestrator = request.app[ORCHESTRATOR]
    names = list(orchestrator.experiments) if who == ADMIN else [who]
    return respond(request, ExperimentList(experiments=[orchestrator.status(n) for n in names]))


async def get_experiment(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require(caller(request), name)
    return respond(request, request.app[ORCHESTRATOR].status(name))


async def delete_experiment(request: web.Request) -> web.Response:
    require(caller(request), admin_only=True)
    await request.app[ORCHESTRATOR].delete(request.match_info["name"])
    return web.Response(status=204)


async def completions(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require(caller(request), name)
    body = await parse_body(request, CompletionsRequest)
    return respond(request, await request.app[ORCHESTRATOR].get(name).complete(body))


async def feedback(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require(caller(request), name)
    body = await parse_body(request, FeedbackRequest)
    return respond(request, await request.app[ORCHESTRATOR].get(name).feedback(body), status=202)


async def tokenize(request: web.Request) -> web.Response:
    """Scoped as completions are: an experiment's key names its own experiment in `experiment` (another's, or
    none, is a 403); the admin key may name any (404 if it does not exist) or none."""
    who = caller(request)
    body = await parse_body(request, TokenizeRequest)
    if body.experiment is None and who != ADMIN:
        raise Forbidden("an experiment's key tokenizes for its own experiment: name it in 'experiment'",
                        code="wrong_experiment")
    if body.experiment is not None:
        require(who, body.experiment)
        request.app[ORCHESTRATOR].get(body.experiment)
    return respond(request, await request.app[ORCHESTRATOR].tokenize(body))


async def download_adapter(request: web.Request) -> web.Response:
    """The adapter version as a .tar.gz of its peft folder (adapter_config.json, adapter_model.safetensors)."""
    name = request.match_info["name"]
    require(caller(request), name)
    raw_version = request.query.get("version")
    try:
        version = None if raw_version is None else int(raw_version)
    except ValueError as exc:
        raise BadRequest(f"version must be an integer, got {raw_version!r}", code="bad_version") from exc
    if version is not None and version < 0:  # no such folder, and no version the learner could be asked for
        raise BadRequest(f"version must be 0 or more, got {version}", code="bad_version")
    async with request.app[ORCHESTRATOR].adapter_dir(name, version) as folder:
        body = await asyncio.to_thread(tar_gz, folder, f"{name}-{folder.name}")  # seconds for a large adapter
    return web.Response(body=body, content_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{name}-{folder.name}.tar.gz"'})


def tar_gz(folder: Path, top: str) -> bytes:
    """`folder`'s files as a .tar.gz whose entries sit under `top/`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(folder.iterdir()):
            archive.add(path, arcname=f"{top}/{path.name}")
    return buffer.getvalue()


async def experiment_metrics(request: web.Request) -> web.Response:
    """The experiment's newest metrics records (its metrics log's lines), for the status page and scripts."""
    name = request.match_info["name"]
    require(caller(request), name)
    orchestrator = request.app[ORCHESTRATOR]
    orchestrator.get(name)  # 404 for an unknown experiment
    kind = request.query.get("kind")
    if kind is not None and kind not in KINDS:
        raise BadRequest(f"kind must be one of {', '.join(KINDS)}, got {kind!r}", code="bad_kind")
    raw_limit = request.query.get("limit", str(METRICS_LIMIT_DEFAULT))
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= RECENT_PER_KIND:
        raise BadRequest(f"limit must be an integer from 1 to {RECENT_PER_KIND}, got {raw_limit!r}",
                         code="bad_limit")
    records = orchestrator.metrics_logs[name].records(kind, limit)
    return respond(request, MetricsHistory(name=name, records=records))


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI 3.1 document of this API, built once from the models above. Public: no key needed."""
    return web.Response(body=openapi_json(), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format; admin key only (it names every experiment)."""
    require(caller(request), admin_only=True)
    return web.Response(body=prometheus.render(request.app[METRICS_REGISTRY]),
                        headers={"Content-Type": prometheus.CONTENT_TYPE})
