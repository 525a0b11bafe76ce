"""The auth matrix over real HTTP: every public route (the OpenAPI table, which a test holds equal to
`app.routes()`) x {no key, wrong key, another experiment's key, the experiment's own key, the admin key}.

Expected, from the route's `auth` in `grpo_server/api/route_table.py`:
- `public` (`/openapi.json`, `/v1/health`): the answer, whatever the key (a bad one is ignored);
- otherwise no key or an unknown key: 401;
- `key` (the experiment list, the model list): any valid key succeeds; the list shows an experiment key its own
  only;
- `experiment` (the experiment in the path, or the body's `model` or, on tokenize, `experiment`): its own key
  and the admin key succeed; another experiment's key is a 403, and so is any experiment that does not exist
  (the same answer, so names do not leak); the admin gets 404 for that one;
- `admin` (create, delete, pause): the admin key only; an experiment's key is a 403.
Each request has a cheap valid body (n=1, max_tokens=1), so a success is the endpoint's success status.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from jsonschema import Draft202012Validator

from grpo_server.api.app import ENDPOINTS, routes
from grpo_server.api.tinker.routes import ROUTES as TINKER_ROUTES
from grpo_server.api.openapi import openapi_document
from grpo_server.api.route_table import Endpoint
from tests.serving import ADMIN_KEY

A, B = "auth-a", "auth-b"
KEYS = {A: "key-auth-a-3f9c-0d5e", B: "key-auth-b-71d2-9a4b"}  # experiment keys: 16 characters at least
WRONG_KEY = "wrong-key-5e01"
WHO = ("none", "wrong", "other", "own", "admin")
CHEAP = {"n": 1, "max_tokens": 1}
ERROR_KEYS = {"plain": {"code", "message"}, "openai": {"code", "message", "type", "param"},  # route_table.ErrorShape
              "anthropic": {"type", "message", "code"}}
ERROR_TOP = {"plain": {"error"}, "openai": {"error"}, "anthropic": {"type", "error"}}  # the body's own keys
ERROR_REFS = {"plain": "/ErrorBody", "openai": "/OpenAIErrorBody", "anthropic": "/AnthropicErrorBody"}
_fresh = itertools.count()


def _route_set(pairs) -> set[tuple[str, str]]:
    return {(method.upper(), path) for method, path in pairs}


def test_table_covers_every_route():
    """A route without a row in ENDPOINTS (and so without an OpenAPI operation) fails here."""
    served = _route_set((r.method, r.path) for r in routes() if isinstance(r, web.RouteDef))
    assert len(served) == len(routes())
    assert served == _route_set((e.method, e.path) for e in ENDPOINTS)
    paths = openapi_document(ENDPOINTS)["paths"]
    documented = _route_set((method, path) for path, ops in paths.items() for method in ops)
    assert served == documented


def test_openapi_document_is_served_without_a_key_and_is_complete(server):
    import json
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/openapi.json", timeout=60) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("application/json")
        doc = json.loads(response.read())
    assert doc == json.loads(json.dumps(openapi_document(ENDPOINTS)))
    assert doc["openapi"].startswith("3.1")
    assert doc["components"]["securitySchemes"]["bearer"] == {
        **doc["components"]["securitySchemes"]["bearer"], "type": "http", "scheme": "bearer"}
    schemas = doc["components"]["schemas"]
    refs = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.add(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert all(ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas for ref in refs), refs
    for schema in schemas.values():  # each one a valid JSON Schema (2020-12, as OpenAPI 3.1 has it)
        Draft202012Validator.check_schema(schema)
    assert schemas["ErrorBody"]["properties"]["error"]["$ref"].endswith("/ErrorDetail")
    assert set(schemas["ErrorDetail"]["required"]) == {"code", "message"}
    assert schemas["OpenAIErrorBody"]["properties"]["error"]["$ref"].endswith("/OpenAIErrorDetail")
    assert set(schemas["OpenAIErrorDetail"]["required"]) == {"code", "message", "type", "param"}
    for endpoint in ENDPOINTS:
        operation = doc["paths"][endpoint.path][endpoint.method.lower()]
        assert str(endpoint.status) in operation["responses"]
        assert operation["security"] == ([] if endpoint.auth == "public" else [{"bearer": []}])
        errors = [s for s in operation["responses"] if int(s) >= 400]
        error_body = ERROR_REFS[endpoint.error_shape]
        assert all(operation["responses"][s]["content"]["application/json"]["schema"]["$ref"].endswith(error_body)
                   for s in errors)
        if endpoint.auth != "public":
            assert "401" in errors
        if "{name}" in endpoint.path:
            assert operation["parameters"][0]["name"] == "name" and operation["parameters"][0]["in"] == "path"
    adapter = doc["paths"]["/v1/experiments/{name}/adapter"]["get"]
    assert {"name": "version", "in": "query"}.items() <= adapter["parameters"][1].items()
    assert "application/gzip" in adapter["responses"]["200"]["content"]
    create = doc["paths"]["/v1/experiments"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/NewExperiment")
    assert schemas["NewExperiment"]["additionalProperties"] is False  # strict, as the model


# ------------------------------------------------------------------------------------------------
# The matrix
# ------------------------------------------------------------------------------------------------


class Api:
    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.session, self.url = session, url

    async def call(self, method: str, path: str, key: str | None = ADMIN_KEY, body: Any = None) -> tuple[int, Any]:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        async with self.session.request(method, self.url + path, json=body, headers=headers) as response:
            if response.content_type == "application/json":
                return response.status, await response.json()
            return response.status, await response.read()

    async def ok(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        got, data = await self.call(method, path, ADMIN_KEY, body)
        assert got == status, (method, path, got, data)
        return data


@pytest.fixture(scope="module")
async def api(server):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        client = Api(session, server.url)
        for name in (A, B):
            await client.ok("POST", "/v1/experiments", {"name": name, "api_key": KEYS[name],
                                                        "sampling": {"n": 1, "max_tokens": 1}}, 201)
        yield client
        for name in (A, B):
            await client.ok("DELETE", f"/v1/experiments/{name}", status=204)


async def _group(api: Api, name: str) -> str:
    data = await api.ok("POST", f"/v1/experiments/{name}/completions", {"prompt": "Hello", **CHEAP})
    return data["group_id"]


async def _request(api: Api, endpoint: Endpoint, target: str) -> tuple[str, Any]:
    """The path and a cheap valid body of `endpoint` aimed at experiment `target` (which may not exist)."""
    path = endpoint.path.replace("{name}", target)
    op = endpoint.operation_id
    if op == "post_tokenize":
        return path, {"prompt": "Hello", "experiment": target}
    if op == "post_experiments":
        return path, {"name": f"auth-new-{next(_fresh)}"}
    if op == "post_experiments_name_completions":
        return path, {"prompt": "Hello", **CHEAP}
    if op == "post_experiments_name_feedback":
        group = await _group(api, target) if target in KEYS else "grp_none"
        return path, {"group_id": group, "rewards": [1.0]}
    if op == "post_chat_completions":
        return path, {"model": target, "messages": [{"role": "user", "content": "Hi"}], **CHEAP}
    if op == "post_completions":
        return path, {"model": target, "prompt": "Hello", **CHEAP}
    if op == "post_tokenize_vllm":
        return path, {"model": target, "prompt": "Hello"}
    if op == "post_detokenize":
        return path, {"model": target, "tokens": [1, 2]}
    if op == "post_responses":
        return path, {"model": target, "input": "Hi", "max_output_tokens": 1}
    if op in ("post_messages", "post_messages_count_tokens"):
        return path, {"model": target, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    if endpoint.request is not None:
        raise AssertionError(f"{op}: give the auth matrix a cheap valid request for this new endpoint")
    return path + ("?version=0" if op == "get_experiments_name_adapter" else ""), None


def _key(who: str, own: str, other: str) -> str | None:
    return {"none": None, "wrong": WRONG_KEY, "other": KEYS[other], "own": KEYS[own], "admin": ADMIN_KEY}[who]


def expected_status(endpoint: Endpoint, who: str) -> int:
    if endpoint.auth == "public":
        return endpoint.status
    if who in ("none", "wrong"):
        return 401
    if endpoint.auth == "key":
        return endpoint.status
    if endpoint.auth == "admin":
        if endpoint.operation_id == "post_experiments_name_restore" and who == "admin":
            return 409  # past the auth: A is running, not held as unrestored (tests/test_restart_restore.py)
        return endpoint.status if who == "admin" else 403
    assert endpoint.auth == "experiment", endpoint.auth
    return endpoint.status if who in ("own", "admin") else 403


# The Tinker routes name their model in the body, under ids the server makes: tests/test_tinker.py holds them to
# the same rules through the SDK (no key or a wrong one: 401; another key's model: not found).
MATRIX = tuple(e for e in ENDPOINTS if e not in TINKER_ROUTES)


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("endpoint", MATRIX, ids=[e.operation_id for e in MATRIX])
async def test_auth_matrix(api, endpoint: Endpoint, who: str):
    target = A
    if endpoint.method == "DELETE":  # a throwaway experiment, with its own key, so A survives
        target = f"auth-victim-{next(_fresh)}"
        KEYS[target] = f"key-{target}"
        await api.ok("POST", "/v1/experiments", {"name": target, "api_key": KEYS[target]}, 201)
    path, body = await _request(api, endpoint, target)
    status, data = await api.call(endpoint.method, path, _key(who, target, B), body)
    want = expected_status(endpoint, who)
    assert status == want, (endpoint.method, path, who, status, data)
    if status >= 400:
        shape = endpoint.error_shape
        assert set(data) == ERROR_TOP[shape] and set(data["error"]) == ERROR_KEYS[shape], data
        if status == 401:
            assert data["error"]["code"] == ("missing_key" if who == "none" else "invalid_key")
        if status == 403:
            assert data["error"]["code"] == ("admin_only" if endpoint.auth == "admin" else "wrong_experiment")
    # clean up what a success made
    if endpoint.operation_id == "post_experiments" and status == 201:
        await api.ok("DELETE", f"/v1/experiments/{body['name']}", status=204)
    if endpoint.method == "DELETE" and status != 204:
        await api.ok("DELETE", path, status=204)
    if endpoint.operation_id == "post_experiments_name_pause" and status == 200:  # A samples in the other rows
        await api.ok("POST", path.removesuffix("/pause") + "/unpause")
    if endpoint.operation_id == "get_experiments" and status == 200:
        names = {e["name"] for e in data["experiments"]}
        assert names == ({A, B} if who == "admin" else {A} if who == "own" else {B}), names


@pytest.mark.parametrize("endpoint", [e for e in MATRIX if e.auth in ("experiment", "admin")],
                         ids=[e.operation_id for e in MATRIX if e.auth in ("experiment", "admin")])
async def test_unknown_experiment_is_the_same_403_as_someone_elses(api, endpoint: Endpoint):
    """An experiment key learns nothing about which other names exist; the admin key gets the 404."""
    answers = []
    for target in (B, "auth-does-not-exist"):
        path, body = await _request(api, endpoint, target)
        answers.append(await api.call(endpoint.method, path, KEYS[A], body))
    assert answers[0] == answers[1] and answers[0][0] == 403, answers
    if "{name}" in endpoint.path or endpoint.request is not None and {"model", "experiment"} & set(
            endpoint.request.model_fields):
        path, body = await _request(api, endpoint, "auth-does-not-exist")
        status, data = await api.call(endpoint.method, path, ADMIN_KEY, body)
        if endpoint.auth == "experiment" or endpoint.method == "DELETE":
            assert status == 404 and data["error"]["code"] == "experiment_not_found", data


async def test_keys_are_never_logged(server, api):
    """After the matrix: no key (admin, experiments', the wrong one) in the server's or the workers' logs."""
    logs = [server.log_path] + sorted(Path(server.run_dir, "logs").glob("*"))
    for key in [ADMIN_KEY, WRONG_KEY, *KEYS.values()]:
        for log in logs:
            if log.is_file():
                assert key not in log.read_text(errors="replace"), (key, log)


def test_no_handler_checks_a_key_itself():
    """The route table is executed (api/edge.py `guarded`): the key, the row's scope and the body are the
    wrapper's, so no module of the API families calls `caller`, `require` or `parse_body` itself."""
    import re
    from pathlib import Path

    api = Path(__file__).resolve().parent.parent / "grpo_server" / "api"
    calls = re.compile(r"\b(caller|require|parse_body)\(")
    found = [f"{p.relative_to(api)}:{n}" for p in sorted(api.rglob("*.py")) if p.name != "edge.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if calls.search(line)]
    assert found == []



# ------------------------------------------------------------------------------------------------
# The Tinker rows: the same keys, aimed at experiment A's Tinker session, model, sampler and futures
# ------------------------------------------------------------------------------------------------

# What B's key gets, aimed at A's things: a row that names a model is the table's 404 before its handler runs
# (route_table `resource`); a session, a sampler or a future of another key is as unknown as one that never
# existed (404; a future 410, the SDK's "expired"). Rows that act on nothing of A's succeed for any key.
TINKER_OTHER = {
    "post_session_heartbeat": 404, "post_sessions_session_id_finish": 404, "get_samplers_sampler_id": 404,
    "post_asample": 404, "post_retrieve_future": 410,
    **{e.operation_id: 404 for e in TINKER_ROUTES if e.resource is not None},
}
TINKER_MATRIX = tuple(e for e in TINKER_ROUTES if e.auth != "public")


class TinkerTarget:
    """A's Tinker session, model (rank of A's experiment), saved state `s`, sampler weights `w` and a sampler on
    them, made with A's key."""

    def __init__(self, api: Api, base_model: str):
        self.api, self.base_model = api, base_model

    async def call(self, method: str, path: str, key: str | None, body: Any = None,
                   raw: bytes | None = None) -> tuple[int, Any]:
        if raw is None:
            return await self.api.call(method, path, key, body)
        headers = {"Content-Type": "application/x-protobuf", **({"X-API-Key": f"tml-{key}"} if key else {})}
        async with self.api.session.request(method, self.api.url + path, data=raw, headers=headers) as response:
            return response.status, await response.json()

    async def ok(self, path: str, body: Any) -> Any:
        status, data = await self.call("POST", path, KEYS[A], body)
        assert status == 200, (path, status, data)
        return data

    async def result(self, answer: dict) -> Any:
        while True:
            status, data = await self.call("POST", "/api/v1/retrieve_future", KEYS[A],
                                           {"request_id": answer["request_id"]})
            if status != 408:
                assert status == 200 and "error" not in data, data
                return data

    async def make(self) -> "TinkerTarget":
        status, info = await self.api.call("GET", f"/v1/experiments/{A}", KEYS[A])
        self.rank = info["config"]["lora"]["r"]
        self.session = (await self.ok("/api/v1/create_session", {"sdk_version": "0.38.0"}))["session_id"]
        self.model = (await self.result(await self.ok("/api/v1/create_model", {
            "session_id": self.session, "model_seq_id": 0, "base_model": self.base_model,
            "lora_config": {"rank": self.rank}})))["model_id"]
        for label in ("s", "del-own", "del-admin"):
            await self.result(await self.ok("/api/v1/save_weights", {"model_id": self.model, "path": label}))
        await self.result(await self.ok("/api/v1/save_weights_for_sampler", {"model_id": self.model, "path": "w"}))
        self.sampler = (await self.ok("/api/v1/create_sampling_session", {
            "session_id": self.session, "sampling_session_seq_id": 0,
            "model_path": f"tinker://{self.model}/sampler_weights/w"}))["sampling_session_id"]
        return self

    async def sample(self) -> dict:
        return await self.ok("/api/v1/asample", {"sampling_session_id": self.sampler, "num_samples": 1,
                                                 "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                                 "sampling_params": {"max_tokens": 1}})

    async def request(self, endpoint: Endpoint, who: str) -> tuple[str, Any, bytes | None]:
        """The path, JSON body and protobuf body of a cheap valid call of `endpoint` on A's things."""
        model, op = self.model, endpoint.operation_id
        path = endpoint.path.replace("{session_id}", self.session).replace("{sampler_id}", self.sampler) \
            .replace("{model_id}", model).replace("{kind}", "weights").replace("{checkpoint}", f"del-{who}")
        if op == "post_forward_backward":
            from tinker.proto import tinker_public_pb2 as pb
            tokens = pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=b"\x01\x00\x00\x00\x02\x00\x00\x00"))
            targets = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2], dense=b"\x02" + b"\x00" * 7 + b"\x03" + b"\x00" * 7)
            datum = pb.Datum(model_input=[tokens], loss_fn_inputs={"target_tokens": targets})
            return path, None, pb.ForwardBackwardRequest(model_id=model, data=[datum], loss_fn="cross_entropy",
                                                         forward_only=True).SerializeToString()
        bodies = {
            "post_client_config": {"sdk_version": "0.38.0"},
            "post_create_session": {"sdk_version": "0.38.0"},
            "post_session_heartbeat": {"session_id": self.session},
            "post_sessions_session_id_finish": {"reason": {"type": "success"}},
            "post_telemetry": {},
            "post_create_model": {"session_id": self.session, "model_seq_id": 9, "base_model": self.base_model,
                                  "lora_config": {"rank": self.rank}},
            "post_get_info": {"model_id": model},
            "post_optim_step": {"model_id": model, "adam_params": {"learning_rate": 0.0}},
            "post_save_weights": {"model_id": model, "path": f"m-{who}"},
            "post_save_weights_for_sampler": {"model_id": model, "path": f"m-{who}"},
            "post_save_weights_external": {"model_id": model, "path": f"x-{who}"},
            "post_load_weights": {"model_id": model, "path": f"tinker://{model}/weights/s", "optimizer": False},
            "post_create_sampling_session": {"session_id": self.session, "sampling_session_seq_id": 1,
                                             "model_path": f"tinker://{model}/sampler_weights/w"},
            "post_asample": {"sampling_session_id": self.sampler, "num_samples": 1, "sampling_params": {"max_tokens": 1},
                             "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}},
            "post_retrieve_future": {"request_id": (await self.sample())["request_id"]},
            "post_cancel_future": {"request_id": (await self.sample())["request_id"]},
            "post_weights_info": {"tinker_path": f"tinker://{model}/weights/s"},
        }
        if endpoint.method != "GET" and endpoint.request is not None and op not in bodies:
            raise AssertionError(f"{op}: give the Tinker auth matrix a cheap valid request for this new row")
        return path, bodies.get(op), None


@pytest.fixture(scope="module")
async def tinker_target(api, tiny_model_dir):
    return await TinkerTarget(api, str(tiny_model_dir)).make()


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("endpoint", TINKER_MATRIX, ids=[e.operation_id for e in TINKER_MATRIX])
async def test_tinker_auth_matrix(tinker_target, endpoint: Endpoint, who: str):
    if endpoint.operation_id == "post_sessions_session_id_finish" and who in ("own", "admin"):
        pytest.skip("finishing A's session would end it for the rows after; a finish is tried by test_tinker.py")
    path, body, raw = await tinker_target.request(endpoint, who)
    status, data = await tinker_target.call(endpoint.method, path, _key(who, A, B), body, raw)
    want = 401 if who in ("none", "wrong") else TINKER_OTHER.get(endpoint.operation_id, endpoint.status) \
        if who == "other" else endpoint.status
    assert status == want, (endpoint.method, path, who, status, data)
    if status >= 400:
        assert set(data) == {"error"} and set(data["error"]) == {"code", "message"}, data
    if status == 404 and endpoint.resource is not None:
        assert data["error"]["code"] == "model_not_found", data  # the table's, before the handler
