"""The fuzz tests' fixtures (tests/test_fuzz.py, tests/test_fuzz_found.py): a client of the session `server`
checked to serve the OpenAPI document the fuzzing is made from, and the experiment fuzzed requests aim at.
Module-scoped: each module that imports them makes its own fuzz target and deletes it when done."""

from __future__ import annotations

import pytest

from grpo_server.api.app import ENDPOINTS
from grpo_server.api.openapi import openapi_document
from tests.fuzz_schema import BEFORE, CHEAP, Http, schema
from tests.fuzz_strategies import FUZZ_EXP, FUZZ_KEY


@pytest.fixture(scope="module")
def http(server):
    client = Http(server.url)
    schema.config.update(base_url=server.url)
    served = client.request("GET", "/openapi.json")
    assert served.status_code == 200 and served.json() == openapi_document(ENDPOINTS)  # what `schema` is made from
    yield client
    client.session.close()


@pytest.fixture(scope="module")
def fuzz_target(http):
    """The experiment fuzzed requests aim at: small defaults (n=2, 4 tokens), and no training (a batch would
    need 4096 groups), so sampling stays cheap; a few sampled groups for feedback to find."""
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
