"""The schemathesis set-up that tests/test_fuzz.py fuzzes with, and the helpers its tests share:

- the knobs schemathesis runs under (request timeout, CHEAP, cases per operation, steps per scenario) and its
  configuration: CONFIG, which of its checks are on and, for those that are off, why;
- the document it works from: the server's own (`grpo_server/api/openapi.py`) plus LINKS between operations,
  for the stateful phase; `schema`, made from it, and msgpack as a body format it can send and read;
- our checks beside schemathesis's: strict JSON (no NaN/Infinity), Prometheus text from /metrics, Retry-After
  on a 503 (`strict_answers`), and the same by hand for test_raw's answers (`check_raw`);
- plain calls beside the fuzzing (`Http`, `delete_quietly`) and the record of what was sent (`record`);
- the edits to a generated request: `cheapen` (sampling stays cheap), `shape` (valid data fitted to the rules
  no schema states, so it gets further) and `protect` (other tests' experiments and the fuzz target are left
  alone).

What schemathesis cannot send at all (junk bodies, odd names and keys) is tests/fuzz_strategies.py's.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections import Counter, defaultdict
from typing import Any, Iterable

import msgpack
import requests
import schemathesis
from schemathesis.core.failures import Failure

from grpo_server.api.openapi import ENDPOINTS, openapi_document
from tests.fuzz_strategies import FUZZ_EXP, MSGPACK
from tests.serving import ADMIN_KEY

TIMEOUT_S = 120
CHEAP = 4  # most completions (n) and tokens (max_tokens) a fuzzed request may sample
EXAMPLES = 25  # fuzzing-phase cases per operation in test_api (the examples and coverage phases add theirs)
STEPS = 8  # test_stateful: calls in each scenario at most
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

COUNTS: dict[str, Counter] = defaultdict(Counter)  # test -> "METHOD /path" -> cases
STATUSES: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))  # test -> operation -> status
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


def linked_document() -> dict[str, Any]:
    doc = copy.deepcopy(openapi_document())
    for (path, method, status), links in LINKS.items():
        doc["paths"][path][method]["responses"][status]["links"] = links
    return doc


CONFIG = schemathesis.Config.from_dict({
    "headers": ADMIN,  # the admin key, so that bodies are looked at; test_api and test_raw try others
    "request-timeout": TIMEOUT_S,
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


@schemathesis.check
def strict_answers(ctx, response, case) -> bool | None:
    """Ours, beside schemathesis's: JSON without NaN/Infinity; /metrics parses as Prometheus text; a 503
    carries Retry-After."""
    content_type = _content_type(response)
    try:
        if content_type == "application/json":
            strict_json(response.content)
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


def created_name(case: schemathesis.Case, response) -> str | None:
    if case.path != "/v1/experiments" or case.method.upper() != "POST" or response.status_code != 201:
        return None
    return _body(response)["name"]


def delete_quietly(http: Http, name: str) -> None:
    status, body = http.json("DELETE", f"/v1/experiments/{name}")
    assert status in (204, 404), (status, body)


DECLARED = {f"{e.method} {e.path}" for e in ENDPOINTS}


def record(test: str, method: str, path: str, status: int) -> None:
    label = f"{method.upper()} {path}"
    label = label if label in DECLARED else "undeclared methods"  # the coverage phase's probes
    COUNTS[test][label] += 1
    STATUSES[test][label][status] += 1


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
OPENAI_HONOURED = {"model", "messages", "prompt", "n", "temperature", "top_p", "max_tokens",
                   "max_completion_tokens", "stop", "seed", "logprobs"}


def shape(case: schemathesis.Case, turn: int, sizes: dict[str, int], names: list[str]) -> None:
    """Valid data fitted to what the schema cannot state, so that more of it gets past the rules between
    fields and the server's limits to the sampler and the learner: an experiment the test server can hold
    (rank at most its max_lora_rank, the model's own layers); exactly one prompt field; feedback for a group
    that was sampled (`sizes`: group id -> completions) with one reward per completion; an experiment that
    exists (`names`) for the OpenAI routes and, now and then, for a path; OpenAI requests mostly without the
    fields we refuse unless neutral. Valid data only, and only by removing or adding optional fields or
    swapping a value for another valid one, so what was valid stays valid. One case in four is left as is."""
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
    elif case.path in ("/v1/chat/completions", "/v1/completions"):
        for key in [k for k in body if k not in OPENAI_HONOURED]:
            body.pop(key)
        if names and isinstance(body.get("model"), str) and body["model"] not in names:
            body["model"] = names[turn % len(names)]


def protect(case: schemathesis.Case, created: Iterable[str] = ()) -> None:
    """Fuzzing never touches the experiments other tests left (schemathesis infers links from the list of
    experiments, so it finds their names) and never deletes the fuzz target: such a call goes to a name that
    does not exist instead (valid for valid)."""
    name = (case.path_parameters or {}).get("name")
    if name in BEFORE or (name == FUZZ_EXP and case.method.upper() == "DELETE" and name not in created):
        case.path_parameters["name"] = "no-such-experiment"
    if isinstance(case.body, dict) and case.body.get("model") in BEFORE:
        case.body["model"] = "no-such-experiment"
