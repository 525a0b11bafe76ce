"""The OpenAPI 3.1 document of the public API (`GET /openapi.json`), generated from the pydantic models the
handlers parse and answer with, so it cannot drift from them.

`ENDPOINTS` is the one table of the public routes: method, path, request and response model, success
status, summary, who may call it. `tests/test_auth.py` and `tests/test_fuzz.py` check that it covers every
route of `app.routes()` and drive their requests from it, so a new route without a row here fails the tests.
(The status page at `/` is a page for people, not an API operation: `app.page_routes()` serves it, and it
holds no data and needs no key.)

Who may call (`auth`):
- `public`: no key needed (an `Authorization` header is ignored);
- `key`: any valid key, the admin's or any experiment's;
- `experiment`: the admin key, or the experiment's own key; the experiment is the `{name}` in the path,
  the body's `model` field on the OpenAI-compatible routes, or its `experiment` field on tokenize (which the
  admin key may leave out). Another experiment's key is a 403, whether or not the experiment exists (names
  do not leak);
- `admin`: the admin key only (an experiment's key is a 403).
A missing or unknown key is a 401 wherever a key is needed, and too many unknown keys from one address make
every call that needs a key a 429 for a while (`auth_limit.py`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from grpo_server.api.openai_models import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, Model,
                                           ModelList, TextCompletionResponse)
from grpo_server.api.streaming import ChatCompletionChunk, TextCompletionChunk
from grpo_server.api_models import (CompletionsRequest, CompletionsResponse, CreatedExperiment, ExperimentList,
                                    ExperimentStatus, FeedbackRequest, FeedbackResponse, Health, NewExperiment,
                                    TokenizeRequest, TokenizeResponse)
from grpo_server.protocol.codec import MSGPACK
from grpo_server.runtime.metrics_log import KINDS, RECENT_PER_KIND, MetricsHistory

REF_TEMPLATE = "#/components/schemas/{model}"
Auth = Literal["public", "key", "experiment", "admin"]
JSON = "application/json"
EVENT_STREAM = "text/event-stream"
GZIP = "application/gzip"


class ErrorDetail(BaseModel):
    code: str = Field(description="Machine-readable, e.g. `invalid_request`, `experiment_not_found`.")
    message: str = Field(description="Human-readable; for a 422 it names each bad field.")


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer (always JSON, whatever `Accept` says)."""

    error: ErrorDetail


@dataclass(frozen=True)
class QueryParameter:
    name: str
    description: str
    schema: dict[str, Any] = field(hash=False)  # (a dict: keeps Endpoint hashable)


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    request: type[BaseModel] | None  # the JSON/msgpack body, if any
    response: type[BaseModel] | None  # None: no JSON body (204, a file, or this document)
    status: int
    summary: str
    auth: Auth
    errors: tuple[int, ...] = ()  # statuses besides the auth ones and those a body or `{name}` brings
    content_type: str = JSON  # of the success answer
    query: tuple[QueryParameter, ...] = ()  # all optional; a bad value is a 400 (declare it in `errors`)
    events: type[BaseModel] | None = None  # with `stream: true`: server-sent events of these chunks
    # (status, description) where this route's cause of an error status is not the one _ERROR_TEXT gives all
    error_text: tuple[tuple[int, str], ...] = ()

    @property
    def operation_id(self) -> str:
        words = [w for w in self.path.replace("{", "").replace("}", "").replace(".", "_").split("/") if w]
        return "_".join([self.method.lower()] + [w for w in words if w != "v1"])


EXP = "/v1/experiments/{name}"
METRICS_LIMIT_DEFAULT = 500

ADAPTER_QUERY = (QueryParameter("version", "The adapter version; the one serving now if absent",
                                {"type": "integer", "minimum": 0}),)
METRICS_QUERY = (
    QueryParameter("kind", "Only records of this kind; every kind if absent", {"type": "string", "enum": list(KINDS)}),
    QueryParameter("limit", f"At most this many records, the newest (default {METRICS_LIMIT_DEFAULT})",
                   {"type": "integer", "minimum": 1, "maximum": RECENT_PER_KIND}),
)

