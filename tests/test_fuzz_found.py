"""What the fuzzing of tests/test_fuzz.py found (each was a 500 or a stream that failed after its headers), kept as
plain regression cases over real HTTP on the session `server`, and the integer bounds behind one of them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from grpo_server.config import ExperimentConfig
from tests.fuzz_fixtures import fuzz_target, http  # noqa: F401 (pytest fixtures, used by name)
from tests.fuzz_schema import ADMIN, delete_quietly, strict_json
from tests.fuzz_strategies import FUZZ_EXP


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
    # schemathesis's stateful phase: an integer beyond 64 bits in the config (msgpack's OverflowError on the
    # way to the learner). Every integer of the experiment config has an upper bound now (next test).
    ("/v1/experiments", b'{"name": "fuzz-huge-int", "algorithm": {"push_every": 18446744073709551616}}', 422,
     "invalid_request"),
    # Also the stateful phase: vLLM takes temperatures in [0, 2] only (vllm/sampling_params.py), the API took
    # up to 10: above 2 was the sampler's VLLMValidationError, a 502. Now bounded at 2, on every route.
    (f"/v1/experiments/{FUZZ_EXP}/completions", b'{"prompt": "Hi", "n": 1, "max_tokens": 1, "temperature": 2.5}',
     422, "invalid_request"),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "n": 1, '
     b'"max_tokens": 1, "temperature": 2.5}' % FUZZ_EXP.encode(), 422, "invalid_request"),
    ("/v1/completions", b'{"model": "%s", "prompt": "Hi", "n": 1, "max_tokens": 1, "temperature": 2.5}'
     % FUZZ_EXP.encode(), 422, "invalid_request"),
    # And `lora.alpha` had no upper bound: at 1e6 (scale alpha / r) the served model's logits overflowed, and a
    # completion came back with token id 0 and `null` logprobs, against the response schema.
    ("/v1/experiments", b'{"name": "fuzz-huge-alpha", "lora": {"alpha": 1e30}}', 422, "invalid_request"),
]


@pytest.mark.parametrize("path, data, status, code", FOUND, ids=range(len(FOUND)))
def test_found_by_fuzzing(http, fuzz_target, path, data, status, code):
    answer = http.request("POST", path, {**ADMIN, "Content-Type": "application/json"}, data)
    if answer.status_code == 201:  # a regression: do not leave it behind
        delete_quietly(http, json.loads(answer.content)["name"])
    body = strict_json(answer.content)
    assert (answer.status_code, body["error"]["code"]) == (status, code), body
    assert http.json("GET", "/v1/experiments", key="wrong-key")[0] == 401


FOUND_BUGS = [  # found by the fuzzing, fixed in the server
    # A stream with an empty stop string was a 200 stream whose one event after the first chunk was the sampler's
    # {"error": {"code": "bad_request", "message": "sampler-0: stop strings must be non-empty"}}, not a 4xx.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop": ""}),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", ""]}),
]


@pytest.mark.parametrize("path, body", FOUND_BUGS, ids=range(len(FOUND_BUGS)))
def test_found_bug_stays_fixed(http, fuzz_target, path, body):
    """What every refusal of a stream should be (README, Streaming): a plain JSON error with its 4xx status,
    before the stream starts."""
    body = {"model": FUZZ_EXP, "n": 1, "max_tokens": 1, "stream": True, **body}
    answer = http.request("POST", path, {**ADMIN, "Content-Type": "application/json"}, json.dumps(body).encode())
    assert 400 <= answer.status_code < 500, (answer.status_code, answer.content[:500])
    assert strict_json(answer.content)["error"]["code"], answer.content


def _integer_fields(schema_: dict[str, Any], defs: dict[str, Any], prefix: str = "") -> list[tuple[str, dict]]:
    """(dotted path, JSON schema) of every integer field of a pydantic JSON schema, nested models included."""
    out = []
    for key, prop in schema_.get("properties", {}).items():
        if "$ref" in prop:
            out += _integer_fields(defs[prop["$ref"].rsplit("/", 1)[1]], defs, f"{prefix}{key}.")
        elif prop.get("type") == "integer":
            out.append((prefix + key, prop))
    return out


EXPERIMENT_INTEGERS = _integer_fields(ExperimentConfig.model_json_schema(), ExperimentConfig.model_json_schema()
                                      .get("$defs", {}))


def test_experiment_integers_are_bounded():
    """msgpack (the learner's and sampler's wire) holds 64-bit integers: each one a client sets is bounded."""
    assert EXPERIMENT_INTEGERS, "no integer fields found"
    unbounded = [path for path, prop in EXPERIMENT_INTEGERS if prop.get("maximum", 2 ** 63) >= 2 ** 63]
    assert not unbounded, unbounded


@pytest.mark.parametrize("path", [p for p, _ in EXPERIMENT_INTEGERS])
def test_experiment_integer_beyond_64_bits_is_422(http, fuzz_target, path):
    """A 500 schemathesis found: `POST /v1/experiments` with `algorithm` integers beyond 64 bits."""
    section, _, field = path.rpartition(".")
    config: dict[str, Any] = {"name": "fuzz-huge-int"}
    (config.setdefault(section, {}) if section else config)[field] = 2 ** 64
    status, body = http.json("POST", "/v1/experiments", config)
    if status == 201:
        delete_quietly(http, "fuzz-huge-int")
    assert status == 422 and body["error"]["code"] == "invalid_request", (status, body)
    assert path in body["error"]["message"], body  # names the field
