"""The schemathesis set-up that tests/test_fuzz.py fuzzes with, and the helpers its tests share:

- the knobs schemathesis runs under (request timeout, CHEAP, cases per operation, steps per scenario) and its
  configuration: CONFIG, which of its checks are on and, for those that are off, why;
- the document it works from: the server's own (`grpo_server/api/openapi.py`) plus LINKS between operations,
  for the stateful phase; `schema`, made from it, and msgpack as a body format it can send and read;
- our checks beside schemathesis's: strict JSON (no NaN/Infinity), Prometheus text from /metrics, Retry-After
  on a 503 (`strict_answers`), and the same by hand for test_raw's answers (`check_raw`);
- plain calls beside the fuzzing (`Http`, `delete_quietly`) and the record of what was sent (`record`: cases
  and statuses per operation, and per kind of call: streamed, an episode's turn, episodes rated; `summary`,
  written as JSON where GRPO_FUZZ_REPORT names a file);
- the edits to a generated request: `cheapen` (sampling stays cheap), `shape` (valid data fitted to the rules
  no schema states, so it gets further: now and then a stream, an episode's turn, or the rating of episodes
  that were sampled, from an `Episodes` book) and `protect` (other tests' experiments and the fuzz target are
  left alone).

The counts are knobs: GRPO_FUZZ_EXAMPLES (fuzzing-phase cases per operation in test_api, default 25), and
test_fuzz.py's GRPO_FUZZ_SCENARIOS and GRPO_FUZZ_RAW_EXAMPLES; the defaults are what CI runs.

What schemathesis cannot send at all (junk bodies, odd names and keys) is tests/fuzz_strategies.py's.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import os
import time
from collections import Counter, defaultdict
from typing import Any, Iterable

import msgpack
import requests
import schemathesis
from jsonschema import Draft202012Validator
from schemathesis.core.failures import Failure

from grpo_server.api.openapi import ENDPOINTS, openapi_document
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
EXAMPLES = knob("GRPO_FUZZ_EXAMPLES", 25)
STEPS = 8  # test_stateful: calls in each scenario at most
MAX_STREAM_EVENTS = 100_000  # more than any fuzzed stream has (at most 8 x 256 tokens, an experiment's defaults)
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

COUNTS: dict[str, Counter] = defaultdict(Counter)  # test -> "METHOD /path" -> cases
STATUSES: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))  # test -> operation -> status
KINDS: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))  # test -> kind of call -> status
SPANS: dict[str, list[float]] = {}  # test -> [first call, last call] (time.time())
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


DOCUMENT = openapi_document()  # the server's (the `http` fixture checks that it serves this one)

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
        assert isinstance(body, dict) and set(body) == {"error"}, body
        assert set(body["error"]) == {"code", "message"}, body
        assert all(isinstance(v, str) and v for v in body["error"].values()), body
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


DECLARED = {f"{e.method} {e.path}" for e in ENDPOINTS}


def record(test: str, method: str, path: str, status: int, kinds: Iterable[str] = (),
           code: str | None = None) -> None:
    """One case sent; `kinds` (`kinds_of`), with the error's code when there is one (`error_code`)."""
    label = f"{method.upper()} {path}"
    label = label if label in DECLARED else "undeclared methods"  # the coverage phase's probes
    COUNTS[test][label] += 1
    STATUSES[test][label][status] += 1
    for kind in kinds:
        KINDS[test][kind][str(status) if code is None else f"{status} {code}"] += 1
    now = time.time()
    SPANS.setdefault(test, [now, now])[1] = now


