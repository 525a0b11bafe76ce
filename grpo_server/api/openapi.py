"""The OpenAPI 3.1 document of the public API (`GET /openapi.json`), generated from the server's route table
(`route_table.py`: every family's `ROUTES`) and the pydantic models its handlers parse and answer with, so it
cannot drift from them. `tests/test_auth.py` and `tests/test_fuzz.py` drive their requests from the same table.
(The status page at `/` is a page for people, not an API operation: `app.page_routes()` serves it, and it holds
no data and needs no key.)
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from grpo_server.api.route_table import EVENT_STREAM, JSON, Endpoint, ErrorShape
from grpo_server.api_models import NewExperiment
from grpo_server.protocol.codec import MSGPACK

REF_TEMPLATE = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    code: str = Field(description="Machine-readable, e.g. `invalid_request`, `experiment_not_found`.")
    message: str = Field(description="Human-readable; for a 422 it names each bad field.")


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer (always JSON, whatever `Accept` says), but the OpenAI-compatible routes'."""

    error: ErrorDetail


class OpenAIErrorDetail(ErrorDetail):
    type: str = Field(description="By status: `invalid_request_error` (4xx), `authentication_error` (401), "
                                  "`permission_error` (403), `rate_limit_error` (429), `server_error` (5xx).")
    param: str | None = Field(description="The request field at fault (dotted: `tools.0`, `input.1.content.0`), "
                                          "or null.")


class OpenAIErrorBody(BaseModel):
    """A 4xx/5xx answer of the OpenAI-compatible routes: OpenAI's error object (the Open Responses spec's
    `ErrorPayload`)."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="By status, as Anthropic's: `invalid_request_error` (4xx), `authentication_error` "
                                  "(401), `permission_error` (403), `not_found_error` (404), `request_too_large` "
                                  "(413), `rate_limit_error` (429), `overloaded_error` (503), `api_error` (5xx).")
    message: str = Field(description="Human-readable; for a 422 it names each bad field.")
    code: str = Field(description="Ours, machine-readable, as on every route: e.g. `invalid_request`.")


class AnthropicErrorBody(BaseModel):
    """A 4xx/5xx answer of the Anthropic-compatible routes (`/v1/messages`): the Messages API's error shape."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# Each error shape's body (a row's `error_shape`)
ERROR_BODIES: dict[ErrorShape, type[BaseModel]] = {"plain": ErrorBody, "openai": OpenAIErrorBody,
                                                   "anthropic": AnthropicErrorBody}

_ERROR_TEXT = {
    400: "Bad request: undecodable body, bad prompt, prompt too long, bad token ids, unsupported parameter, "
         "bad query parameter",
    401: "Missing or unknown key",
    403: "This key may not make this call (another experiment's key, or not the admin key)",
    404: "No such experiment, group or adapter version (or, for `resume`, no archive to resume)",
    409: "Duplicate experiment, or feedback already given",
    408: "Tinker: the call is still running; poll again (the body is a `try_again` record)",
    410: "The adapter version was deleted (`version_pruned`): the learner keeps its newest `learner.keep_versions` "
         "and those in use; on the Tinker API, a call's result that expired",
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
    if endpoint.codec is not None:
        statuses |= {400, 413, 429}  # 429: the caller's slot of the body pool is full
    if "{name}" in endpoint.path or endpoint.auth == "experiment" or endpoint.resource is not None:
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
    for parameter in re.findall(r"{(\w+)}", endpoint.path):
        if parameter == "name":
            operation["parameters"].append({"name": "name", "in": "path", "required": True,
                                            "description": "The experiment's name", "schema": name_schema})
        else:
            operation["parameters"].append({"name": parameter, "in": "path", "required": True,
                                            "schema": {"type": "string"}})
    for parameter in endpoint.query:
        operation["parameters"].append({"name": parameter.name, "in": "query", "required": False,
                                        "description": parameter.description, "schema": parameter.schema})
    if endpoint.request is not None:
        schema = refs[endpoint.request]
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": schema},
                                                                  MSGPACK: {"schema": schema}}}
    elif endpoint.codec is not None:
        operation["requestBody"] = {"required": True, "description": endpoint.codec.describes, "content": {
            endpoint.codec.content_type: {"schema": {"type": "string", "contentMediaType": endpoint.codec.content_type}}}}
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
        content[EVENT_STREAM] = _event_stream(refs[endpoint.events], endpoint.events_text)
        success["headers"] = ID_HEADERS
    if content is not None:
        success["content"] = content
    responses: dict[str, Any] = {str(endpoint.status): success}
    error_text = {**_ERROR_TEXT, **dict(endpoint.error_text)}
    error_body = ERROR_BODIES[endpoint.error_shape]
    for status in _error_statuses(endpoint):
        responses[str(status)] = {
            "description": error_text[status],
            "content": {JSON: {"schema": {"$ref": REF_TEMPLATE.format(model=error_body.__name__)}}},
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


def _event_stream(chunk: dict[str, Any], text: str | None = None) -> dict[str, Any]:
    """The answer to `stream: true`. OpenAPI 3.1 cannot type the events themselves (3.2's `itemSchema`
    can), so `x-event-data` points at the chunk's schema. `text`: how the stream goes (the chat streams' by
    default)."""
    return {"schema": {"type": "string", "description": text or (
        "Server-sent events, as OpenAI streams: `data: <chunk JSON>` and a blank line each, `data: [DONE]` "
        "last; comments (`: ping`) keep the connection alive. The first chunk of each choice goes out as "
        "soon as sampling starts and carries `group_id` (or `episode_id`); the text follows in pieces of a "
        "token when the group is sampled. With `stream_options.include_usage`, a last chunk holds `usage` "
        "and no choices. An error after the headers is one event `data: {\"error\": {code, message, type, param}}`, "
        "with no `[DONE]` after it; errors before them are plain JSON answers with their status.")},
        "x-event-data": chunk}


@functools.cache
def openapi_document(endpoints: tuple[Endpoint, ...]) -> dict[str, Any]:
    """The document of these routes, built once. Request bodies use the models' validation schema, answers their
    serialization schema (pydantic names the two `-Input` / `-Output` where they differ)."""
    modes: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (body, "serialization") for body in ERROR_BODIES.values()]
    for endpoint in endpoints:
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
    for endpoint in endpoints:
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = _operation(endpoint, refs, name_schema)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "grpo_server",
            "version": "1",
            "description": "GRPO as a service: ask for completions, score them, post rewards; the server "
                           "trains a LoRA adapter per experiment. Bodies are JSON, or msgpack with "
                           f"`Content-Type: {MSGPACK}` (and `Accept: {MSGPACK}` for the answer). "
                           "Errors are `{\"error\": {\"code\", \"message\"}}`, with OpenAI's `type` and `param` "
                           "besides on the OpenAI-compatible routes; the Anthropic-compatible ones answer "
                           "`{\"type\": \"error\", \"error\": {\"type\", \"message\", \"code\"}}`.",
        },
        "paths": paths,
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "The admin key, or an experiment's own `api_key` (that experiment only)"}},
        },
    }


def openapi_json(endpoints: tuple[Endpoint, ...]) -> bytes:
    """The document as the bytes `GET /openapi.json` answers."""
    return json.dumps(openapi_document(endpoints), separators=(",", ":")).encode()