# Feedback writes the journal before it answers 202 (runtime/journal.py): a failed write is a 503 too, and a
# client must know that retrying it cannot count a reward twice.
FEEDBACK_503 = ("A worker is down or restarting (a sampler scores external completions), or the feedback journal "
                "could not be written (`journal_write_failed`: disk full, I/O error; nothing was accepted and the "
                "group stays rateable, so the retry is safe); retry after `Retry-After` seconds")

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("GET", "/openapi.json", None, None, 200, "This document (OpenAPI 3.1)", "public"),
    Endpoint("GET", "/v1/health", None, Health, 200, "The workers' states", "public"),
    Endpoint("GET", "/metrics", None, None, 200, "Prometheus metrics (text format 0.0.4)", "admin",
             content_type="text/plain"),
    Endpoint("POST", "/v1/tokenize", TokenizeRequest, TokenizeResponse, 200,
             "A prompt or messages to the token ids completions would use", "experiment"),
    Endpoint("POST", "/v1/experiments", NewExperiment, CreatedExperiment, 201,
             "Create an experiment (or, with `resume`, bring back a deleted one)", "admin", (404, 409, 502, 503)),
    Endpoint("GET", "/v1/experiments", None, ExperimentList, 200,
             "Experiments' status (an experiment key sees its own only)", "key"),
    Endpoint("GET", EXP, None, ExperimentStatus, 200, "One experiment's status", "experiment"),
    Endpoint("DELETE", EXP, None, None, 204,
             "Stop serving and training an experiment (its files are archived: a new one of its name starts "
             "afresh)", "admin", (502, 503)),
    Endpoint("POST", EXP + "/completions", CompletionsRequest, CompletionsResponse, 200,
             "Sample one group of completions", "experiment", (429, 502, 503)),
    Endpoint("POST", EXP + "/feedback", FeedbackRequest, FeedbackResponse, 202,
             "Rewards for a group (or for external completions)", "experiment", (409, 502, 503),
             error_text=((503, FEEDBACK_503),)),
    Endpoint("GET", EXP + "/adapter", None, None, 200,
             "An adapter version as a .tar.gz of its peft folder", "experiment", (400, 410), GZIP, ADAPTER_QUERY),
    Endpoint("GET", EXP + "/metrics", None, MetricsHistory, 200,
             "The experiment's newest metrics records (train steps, pushes, sampling throughput)", "experiment",
             (400,), query=METRICS_QUERY),
    Endpoint("POST", "/v1/chat/completions", ChatCompletionRequest, ChatCompletionResponse, 200,
             "OpenAI-compatible chat completions (`model` is the experiment)", "experiment", (429, 502, 503),
             events=ChatCompletionChunk),
    Endpoint("POST", "/v1/completions", CompletionRequest, TextCompletionResponse, 200,
             "OpenAI-compatible (legacy) completions (`model` is the experiment)", "experiment", (429, 502, 503),
             events=TextCompletionChunk),
    Endpoint("GET", "/v1/models", None, ModelList, 200,
             "OpenAI-compatible: the experiments this key may sample, as models", "key"),
    Endpoint("GET", "/v1/models/{name}", None, Model, 200, "OpenAI-compatible: one experiment as a model",
             "experiment"),
)

_ERROR_TEXT = {
    400: "Bad request: undecodable body, bad prompt, prompt too long, bad token ids, unsupported parameter, "
         "bad query parameter",
    401: "Missing or unknown key",
    403: "This key may not make this call (another experiment's key, or not the admin key)",
    404: "No such experiment, group or adapter version (or, for `resume`, no archive to resume)",
    409: "Duplicate experiment, or feedback already given",
    410: "The adapter version was deleted (`version_pruned`): the learner keeps its newest `learner.keep_versions` "
         "and those in use",
    413: "Request body too large",
    422: "Schema error (the message names each bad field), or over a server limit (`over_limit`)",
    429: "Back-pressure (the learner is behind, too many groups await feedback, or the tokens held would pass a "
         "token budget: `token_budget`), or too many unknown keys from this address; retry after `Retry-After` "
         "seconds",
    502: "A worker failed",
    503: "A worker is down or restarting; retry after `Retry-After` seconds",
}


def _error_statuses(endpoint: Endpoint) -> list[int]:
    statuses = set(endpoint.errors)
    if endpoint.auth != "public":
        statuses |= {401, 429}
    if endpoint.auth in ("experiment", "admin"):
        statuses.add(403)
    if endpoint.request is not None:
        statuses |= {400, 413, 422}
    if "{name}" in endpoint.path or endpoint.auth == "experiment":
        statuses.add(404)
    return sorted(statuses)


