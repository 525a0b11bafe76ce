"""The schemathesis set-up that tests/test_fuzz.py fuzzes with, and the helpers its tests share:

- the knobs schemathesis runs under (request timeout, CHEAP, cases per operation, steps per scenario) and its
  configuration: CONFIG, which of its checks are on and, for those that are off, why;
- the document it works from: the server's own (`grpo_server/api/openapi.py`) plus LINKS between operations,
  for the stateful phase; `schema`, made from it, and msgpack as a body format it can send and read;
- our checks beside schemathesis's: strict JSON (no NaN/Infinity), Prometheus text from /metrics, Retry-After
  on a 503 (`strict_answers`), and the same by hand for test_raw's answers (`check_raw`);
- plain calls beside the fuzzing (`Http`, `delete_quietly`), and `protect` (other tests' experiments and the
  fuzz target are left alone).

The record of what was sent (cases and statuses per operation and per kind of call, the summary) is
tests/fuzz_report.py's; the edits that make a generated request cheap and get further (`cheapen`, `shape`,
`Episodes`) are tests/fuzz_shape.py's.

The counts are knobs: GRPO_FUZZ_EXAMPLES (fuzzing-phase cases per operation in test_api, default 12), and
test_fuzz.py's GRPO_FUZZ_SCENARIOS and GRPO_FUZZ_RAW_EXAMPLES; the defaults are what CI runs.

What schemathesis cannot send at all (junk bodies, odd names and keys) is tests/fuzz_strategies.py's.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Any, Iterable

import msgpack
import requests
import schemathesis
from jsonschema import Draft202012Validator
from schemathesis.core.failures import Failure

from grpo_server.api.app import ENDPOINTS
from grpo_server.api.openapi import openapi_document
from tests.fuzz_strategies import FUZZ_EXP, MSGPACK
from tests.serving import ADMIN_KEY


def knob(name: str, default: int) -> int:
    """A count from the environment (GRPO_FUZZ_*), so a long run needs no edit; the default is CI's."""
    value = int(os.environ.get(name) or default)
    assert value > 0, f"{name} must be positive: {value}"
    return value


TIMEOUT_S = 120
CHEAP = 4  # most completions (n) and tokens (max_tokens) a fuzzed request may sample
# Fuzzing-phase cases per operation in test_api (the examples and coverage phases add theirs; an operation
# with few possible requests, such as one without parameters, stops when hypothesis has tried them all).
EXAMPLES = knob("GRPO_FUZZ_EXAMPLES", 12)
STEPS = 8  # test_stateful: calls in each scenario at most
MAX_STREAM_EVENTS = 100_000  # more than any fuzzed stream has (at most 8 x 256 tokens, an experiment's defaults)
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
EPISODE_PREFIX = "fuzz-"  # of the episode ids `shape` gives

BEFORE: list[str] = []  # experiments that existed before the fuzzing


# ------------------------------------------------------------------------------------------------
# The document schemathesis works from: the server's, plus links between operations
# ------------------------------------------------------------------------------------------------