def error_code(status: int, content: bytes) -> str | None:
    """An error answer's `error.code` (None for a success, or an error that is not ErrorBody JSON)."""
    if status < 400:
        return None
    try:
        return str(json.loads(content)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def kinds_of(case: schemathesis.Case) -> list[str]:
    """The kinds of call a case is, beside its operation: the streaming and episode ones (so the record shows
    that they were sent, and what came back)."""
    body, kinds = case.body, []
    path = case.path.replace("/v1/experiments/{name}/", "native ").replace("/v1/", "openai ")
    if not isinstance(body, dict) or case.method.upper() != "POST":
        return kinds
    if path in ("openai chat/completions", "openai completions") and body.get("stream") is True:
        kinds.append(f"{path}: stream")
    episode = body.get("episode_id") is not None or any(k.lower() == "x-episode-id" for k in case.headers or {})
    if path.endswith("completions") and episode:
        kinds.append(f"{path}: episode turn" + (" (X-Episode-Id header)" if body.get("episode_id") is None else ""))
        if body.get("stream") is True and path.startswith("openai"):
            kinds.append(f"{path}: streamed episode turn")
    if path == "native feedback" and body.get("episode_ids") is not None:
        kinds.append("native feedback: episode_ids")
        ids = body["episode_ids"]
        if isinstance(ids, list) and all(isinstance(i, str) and i.startswith(EPISODE_PREFIX) for i in ids):
            kinds.append("native feedback: episode_ids of sampled episodes")  # `shape`'s, from an Episodes book
    if path == "native feedback" and body.get("group_id") is not None:
        kinds.append("native feedback: group_id")
    return kinds


def summary() -> dict[str, Any]:
    """Cases, statuses per operation and per kind of call, and each test's span, per test (JSON-ready)."""
    return {test: {"cases": sum(COUNTS[test].values()), "seconds": round(SPANS[test][1] - SPANS[test][0], 1),
                   "operations": {label: dict(sorted(statuses.items()))
                                  for label, statuses in sorted(STATUSES[test].items())},
                   "kinds": {kind: dict(sorted(statuses.items())) for kind, statuses in sorted(KINDS[test].items())}}
            for test in COUNTS}


# ------------------------------------------------------------------------------------------------
# The request edits: cheap sampling, valid data that gets further, other experiments left alone
# ------------------------------------------------------------------------------------------------


def _is_count(value: Any) -> bool:
    """An integer as JSON Schema has it (and pydantic takes it): 5, or 5.0."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and
                                                                       value.is_integer())


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def cheapen(case: schemathesis.Case) -> None:
    """A request that would sample more than CHEAP completions or tokens samples CHEAP instead. Only a value
    the schema allows is changed (to another it allows), so valid data stays valid and invalid data invalid;
    an experiment created by the fuzzing gets cheap defaults and trains in small batches."""
    body = case.body
    if not isinstance(body, dict):
        return
    experiment = case.path == "/v1/experiments"
    sampling = body.get("sampling") if experiment else body
    if isinstance(sampling, dict):
        for key, most in COUNT_MAXIMA.items():
            if _is_count(sampling.get(key)) and CHEAP < sampling[key] <= most:
                sampling[key] = CHEAP
    algorithm = body.get("algorithm") if experiment else None
    if isinstance(algorithm, dict) and _is_count(algorithm.get("batch_groups")) and algorithm["batch_groups"] < 2:
        algorithm["batch_groups"] = 2  # a learner step per two rated groups at most


# The largest value of each count that the schemas allow (where they bound it): only those are lowered.
COUNT_MAXIMA = {"n": 256, "best_of": 256, "max_tokens": 2 ** 20, "max_completion_tokens": 2 ** 20}


PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# The native request's fields, which the OpenAI routes' sampling fields become (openai_models.py): their
# bounds are the native schema's, which the OpenAI schema (OpenAI's own, unbounded) does not state.
NATIVE_FIELDS = DOCUMENT["components"]["schemas"]["CompletionsRequest"]["properties"]
AS_NATIVE = {"n": "n", "temperature": "temperature", "top_p": "top_p", "max_tokens": "max_tokens",
             "max_completion_tokens": "max_tokens", "seed": "seed", "stop": "stop"}


def _fits_native(key: str, value: Any) -> bool:
    value = [value] if key == "stop" and isinstance(value, str) else value  # a string is a list of one
    return Draft202012Validator(NATIVE_FIELDS[AS_NATIVE[key]]).is_valid(value)


OPENAI_HONOURED = {"model", "messages", "prompt", "n", "temperature", "top_p", "max_tokens",
                   "max_completion_tokens", "stop", "seed", "logprobs", "stream", "stream_options", "episode_id"}
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")
EPISODE_PREFIX = "fuzz-"  # of the episode ids `shape` gives


class Episodes:
    """Episode ids for the fuzzed calls, and which of them were sampled and not rated yet, per experiment, so
    that `shape` can make a completions call one turn of an episode (a new one, or one with fewer than TURNS
    turns) and a feedback call the rating of episodes that exist (`episode_ids`). `seen` keeps it up to date
    from each answer; episodes named in a feedback call leave the book whatever its answer (a refused reward
    leaves them pending on the server until `episode_ttl_s`, as a client that gave up would)."""

    TURNS = 3

    def __init__(self, prefix: str):
        assert prefix.startswith(EPISODE_PREFIX), prefix
        self.prefix = prefix
        self.fresh = itertools.count()
        self.open: dict[str, dict[str, int]] = defaultdict(dict)  # experiment -> episode id -> turns sampled

    def turn_id(self, experiment: str, turn: int) -> str:
        going = [e for e, turns in self.open[experiment].items() if turns < self.TURNS]
        return going[turn % len(going)] if going and turn % 2 else f"{self.prefix}-{next(self.fresh)}"

    def ready(self, experiment: str, turn: int) -> list[str]:
        """Two to four sampled episodes of `experiment`, oldest first (empty if fewer than two)."""
        ids = list(self.open[experiment])
        return ids[:2 + turn % 3] if len(ids) >= 2 else []

    def seen(self, case: schemathesis.Case, response) -> None:
        body = case.body if isinstance(case.body, dict) else {}
        if case.path.endswith("/feedback") and isinstance(body.get("episode_ids"), list):
            for episode_id in body["episode_ids"]:
                if isinstance(episode_id, str):  # (fuzzed ones may be anything)
                    self.open[str(case.path_parameters["name"])].pop(episode_id, None)
        elif case.path.endswith("completions") and response.status_code == 200:
            episode_id = sampled(case, response)[1]
            experiment = body.get("model") if case.path in OPENAI_PATHS else case.path_parameters["name"]
            if episode_id is not None:
                turns = self.open[experiment]
                turns[episode_id] = turns.get(episode_id, 0) + 1


def _text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _fit_openai_prompt(body: dict[str, Any]) -> None:
    """The OpenAI prompt as the server takes it (the legacy route: one prompt, not empty, logprobs 0 or 1;
    chat: no `tool` message or assistant `tool_calls` out of thin air, text parts only): the OpenAI schema
    allows much the server refuses (400s: openai_models.py), so that a shaped call gets to the sampler."""
    prompt = body.get("prompt")
    one_prompt = (isinstance(prompt, str) and prompt != "") or (
        isinstance(prompt, list) and len(prompt) > 0 and (isinstance(prompt[0], int) or len(prompt) == 1 and prompt[0]))
    if "prompt" in body and not one_prompt:  # text, token ids, or a list of one of either, not empty
        body["prompt"] = "Once upon a time"
    if _is_count(body.get("logprobs")) and body["logprobs"] > 1:
        body.pop("logprobs")
    if isinstance(body.get("messages"), list):
        messages = [m for m in body["messages"] if isinstance(m, dict) and m.get("role") != "tool"]
        for message in messages:
            message.pop("tool_calls", None)
            content = message.get("content")
            if isinstance(content, list) and not all(_text_part(part) for part in content):
                message["content"] = "Name a colour."
        body["messages"] = messages or [{"role": "user", "content": "Name a colour."}]


def _as_episode_turn(case: schemathesis.Case, body: dict[str, Any], experiment: str, turn: int,
                     episodes: Episodes) -> None:
    """One completion (n = 1) of an episode, at the experiment's own temperature and top_p (an episode keeps
    them, and the episodes rated together must share them); on the OpenAI routes the id goes in the
    X-Episode-Id header every other time."""
    episode_id = episodes.turn_id(experiment, turn)
    body["n"] = 1
    body.pop("temperature", None)
    body.pop("top_p", None)
    if case.path in OPENAI_PATHS and (turn // 5) % 2:
        body.pop("episode_id", None)
        case.headers = {**(case.headers or {}), "X-Episode-Id": episode_id}
    else:
        body["episode_id"] = episode_id


def shape(case: schemathesis.Case, turn: int, sizes: dict[str, int], names: list[str],
          episodes: Episodes | None = None) -> None:
    """Valid data fitted to what the schema cannot state, so that more of it gets past the rules between
    fields and the server's limits to the sampler and the learner: an experiment the test server can hold
    (rank at most its max_lora_rank, the model's own layers); exactly one prompt field; feedback for a group
    that was sampled (`sizes`: group id -> completions) with one reward per completion; an experiment that
    exists (`names`) for the OpenAI routes and, now and then, for a path; OpenAI requests mostly without the
    fields we refuse unless neutral, their sampling fields within the native bounds and their prompt or
    history as the server takes it (`_fit_openai_prompt`). And the calls no schema makes likely: every third
    OpenAI call streamed (`stream: true`, with `stream_options.include_usage` half the time); with
    `episodes`, two in five completions calls (native and OpenAI) one turn of an episode, and two in five
    feedback calls the rating of episodes sampled so far (`episode_ids`, one reward each). Valid data only,
    and only by removing or adding optional fields or swapping a value for another valid one, so what was
    valid stays valid. One case in four is left as is."""
    if case.meta is None or case.meta.generation.mode != schemathesis.GenerationMode.POSITIVE or turn % 4 == 3:
        return
    path_name = (case.path_parameters or {}).get("name")
    if names and path_name is not None and path_name not in names and turn % 2 == 0 and case.method.upper() != "DELETE":
        case.path_parameters["name"] = names[turn % len(names)]
    body = case.body
    if not isinstance(body, dict):
        return
    prompts = [key for key in PROMPT_FIELDS if body.get(key) is not None]
    if case.path == "/v1/experiments":
        lora = body.get("lora")
        if isinstance(lora, dict):
            lora.pop("target_modules", None)
            if _is_count(lora.get("r")) and lora["r"] > 16:
                lora["r"] = 16  # the test server's max_lora_rank
    elif case.path.endswith("/feedback") and episodes is not None and turn % 5 in (1, 2) and \
            episodes.ready(case.path_parameters["name"], turn):
        body["episode_ids"] = episodes.ready(case.path_parameters["name"], turn)
        for key in [*PROMPT_FIELDS, "group_id", "completions", "extra_completions"]:
            body.pop(key, None)
        rewards = [r if _is_number(r) and abs(r) <= 1e9 else 1.0 for r in body["rewards"]]
        body["rewards"] = list(itertools.islice(itertools.cycle(rewards), len(body["episode_ids"])))
    elif case.path.endswith("/feedback"):
        group_id = body.get("group_id")
        if group_id not in sizes and sizes and turn % 2 == 0:
            group_id = body["group_id"] = sorted(sizes)[turn % len(sizes)]
        for key in ("completions", "extra_completions"):
            for completion in body.get(key) or []:  # exactly one of text and token_ids
                if isinstance(completion, dict) and completion.get("text") is None:
                    completion["text"] = "An answer"
                if isinstance(completion, dict):
                    completion.pop("token_ids", None)
        if group_id in sizes:
            for key in prompts + ["completions"]:
                body.pop(key, None)
        size = sizes[group_id] + len(body.get("extra_completions") or []) if group_id in sizes else \
            len(body.get("completions") or []) or len(body["rewards"])
        rewards = [r if _is_number(r) and abs(r) <= 1e9 else 1.0 for r in body["rewards"]]  # the server's range
        body["rewards"] = list(itertools.islice(itertools.cycle(rewards), size))
        if group_id not in sizes and len(prompts) > 1:
            for key in prompts[1:]:
                body.pop(key)
    elif case.path.endswith("/completions") and case.path.startswith("/v1/experiments/") or \
            case.path == "/v1/tokenize":
        if not prompts:
            body["prompt"] = "Once upon a time"
        for key in prompts[1:]:
            body.pop(key)
        if case.path != "/v1/tokenize":
            body.pop("episode_id", None)  # an episode's turn where `episodes` makes it one
            if episodes is not None and turn % 5 in (1, 2):
                _as_episode_turn(case, body, case.path_parameters["name"], turn, episodes)
    elif case.path in OPENAI_PATHS:
        for key in [k for k in body if k not in OPENAI_HONOURED]:
            body.pop(key)
        for key in [k for k in AS_NATIVE if k in body and not _fits_native(k, body[k])]:
            body.pop(key)  # beyond the native bounds: a 422 before sampling, for the most part
        _fit_openai_prompt(body)
        if names and isinstance(body.get("model"), str) and body["model"] not in names:
            body["model"] = names[turn % len(names)]
        body.pop("episode_id", None)
        if turn % 3 == 1:
            body["stream"] = True
            if turn % 2:
                body["stream_options"] = {"include_usage": True}
        if episodes is not None and turn % 5 in (1, 2) and isinstance(body.get("model"), str):
            _as_episode_turn(case, body, body["model"], turn, episodes)


def protect(case: schemathesis.Case, created: Iterable[str] = ()) -> None:
    """Fuzzing never touches the experiments other tests left (schemathesis infers links from the list of
    experiments, so it finds their names) and never deletes the fuzz target: such a call goes to a name that
    does not exist instead (valid for valid)."""
    name = (case.path_parameters or {}).get("name")
    if name in BEFORE or (name == FUZZ_EXP and case.method.upper() == "DELETE" and name not in created):
        case.path_parameters["name"] = "no-such-experiment"
    if isinstance(case.body, dict) and case.body.get("model") in BEFORE:
        case.body["model"] = "no-such-experiment"
