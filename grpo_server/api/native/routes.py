"""The native API: experiments (and an admin's pause), completions, feedback, adapters, their metrics and newest
rated groups, tokenize, health, /metrics and this server's OpenAPI document; the handlers, and `ROUTES`, the table
that serves and documents them."""

from __future__ import annotations

import hmac
import secrets
from typing import Any

from aiohttp import web
from pydantic import SecretStr

from grpo_server.api import prometheus
from grpo_server.api.app_state import ADMIN_KEY, DOWNLOADS, METRICS_REGISTRY, MODEL_NAME, OPENAPI_JSON, ORCHESTRATOR
from grpo_server.api.edge import respond
from grpo_server.api.route_table import GZIP, Endpoint, Principal, QueryParameter
from grpo_server.api_models import (CompletionsRequest, CompletionsResponse, CreatedExperiment, ExperimentList,
                                    ExperimentStatus, FeedbackRequest, FeedbackResponse, Health, NewExperiment,
                                    RatedGroups, TokenizeRequest, TokenizeResponse)
from grpo_server.protocol.errors import BadRequest, Conflict
from grpo_server.runtime.metrics_log import KINDS, RECENT_PER_KIND, MetricsHistory
from grpo_server.runtime.rated import RATED_KEPT

METRICS_LIMIT_DEFAULT = 500