NAME_FROM_BODY = {"name": "$response.body#/name"}
NAME_FROM_PATH = {"name": "$request.path.name"}
LINKS: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {  # (path, method, status) -> links
    ("/v1/experiments", "post", "201"): {
        "Status": {"operationId": "get_experiments_name", "parameters": NAME_FROM_BODY},
        "Complete": {"operationId": "post_experiments_name_completions", "parameters": NAME_FROM_BODY},
        "RateExternal": {"operationId": "post_experiments_name_feedback", "parameters": NAME_FROM_BODY},
        "Adapter": {"operationId": "get_experiments_name_adapter", "parameters": NAME_FROM_BODY},
        "Metrics": {"operationId": "get_experiments_name_metrics", "parameters": NAME_FROM_BODY},
        "Pause": {"operationId": "post_experiments_name_pause", "parameters": NAME_FROM_BODY},
        "ChatComplete": {"operationId": "post_chat_completions", "requestBody": {"model": "$response.body#/name"}},
        "TextComplete": {"operationId": "post_completions", "requestBody": {"model": "$response.body#/name"}},
        "Delete": {"operationId": "delete_experiments_name", "parameters": NAME_FROM_BODY},
    },
    ("/v1/experiments/{name}/completions", "post", "200"): {
        "Rate": {"operationId": "post_experiments_name_feedback", "parameters": NAME_FROM_PATH,
                 "requestBody": {"group_id": "$response.body#/group_id"}},
        "Adapter": {"operationId": "get_experiments_name_adapter",
                    "parameters": {**NAME_FROM_PATH, "version": "$response.body#/policy_version"}},
        "Delete": {"operationId": "delete_experiments_name", "parameters": NAME_FROM_PATH},
    },
    ("/v1/chat/completions", "post", "200"): {
        "Rate": {"operationId": "post_experiments_name_feedback", "parameters": {"name": "$request.body#/model"},
                 "requestBody": {"group_id": "$response.body#/group_id"}},
    },
    ("/v1/completions", "post", "200"): {
        "Rate": {"operationId": "post_experiments_name_feedback", "parameters": {"name": "$request.body#/model"},
                 "requestBody": {"group_id": "$response.body#/group_id"}},
    },
    ("/v1/experiments/{name}/feedback", "post", "202"): {
        "Status": {"operationId": "get_experiments_name", "parameters": NAME_FROM_PATH},
        "RateAgain": {"operationId": "post_experiments_name_feedback", "parameters": NAME_FROM_PATH,
                      "requestBody": "$request.body"},  # a repeat: 409
        "Complete": {"operationId": "post_experiments_name_completions", "parameters": NAME_FROM_PATH},
        "Rated": {"operationId": "get_experiments_name_rated", "parameters": NAME_FROM_PATH},
    },
    ("/v1/experiments/{name}/pause", "post", "200"): {  # paused: a 503 experiment_paused until the unpause
        "Complete": {"operationId": "post_experiments_name_completions", "parameters": NAME_FROM_PATH},
        "Unpause": {"operationId": "post_experiments_name_unpause", "parameters": NAME_FROM_PATH},
    },
    ("/v1/experiments/{name}", "get", "200"): {
        "Delete": {"operationId": "delete_experiments_name", "parameters": NAME_FROM_BODY},
    },
    ("/v1/experiments/{name}", "delete", "204"): {  # gone: 404 everywhere
        "Status": {"operationId": "get_experiments_name", "parameters": NAME_FROM_PATH},
        "Complete": {"operationId": "post_experiments_name_completions", "parameters": NAME_FROM_PATH},
        "Recreate": {"operationId": "post_experiments", "requestBody": {"name": "$request.path.name"}},
    },
}


DOCUMENT = openapi_document(ENDPOINTS)  # the server's (the `http` fixture checks that it serves this one)

# One server-sent event as schemathesis reads a stream (OpenAPI 3.2's `itemSchema`, and `schema` for an older
# document): an object with the event's `data` (and `event`, `id`, `retry`). The server's document gives the
# stream's media type `schema: {"type": "string"}` (the body, as OpenAPI 3.1 has it) and each event's JSON in
# `x-event-data`, which schemathesis does not know; so schemathesis read every event as a non-string, a
# failure of each stream (ST108). The test's copy says what an event is, and `check_stream` checks each
# event's JSON against `x-event-data`.
STREAM_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def linked_document() -> dict[str, Any]:
    """The test's copy of the document: the server's, plus LINKS, and STREAM_EVENT for each stream."""
    doc = copy.deepcopy(DOCUMENT)
    for (path, method, status), links in LINKS.items():
        doc["paths"][path][method]["responses"][status]["links"] = links
    for operations in doc["paths"].values():
        for operation in operations.values():
            for response in operation["responses"].values():
                if "text/event-stream" in response.get("content", {}):
                    response["content"]["text/event-stream"]["schema"] = STREAM_EVENT
    return doc