def _operation(endpoint: Endpoint, refs: dict[type[BaseModel], dict], name_schema: dict) -> dict[str, Any]:
    retry_after = {"Retry-After": {"description": "Seconds to wait before retrying",
                                   "schema": {"type": "integer"}}}
    operation: dict[str, Any] = {
        "operationId": endpoint.operation_id,
        "summary": endpoint.summary,
        "x-auth": endpoint.auth,
        "security": [] if endpoint.auth == "public" else [{"bearer": []}],
        "parameters": [],
    }
    if "{name}" in endpoint.path:
        operation["parameters"].append({"name": "name", "in": "path", "required": True,
                                        "description": "The experiment's name", "schema": name_schema})
    for parameter in endpoint.query:
        operation["parameters"].append({"name": parameter.name, "in": "query", "required": False,
                                        "description": parameter.description, "schema": parameter.schema})
    if endpoint.request is not None:
        schema = refs[endpoint.request]
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": schema},
                                                                  MSGPACK: {"schema": schema}}}
    if endpoint.response is not None:
        schema = refs[endpoint.response]
        content = {JSON: {"schema": schema}, MSGPACK: {"schema": schema}}
    elif endpoint.content_type != JSON:  # the adapter archive, the metrics text
        content = {endpoint.content_type: {"schema": {"type": "string", "contentMediaType": endpoint.content_type}}}
    elif endpoint.status == 204:
        content = None
    else:
        content = {JSON: {"schema": {"type": "object"}}}
    success: dict[str, Any] = {"description": endpoint.summary}
    if endpoint.events is not None:
        content[EVENT_STREAM] = _event_stream(refs[endpoint.events])
        success["headers"] = ID_HEADERS
    if content is not None:
        success["content"] = content
    responses: dict[str, Any] = {str(endpoint.status): success}
    error_text = {**_ERROR_TEXT, **dict(endpoint.error_text)}
    for status in _error_statuses(endpoint):
        responses[str(status)] = {
            "description": error_text[status],
            "content": {JSON: {"schema": {"$ref": REF_TEMPLATE.format(model="ErrorBody")}}},
            **({"headers": retry_after} if status in (429, 503) else {}),
        }
    operation["responses"] = responses
    if not operation["parameters"]:
        del operation["parameters"]
    return operation


ID_HEADERS = {
    "X-Group-Id": {"description": "The group's id, for its feedback (a plain call or a stream; also in the body)",
                   "schema": {"type": "string"}},
    "X-Episode-Id": {"description": "Instead of X-Group-Id for an episode's turn: the episode's id",
                     "schema": {"type": "string"}},
}


def _event_stream(chunk: dict[str, Any]) -> dict[str, Any]:
    """The answer to `stream: true`. OpenAPI 3.1 cannot type the events themselves (3.2's `itemSchema`
    can), so `x-event-data` points at the chunk's schema."""
    return {"schema": {"type": "string", "description": (
        "Server-sent events, as OpenAI streams: `data: <chunk JSON>` and a blank line each, `data: [DONE]` "
        "last; comments (`: ping`) keep the connection alive. The first chunk of each choice goes out as "
        "soon as sampling starts and carries `group_id` (or `episode_id`); the text follows in pieces of a "
        "token when the group is sampled. With `stream_options.include_usage`, a last chunk holds `usage` "
        "and no choices. An error after the headers is one event `data: {\"error\": {code, message}}`, "
        "with no `[DONE]` after it; errors before them are plain JSON answers with their status.")},
        "x-event-data": chunk}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document, built once. Request bodies use the models' validation schema, answers their
    serialization schema (pydantic names the two `-Input` / `-Output` where they differ)."""
    modes: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [(ErrorBody, "serialization")]
    for endpoint in ENDPOINTS:
        if endpoint.request is not None:
            modes.append((endpoint.request, "validation"))
        if endpoint.response is not None:
            modes.append((endpoint.response, "serialization"))
        if endpoint.events is not None:
            modes.append((endpoint.events, "serialization"))
    modes = list(dict.fromkeys(modes))
    keyed, top = models_json_schema(modes, ref_template=REF_TEMPLATE)
    refs = {model: keyed[(model, mode)] for model, mode in modes}
    name_schema = NewExperiment.model_json_schema()["properties"]["name"]
    name_schema = {k: v for k, v in name_schema.items() if k in ("type", "pattern", "description")}
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in ENDPOINTS:
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = _operation(endpoint, refs, name_schema)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "grpo_server",
            "version": "1",
            "description": "GRPO as a service: ask for completions, score them, post rewards; the server "
                           "trains a LoRA adapter per experiment. Bodies are JSON, or msgpack with "
                           f"`Content-Type: {MSGPACK}` (and `Accept: {MSGPACK}` for the answer). "
                           "Errors are `{\"error\": {\"code\", \"message\"}}`.",
        },
        "paths": paths,
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "The admin key, or an experiment's own `api_key` (that experiment only)"}},
        },
    }


@functools.cache
def openapi_json() -> bytes:
    """The document as the bytes `GET /openapi.json` answers."""
    return json.dumps(openapi_document(), separators=(",", ":")).encode()