async def health(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    workers = request.app[ORCHESTRATOR].workers
    states = workers.states()
    ok = all(state == "ready" for state in states.values())
    lag = request.app[ORCHESTRATOR].loop_lag
    return respond(request, Health(status="ok" if ok else "degraded", workers=states,
                                   model=request.app[MODEL_NAME], replicas=workers.replica_health(),
                                   event_loop_lag_p99_s=lag.quantile(0.99), event_loop_lag_max_s=lag.recent_max()))


async def create_experiment(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """A new experiment (an earlier one of its name stays archived), or with `resume` the deleted one again.
    Without an `api_key` the server makes one, returned in this answer only."""
    config, generated = body.config(), None
    if config.api_key is None:
        generated = secrets.token_urlsafe(24)
        config = config.model_copy(update={"api_key": SecretStr(generated)})
    key = config.api_key.get_secret_value()
    taken = [request.app[ADMIN_KEY]] + [c.api_key.get_secret_value() for c in request.app[ORCHESTRATOR].configs()
                                        if c.api_key is not None]
    # Every key is compared (constant time each), and the answer does not say whose it is.
    if sum(hmac.compare_digest(key.encode(), other.encode()) for other in taken):
        raise Conflict("this api_key is already in use: give each experiment its own key", code="api_key_in_use")
    status = await request.app[ORCHESTRATOR].create(config, start="resume" if body.resume else "fresh")
    return respond(request, CreatedExperiment(**dict(status), api_key=generated), status=201)


async def list_experiments(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    orchestrator = request.app[ORCHESTRATOR]
    names = orchestrator.names() if who.is_admin else [who.experiment]
    return respond(request, ExperimentList(experiments=orchestrator.statuses(names)))


async def get_experiment(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    return respond(request, request.app[ORCHESTRATOR].status(request.match_info["name"]))


async def delete_experiment(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    await request.app[ORCHESTRATOR].delete(request.match_info["name"])
    return web.Response(status=204)


async def pause_experiment(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """Nothing sampled and nothing trained (no group, episode turn, batch or Tinker call) until unpaused; kept across
    restarts."""
    return respond(request, await request.app[ORCHESTRATOR].set_paused(request.match_info["name"], True))


async def unpause_experiment(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    return respond(request, await request.app[ORCHESTRATOR].set_paused(request.match_info["name"], False))


async def restore_experiment(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """An experiment the server could not restore at start, created again from its saved config."""
    return respond(request, await request.app[ORCHESTRATOR].retry(request.match_info["name"]))


async def completions(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    return respond(request, await request.app[ORCHESTRATOR].get(request.match_info["name"]).complete(body))


async def feedback(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    return respond(request, await request.app[ORCHESTRATOR].get(request.match_info["name"]).feedback(body),
                   status=202)


async def tokenize(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """Scoped as completions are: an experiment's key names its own experiment in `experiment` (another's, or
    none, is a 403); the admin key may name any (404 if it does not exist) or none."""
    if body.experiment is not None:  # the route's scope checked the key against it
        request.app[ORCHESTRATOR].get(body.experiment)
    return respond(request, await request.app[ORCHESTRATOR].tokenize(body))


async def download_adapter(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """The adapter version as a .tar.gz of its peft folder (adapter_config.json, adapter_model.safetensors)."""
    name = request.match_info["name"]
    raw_version = request.query.get("version")
    try:
        version = None if raw_version is None else int(raw_version)
    except ValueError as exc:
        raise BadRequest(f"version must be an integer, got {raw_version!r}", code="bad_version") from exc
    if version is not None and version < 0:  # no such folder, and no version the learner could be asked for
        raise BadRequest(f"version must be 0 or more, got {version}", code="bad_version")
    downloads = request.app[DOWNLOADS]
    with downloads.slot(who.owner):  # on a pool of their own, a few per key (native/downloads.py)
        async with request.app[ORCHESTRATOR].adapter_dir(name, version) as folder:
            archive = await downloads.tar_gz(folder, f"{name}-{folder.name}")  # seconds for a large adapter
    return web.Response(body=archive, content_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{name}-{folder.name}.tar.gz"'})


async def experiment_metrics(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """The experiment's newest metrics records (its metrics log's lines), for the status page and scripts."""
    name = request.match_info["name"]
    orchestrator = request.app[ORCHESTRATOR]
    orchestrator.get(name)  # 404 for an unknown experiment
    kind = request.query.get("kind")
    if kind is not None and kind not in KINDS:
        raise BadRequest(f"kind must be one of {', '.join(KINDS)}, got {kind!r}", code="bad_kind")
    limit = _limit(request, METRICS_LIMIT_DEFAULT, RECENT_PER_KIND)
    records = orchestrator.get(name).metric_records(kind, limit)
    return respond(request, MetricsHistory(name=name, records=records))


async def rated_groups(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """The experiment's newest rated groups and episodes (runtime/rated.py): what the model wrote, the rewards."""
    name = request.match_info["name"]
    experiment = request.app[ORCHESTRATOR].get(name)
    limit = _limit(request, RATED_KEPT, RATED_KEPT)
    return respond(request, RatedGroups(name=name, groups=await experiment.rated_groups(limit)))


def _limit(request: web.Request, default: int, most: int) -> int:
    """The `limit` query parameter, from 1 to `most` (`default` if absent); a 400 otherwise."""
    raw_limit = request.query.get("limit", str(default))
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise BadRequest(f"limit must be an integer from 1 to {most}, got {raw_limit!r}", code="bad_limit")
    return limit


async def openapi(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """The OpenAPI 3.1 document of this server's routes (every family's), built once when the app is made
    (`openapi.py`). Public: no key needed."""
    return web.Response(body=request.app[OPENAPI_JSON], content_type="application/json")


async def metrics(request: web.Request, who: Principal | None, body: Any) -> web.Response:
    """Prometheus text format; admin key only (it names every experiment)."""
    return web.Response(body=prometheus.render(request.app[METRICS_REGISTRY]),
                        headers={"Content-Type": prometheus.CONTENT_TYPE})


EXP = "/v1/experiments/{name}"
ADAPTER_QUERY = (QueryParameter("version", "The adapter version; the one serving now if absent",
                                {"type": "integer", "minimum": 0}),)
METRICS_QUERY = (
    QueryParameter("kind", "Only records of this kind; every kind if absent", {"type": "string", "enum": list(KINDS)}),
    QueryParameter("limit", f"At most this many records, the newest (default {METRICS_LIMIT_DEFAULT})",
                   {"type": "integer", "minimum": 1, "maximum": RECENT_PER_KIND}),
)
RATED_QUERY = (QueryParameter("limit", f"At most this many groups, the newest (default and most {RATED_KEPT})",
                              {"type": "integer", "minimum": 1, "maximum": RATED_KEPT}),)
COMPLETIONS_503 = ("A worker is down or restarting, or an admin paused the experiment (`experiment_paused`); retry "
                   "after `Retry-After` seconds")
PAUSE_503 = ("The pause could not be recorded (`registry_write_failed`: a full disk; nothing changed), or the "
             "experiment could not be restored at start; retry after `Retry-After` seconds")
# Feedback writes the journal before it answers 202 (runtime/journal.py): a failed write is a 503 too, and a
# client must know that retrying it cannot count a reward twice.
FEEDBACK_503 = ("A worker is down or restarting (a sampler scores external completions), or the feedback journal "
                "could not be written (`journal_write_failed`: disk full, I/O error; nothing was accepted and the "
                "group stays rateable, so the retry is safe); retry after `Retry-After` seconds")

ROUTES: tuple[Endpoint, ...] = (
    Endpoint("GET", "/openapi.json", openapi, None, None, 200, "This document (OpenAPI 3.1)", "public"),
    Endpoint("GET", "/v1/health", health, None, Health, 200, "The workers' states", "public"),
    Endpoint("GET", "/metrics", metrics, None, None, 200, "Prometheus metrics (text format 0.0.4)", "admin",
             content_type="text/plain"),
    Endpoint("POST", "/v1/tokenize", tokenize, TokenizeRequest, TokenizeResponse, 200,
             "A prompt or messages to the token ids completions would use", "experiment",
             scope=lambda body: body.experiment),
    Endpoint("POST", "/v1/experiments", create_experiment, NewExperiment, CreatedExperiment, 201,
             "Create an experiment (or, with `resume`, bring back a deleted one)", "admin", (404, 409, 502, 503)),
    Endpoint("GET", "/v1/experiments", list_experiments, None, ExperimentList, 200,
             "Experiments' status (an experiment key sees its own only)", "key"),
    Endpoint("GET", EXP, get_experiment, None, ExperimentStatus, 200, "One experiment's status", "experiment"),
    Endpoint("DELETE", EXP, delete_experiment, None, None, 204,
             "Stop serving and training an experiment (its files are archived: a new one of its name starts "
             "afresh)", "admin", (502, 503)),
    Endpoint("POST", EXP + "/pause", pause_experiment, None, ExperimentStatus, 200,
             "Pause an experiment: no new group or episode turn is sampled (503 `experiment_paused`) and no batch "
             "is trained until it is unpaused; feedback for groups sampled before is still taken. Kept across "
             "restarts", "admin", (503,), error_text=((503, PAUSE_503),)),
    Endpoint("POST", EXP + "/unpause", unpause_experiment, None, ExperimentStatus, 200,
             "Unpause an experiment: it samples and trains again", "admin", (503,), error_text=((503, PAUSE_503),)),
    Endpoint("POST", EXP + "/restore", restore_experiment, None, ExperimentStatus, 200,
             "Restore an experiment the server could not restore at start (state 'failed'), from its saved config",
             "admin", (404, 409, 502, 503)),
    Endpoint("POST", EXP + "/completions", completions, CompletionsRequest, CompletionsResponse, 200,
             "Sample one group of completions", "experiment", (429, 502, 503), error_text=((503, COMPLETIONS_503),)),
    Endpoint("POST", EXP + "/feedback", feedback, FeedbackRequest, FeedbackResponse, 202,
             "Rewards for a group (or for external completions)", "experiment", (409, 502, 503),
             error_text=((503, FEEDBACK_503),)),
    Endpoint("GET", EXP + "/adapter", download_adapter, None, None, 200,
             "An adapter version as a .tar.gz of its peft folder", "experiment", (400, 410, 429), GZIP, ADAPTER_QUERY),
    Endpoint("GET", EXP + "/metrics", experiment_metrics, None, MetricsHistory, 200,
             "The experiment's newest metrics records (train steps, pushes, sampling throughput)", "experiment",
             (400,), query=METRICS_QUERY),
    Endpoint("GET", EXP + "/rated", rated_groups, None, RatedGroups, 200,
             "The experiment's newest rated groups and episodes: what the model wrote (clipped), the rewards and "
             f"advantages; in memory only, the newest {RATED_KEPT}", "experiment", (400,), query=RATED_QUERY),
)