CONFIG = schemathesis.Config.from_dict({
    "headers": ADMIN,  # the admin key, so that bodies are looked at; test_api and test_raw try others
    "request-timeout": TIMEOUT_S,
    # schemathesis stops reading a stream after 20 events by default (and the server drops a group whose client
    # left): read each to its end, so that every chunk, the end ([DONE]) and any error event are checked.
    "max-stream-events": MAX_STREAM_EVENTS,
    "generation": {"deterministic": True, "database": "none", "max-examples": EXAMPLES},
    "phases": {"stateful": {"max-steps": STEPS}},
    "checks": {
        # A 503 is the server's documented answer while a worker restarts (with Retry-After: `strict_answers`
        # below). Not expected here, but not a bug; every other 5xx is.
        "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "503"]},
        # A body the schema accepts can still be a 400 or 422 here: exactly one of prompt / messages /
        # prompt_token_ids, a prompt too long for the model, token ids outside the vocabulary, feedback
        # for a group of another size, the server's limits (`over_limit`): rules no JSON schema states.
        "positive_data_acceptance": {"enabled": False},
        # And the other way round: pydantic's lax mode takes 5.0, "5" or true where the schema says integer
        # (and the like), so a body the schema forbids can be a 200. Harmless, and not a promise to keep.
        "negative_data_rejection": {"enabled": False},
        "missing_required_header": {"enabled": False},  # no operation has a header parameter
        # Its 404 also means "no such group" (feedback) or "no such version" (adapter) here, for an experiment
        # that exists: test_stateful checks the experiment itself instead (`GET /v1/experiments/{name}`).
        "ensure_resource_availability": {"enabled": False},
    },
})
schema = schemathesis.openapi.from_dict(linked_document(), config=CONFIG)


@schemathesis.serializer(MSGPACK)
def _msgpack(ctx, value) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):  # an integer beyond 64 bits: sent without a body (a 4xx)
        return None


@schemathesis.serializer("application/x-protobuf")
def _protobuf(ctx, value) -> bytes | None:
    """The Tinker forward_backward body (a protobuf message: a string of bytes to the schema): the generated value
    as bytes. Real messages, valid and broken, are fuzzed by tests/test_fuzz_tinker.py."""
    if isinstance(value, bytes):
        return value
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else None


@schemathesis.deserializer(MSGPACK)
def _unmsgpack(ctx, response):
    return msgpack.unpackb(response.content, raw=False)


# ------------------------------------------------------------------------------------------------
# Our checks, beside schemathesis's
# ------------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def strict_json(raw: bytes) -> Any:
    """JSON as RFC 8259 has it: NaN and Infinity are not numbers a client can parse."""
    return json.loads(raw, parse_constant=_reject_constant)


class NotStrict(Failure):
    code, checks, kind_title = "GRPO1", ("strict_answers",), "Answer not as this API promises"


def stream_events(raw: bytes) -> list[str]:
    """The `data:` values of a server-sent event stream, in order (comments such as `: ping` left out)."""
    return [line[5:].removeprefix(" ") for line in raw.decode().splitlines() if line.startswith("data:")]


