"""Thin HTTP handlers: authorise, parse into a typed model, call the orchestrator, respond."""

from __future__ import annotations

import hmac
import io
import tarfile

from aiohttp import web

from grpo_server.api_models import CompletionsRequest, ExperimentList, FeedbackRequest, Health, TokenizeRequest
from grpo_server.api.http import ADMIN, principal, require
from grpo_server.config import ExperimentConfig
from grpo_server.protocol.errors import BadRequest, Conflict
from grpo_server.api.http import parse_body, respond
from grpo_server.api import prometheus
from grpo_server.api.app_keys import ADMIN_KEY, HTTP_COUNTER, MODEL_NAME, ORCHESTRATOR
from grpo_server.runtime.metrics_log import KINDS, RECENT_PER_KIND, MetricsHistory
from grpo_server.api.openapi import METRICS_LIMIT_DEFAULT, openapi_json


def _who(request: web.Request) -> str:
    orchestrator = request.app[ORCHESTRATOR]
    return principal(request, request.app[ADMIN_KEY], (e.config for e in orchestrator.experiments.values()))


async def health(request: web.Request) -> web.Response:
    workers = request.app[ORCHESTRATOR].workers
    states = workers.states()
    ok = all(state == "ready" for state in states.values())
    return respond(request, Health(status="ok" if ok else "degraded", workers=states,
                                   model=request.app[MODEL_NAME], replicas=workers.replica_health()))


async def create_experiment(request: web.Request) -> web.Response:
    require(_who(request), admin_only=True)
    config = await parse_body(request, ExperimentConfig)
    if config.api_key is not None:
        key = config.api_key.get_secret_value()
        taken = [request.app[ADMIN_KEY]] + [e.config.api_key.get_secret_value()
                                            for e in request.app[ORCHESTRATOR].experiments.values()
                                            if e.config.api_key is not None]
        # Every key is compared (constant time each), and the answer does not say whose it is.
        if sum(hmac.compare_digest(key.encode(), other.encode()) for other in taken):
            raise Conflict("this api_key is already in use: give each experiment its own key",
                           code="api_key_in_use")
    status = await request.app[ORCHESTRATOR].create(config)
    return respond(request, status, status=201)


async def list_experiments(request: web.Request) -> web.Response:
    who = _who(request)
    orchestrator = request.app[ORCHESTRATOR]
    names = list(orchestrator.experiments) if who == ADMIN else [who]
    return respond(request, ExperimentList(experiments=[orchestrator.status(n) for n in names]))


async def get_experiment(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require(_who(request), name)
    return respond(request, request.app[ORCHESTRATOR].status(name))


async def delete_experiment(request: web.Request) -> web.Response:
    require(_who(request), admin_only=True)
    await request.app[ORCHESTRATOR].delete(request.match_info["name"])
    return web.Response(status=204)


async def completions(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require(_who(request), name)
    body = await parse_body(request, CompletionsRequest)
    return respond(request, await request.app[ORCHESTRATOR].get(name).complete(body))


async def feedback(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    require(_who(request), name)
    body = await parse_body(request, FeedbackRequest)
    return respond(request, await request.app[ORCHESTRATOR].get(name).feedback(body), status=202)


async def tokenize(request: web.Request) -> web.Response:
    """Any valid key may tokenize: the template and the vocabulary are the same for every experiment."""
    _who(request)
    body = await parse_body(request, TokenizeRequest)
    return respond(request, request.app[ORCHESTRATOR].tokenize(body))


async def download_adapter(request: web.Request) -> web.Response:
    """The adapter version as a .tar.gz of its peft folder (adapter_config.json, adapter_model.safetensors)."""
    name = request.match_info["name"]
    require(_who(request), name)
    raw_version = request.query.get("version")
    try:
        version = None if raw_version is None else int(raw_version)
    except ValueError as exc:
        raise BadRequest(f"version must be an integer, got {raw_version!r}", code="bad_version") from exc
    folder = request.app[ORCHESTRATOR].adapter_dir(name, version)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(folder.iterdir()):
            archive.add(path, arcname=f"{name}-{folder.name}/{path.name}")
    return web.Response(body=buffer.getvalue(), content_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{name}-{folder.name}.tar.gz"'})


async def experiment_metrics(request: web.Request) -> web.Response:
    """The experiment's newest metrics records (its metrics log's lines), for the status page and scripts."""
    name = request.match_info["name"]
    require(_who(request), name)
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
    require(_who(request), admin_only=True)
    app = request.app
    registry = prometheus.registry(app[HTTP_COUNTER], lambda: app[ORCHESTRATOR])
    return web.Response(body=prometheus.render(registry), headers={"Content-Type": prometheus.CONTENT_TYPE})