@functools.cache
def _chunk_validator(ref: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": ref, "components": DOCUMENT["components"]})


def stream_chunk_ref(path: str, method: str, status: int) -> str | None:
    """The schema (`x-event-data`) of each event of a stream this operation answers with this status."""
    response = DOCUMENT["paths"].get(path, {}).get(method.lower(), {}).get("responses", {}).get(str(status), {})
    return response.get("content", {}).get("text/event-stream", {}).get("x-event-data", {}).get("$ref")


def check_stream(raw: bytes, chunk_ref: str | None, cut_short: bool = False) -> list[dict[str, Any]]:
    """A `stream: true` answer (a 200 once its headers went out): chunks, each strict JSON and as the
    document's `x-event-data` says, then `[DONE]` (unless the client stopped reading: `cut_short`). An error
    event instead (a worker failed, or the server's own 500, after the headers) is the 5xx a stream hides in
    a 200, so it fails here. Its chunks."""
    assert chunk_ref is not None, "a stream where the document declares none"
    events = stream_events(raw)
    assert events, f"an empty stream: {raw[:300]!r}"
    if chunk_ref.endswith("/ResponseStreamEvent"):  # POST /v1/responses: no [DONE], a terminal event instead
        chunks = [strict_json(event) for event in events]
        errors = [c for c in chunks if isinstance(c, dict) and c.get("type") in ("error", "response.failed")]
        assert not errors, f"an error after the headers (a 5xx inside a 200 stream): {errors}"
        assert cut_short or chunks[-1].get("type") in ("response.completed", "response.incomplete"), \
            f"a Responses stream that does not end with its terminal event: {events[-1][:300]!r}"
        numbers = [c.get("sequence_number") for c in chunks]
        assert numbers == list(range(len(chunks))), f"sequence numbers out of order: {numbers[:50]}"
        for chunk in chunks:
            _chunk_validator(chunk_ref).validate(chunk)
        return chunks
    if chunk_ref.endswith("/MessageStreamEvent"):  # POST /v1/messages: no [DONE], message_stop instead
        chunks = [strict_json(event) for event in events]
        errors = [c for c in chunks if isinstance(c, dict) and c.get("type") == "error"]
        assert not errors, f"an error after the headers (a 5xx inside a 200 stream): {errors}"
        assert cut_short or chunks[-1].get("type") == "message_stop", \
            f"a Messages stream that does not end with message_stop: {events[-1][:300]!r}"
        for chunk in chunks:
            _chunk_validator(chunk_ref).validate(chunk)
        return chunks
    chunks = [strict_json(event) for event in events[:-1]]
    errors = [chunk["error"] for chunk in chunks + ([strict_json(events[-1])] if events[-1] != "[DONE]" else [])
              if isinstance(chunk, dict) and "error" in chunk]
    assert not errors, f"an error after the headers (a 5xx inside a 200 stream): {errors}"
    if cut_short and events[-1] != "[DONE]":
        chunks.append(strict_json(events[-1]))
    else:
        assert events[-1] == "[DONE]", f"a stream that does not end with [DONE]: {events[-1][:300]!r}"
    for chunk in chunks:
        _chunk_validator(chunk_ref).validate(chunk)
    return chunks


@schemathesis.check
def strict_answers(ctx, response, case) -> bool | None:
    """Ours, beside schemathesis's: JSON without NaN/Infinity; a stream is strict JSON chunks ending in
    [DONE], with no error event; /metrics parses as Prometheus text; a 503 carries Retry-After."""
    content_type = _content_type(response)
    try:
        if content_type == "application/json":
            strict_json(response.content)
        elif content_type == "text/event-stream":
            check_stream(response.content, stream_chunk_ref(case.path, case.method, response.status_code),
                         response.stream_cut_short)
        elif content_type == "text/plain" and response.status_code == 200:
            from prometheus_client.parser import text_string_to_metric_families

            assert list(text_string_to_metric_families(response.content.decode()))
        assert response.status_code != 503 or "retry-after" in response.headers, "a 503 without Retry-After"
    except Exception as exc:  # noqa: BLE001 (any parse error is the failure)
        raise NotStrict(operation=case.operation.label, title="Answer not strict", message=str(exc)) from None
    return None


def _content_type(response) -> str:
    """A schemathesis Response's media type (its headers: lower-case names, lists of values)."""
    return (response.headers.get("content-type") or [""])[0].split(";")[0].strip()


def check_raw(answer: requests.Response, operation: dict[str, Any]) -> None:
    status = answer.status_code
    assert status < 500 or (status == 503 and "Retry-After" in answer.headers), (status, answer.content[:500])
    assert str(status) in operation["responses"], (
        f"{status} is not among the statuses the document declares for {operation['operationId']}: "
        f"{answer.content[:300]!r}")
    content_type = answer.headers.get("Content-Type", "").split(";")[0]
    if status >= 400:
        assert content_type == "application/json", content_type
        body = strict_json(answer.content)
        shape = operation["responses"][str(status)]["content"]["application/json"]["schema"]["$ref"]
        if shape.endswith("/AnthropicErrorBody"):  # the Messages routes: Anthropic's shape, with our `code`
            assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
            assert set(body["error"]) == {"type", "message", "code"}, body
        else:
            assert isinstance(body, dict) and set(body) == {"error"}, body
        openai = shape.endswith("/OpenAIErrorBody")  # the OpenAI-compatible routes: OpenAI's `type` and `param` too
        assert shape.endswith("/AnthropicErrorBody") or set(body["error"]) == (
            {"code", "message", "type", "param"} if openai else {"code", "message"}), body
        assert all(isinstance(v, str) and v for k, v in body["error"].items() if k != "param"), body
        assert isinstance(body["error"].get("param"), (str, type(None))), body
    elif content_type == "application/json":
        strict_json(answer.content)
    elif content_type == "text/event-stream":
        response = operation["responses"][str(status)]["content"]["text/event-stream"]
        check_stream(answer.content, response.get("x-event-data", {}).get("$ref"))


# ------------------------------------------------------------------------------------------------
# Plain calls beside the fuzzing, and the record of what was sent
# ------------------------------------------------------------------------------------------------


class Http:
    """Plain calls beside the fuzzing (set-up, clean-up, raw cases)."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.session = requests.Session()

    def request(self, method: str, path_and_query: str, headers: dict[str, str] | None = None,
                data: bytes | None = None) -> requests.Response:
        return self.session.request(method, self.base_url + path_and_query, headers=headers or {}, data=data,
                                    timeout=TIMEOUT_S)

    def json(self, method: str, path: str, body: Any = None, key: str = ADMIN_KEY) -> tuple[int, Any]:
        answer = self.request(method, path, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                              None if body is None else json.dumps(body).encode())
        return answer.status_code, (strict_json(answer.content) if answer.content else None)


def _body(response) -> Any:
    return msgpack.unpackb(response.content) if _content_type(response) == MSGPACK else json.loads(response.content)


def _header(response, name: str) -> str | None:
    """A response header of schemathesis's Response (lower-case names, lists of values) or of requests'."""
    value = response.headers.get(name.lower())
    return value[0] if isinstance(value, list) else value


def sampled(case: schemathesis.Case, response) -> tuple[str | None, str | None, int]:
    """What a 200 from a completions route sampled: (group id, episode id, completions), from the JSON or
    msgpack answer or from a stream (its headers, and the choices its chunks name)."""
    if _content_type(response) == "text/event-stream":
        chunks = check_stream(response.content, stream_chunk_ref(case.path, case.method, response.status_code),
                              response.stream_cut_short)
        if response.stream_cut_short:  # the client left: the server dropped the group (or undid the turn)
            return None, None, 0
        size = len({choice["index"] for chunk in chunks for choice in chunk["choices"]})
        return _header(response, "X-Group-Id"), _header(response, "X-Episode-Id"), size
    data = _body(response)
    return (data.get("group_id") or _header(response, "X-Group-Id"),
            data.get("episode_id") or _header(response, "X-Episode-Id"),
            len(data.get("completions") or data.get("choices")))


def created_name(case: schemathesis.Case, response) -> str | None:
    if case.path != "/v1/experiments" or case.method.upper() != "POST" or response.status_code != 201:
        return None
    return _body(response)["name"]


def delete_quietly(http: Http, name: str) -> None:
    status, body = http.json("DELETE", f"/v1/experiments/{name}")
    assert status in (204, 404), (status, body)


# ------------------------------------------------------------------------------------------------
# The request edits: cheap sampling, valid data that gets further, other experiments left alone
# ------------------------------------------------------------------------------------------------


def protect(case: schemathesis.Case, created: Iterable[str] = ()) -> None:
    """Fuzzing never touches the experiments other tests left (schemathesis infers links from the list of
    experiments, so it finds their names) and never deletes or pauses the fuzz target: such a call goes to a name
    that does not exist instead (valid for valid)."""
    name = (case.path_parameters or {}).get("name")
    ends_it = case.method.upper() == "DELETE" or case.path.endswith("/pause")  # a paused target samples nothing
    if name in BEFORE or (name == FUZZ_EXP and ends_it and name not in created):
        case.path_parameters["name"] = "no-such-experiment"
    if isinstance(case.body, dict) and case.body.get("model") in BEFORE:
        case.body["model"] = "no-such-experiment"
