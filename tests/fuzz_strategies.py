"""Hypothesis strategies for tests/test_fuzz.py: requests drawn from the OpenAPI document's schemas (valid-ish,
then mutated), junk bodies and encodings, experiment names, query strings and keys."""

from __future__ import annotations

import json
import string
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
from hypothesis import strategies as st

from grpo_server.api.openapi import Endpoint, openapi_document
from tests.serving import ADMIN_KEY


FUZZ_EXP = "fuzz-target"
FUZZ_KEY = "key-fuzz-target"
TIMEOUT = aiohttp.ClientTimeout(total=120)
CHEAP = 4  # most completions (n) and tokens (max_tokens) a fuzzed request may sample
MSGPACK = "application/msgpack"

# Examples per operation: fewer where a valid request runs the sampler (or creates an experiment).
EXAMPLES = {
    "get_openapi_json": 20,
    "get_health": 20,
    "post_tokenize": 100,
    "post_experiments": 60,
    "get_experiments": 30,
    "get_experiments_name": 60,
    "delete_experiments_name": 50,
    "post_experiments_name_completions": 60,
    "post_experiments_name_feedback": 80,
    "get_experiments_name_adapter": 50,
    "post_chat_completions": 60,
    "post_completions": 60,
}
DEFAULT_EXAMPLES = 30  # an operation added later is fuzzed too
COUNTS: dict[str, int] = {}
STATUSES: dict[str, Counter] = {}
BEFORE: list[str] = []  # experiments that existed before the fuzzing

DOC = openapi_document()
COMPONENTS = DOC["components"]["schemas"]


# ------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------

HEADER_TEXT = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ", max_size=40)

LONE_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 5e-324, 2 ** 63, -2 ** 63 - 1]),
    st.text(max_size=30), st.text(alphabet=LONE_SURROGATE, max_size=3),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)


def schema_strategy(schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    """Values that (mostly) satisfy a pydantic-made JSON schema; sizes kept small."""
    if "$ref" in schema:
        return st.deferred(lambda: schema_strategy(COMPONENTS[schema["$ref"].rsplit("/", 1)[1]], depth + 1))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([schema_strategy(s, depth) for s in schema[key]])
    if "allOf" in schema:
        return schema_strategy(schema["allOf"][0], depth)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([schema_strategy({**schema, "type": k}, depth) for k in kind])
    if kind is None:
        return json_values
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(
                lambda s: lo <= len(s) <= (hi if hi is not None else 10 ** 9))
        plain = st.text(min_size=lo, max_size=max(lo, min(hi if hi is not None else 24, 24)))
        return st.one_of(*[plain] * 7, st.builds(lambda a, b: a + b, plain, LONE_SURROGATE))
    if kind == "integer":
        lo = schema.get("minimum", schema["exclusiveMinimum"] + 1 if "exclusiveMinimum" in schema else None)
        hi = schema.get("maximum", schema["exclusiveMaximum"] - 1 if "exclusiveMaximum" in schema else None)
        small_lo = lo if lo is not None else -3
        small = st.integers(small_lo, min(hi, small_lo + 1000) if hi is not None else small_lo + 1000)
        return st.one_of(small, st.integers(lo, hi))
    if kind == "number":
        if not {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(schema):
            return st.one_of(st.floats(0, 2), st.floats(allow_nan=False, allow_infinity=False))
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                         schema.get("maximum", schema.get("exclusiveMaximum")),
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "array":
        lo = schema.get("minItems", 0)
        hi = max(lo, min(schema.get("maxItems", 3), 3))
        return st.lists(schema_strategy(schema.get("items", {}), depth + 1), min_size=lo, max_size=hi)
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        fixed = st.fixed_dictionaries(
            {k: schema_strategy(v, depth + 1) for k, v in properties.items() if k in required},
            optional={k: schema_strategy(v, depth + 1) for k, v in properties.items() if k not in required})
        extra = schema.get("additionalProperties", True)
        if extra is False or depth > 3:
            return fixed
        extras = st.dictionaries(st.text(max_size=12), json_values if extra is True else schema_strategy(extra),
                                 max_size=2 if properties else 3)
        return st.builds(lambda more, known: {**more, **known}, extras, fixed)
    raise AssertionError(f"schema type {kind!r} has no strategy")


def cheapen(body: Any) -> Any:
    """A body that would sample more than CHEAP completions or tokens samples CHEAP instead (values beyond
    what the server accepts stay: they are 4xx and cost nothing)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key in ("n", "max_tokens", "max_completion_tokens", "best_of"):
        value = out.get(key)
        if isinstance(value, bool):
            continue
        try:
            number = float(value)  # pydantic takes "5" and 5.0 for an int as well
        except (TypeError, ValueError, OverflowError):
            continue
        if CHEAP < number <= 10 ** 6:
            out[key] = CHEAP
    return out


@st.composite
def mutated(draw, valid: st.SearchStrategy) -> Any:
    """A schema-made body with one field dropped, replaced by junk, or a junk field added."""
    body = draw(valid)
    if not isinstance(body, dict):
        return body
    body = dict(body)
    action = draw(st.sampled_from(["drop", "replace", "add"]))
    if body and action in ("drop", "replace"):
        key = draw(st.sampled_from(sorted(body)))
        if action == "drop":
            del body[key]
        else:
            body[key] = draw(json_values)
    else:
        body[draw(st.text(max_size=12))] = draw(json_values)
    return body


def _pack(value: Any) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return None


CONTENT_TYPES = st.sampled_from(["application/json", "application/json", "text/plain", None,
                                 "application/x-www-form-urlencoded", "application/json; charset=latin-1",
                                 "multipart/form-data; boundary=x"])


@st.composite
def encoded(draw, value: Any) -> tuple[bytes, str | None]:
    """A value as JSON (NaN allowed: the server's parser takes it) or msgpack, with a content type."""
    if draw(st.sampled_from(["json", "json", "json", "msgpack"])) == "msgpack":
        packed = _pack(value)
        if packed is not None:
            return packed, MSGPACK
    return json.dumps(value).encode(), draw(CONTENT_TYPES)


deep = st.integers(1, 100_000).map(lambda d: ("[" * d + "]" * d).encode())
deep_objects = st.integers(1, 50_000).map(lambda d: ('{"a":' * d + "1" + "}" * d).encode())
junk_bytes = st.one_of(
    st.binary(max_size=200),
    deep, deep_objects,
    st.sampled_from([b"", b"{", b"null", b"1e999", b"-", b"\xef\xbb\xbf{}", b'{"a":1}{"b":2}', b"\x00" * 10,
                     '{"prompt": "\\ud800"}'.encode(), b'{"prompt": "\xed\xa0\x80"}', "{}".encode("utf-16"),
                     b"[" * 10 ** 6]),
    st.just(b"x" * (9 * 1024 * 1024)),  # over max_body_bytes
)
msgpack_garbage = st.one_of(st.binary(max_size=200),
                            st.sampled_from([b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc1",
                                             b"\xd4\xff\x00", b"\xc7\x05\xff\x00", b"\x91" * 100_000]))


PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
HONOURED = {"model", "messages", "prompt", "n", "temperature", "top_p", "max_tokens", "max_completion_tokens",
            "stop", "seed", "logprobs"}


def _non_null(schema: dict[str, Any]) -> dict[str, Any]:
    return next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"), schema)


def _one_prompt(draw, body: dict[str, Any], model: str, allowed=PROMPT_FIELDS) -> None:
    keep = draw(st.sampled_from(allowed))
    for key in PROMPT_FIELDS:
        if key != keep:
            body.pop(key, None)
    if body.get(keep) is None:
        body[keep] = draw(schema_strategy(_non_null(COMPONENTS[model]["properties"][keep])))
    if keep == "prompt_token_ids" and draw(st.booleans()):
        body[keep] = draw(st.lists(st.integers(0, 2000), min_size=1, max_size=8))  # in the vocabulary


def _one_of_text_or_ids(draw, completion: Any) -> Any:
    if isinstance(completion, dict):
        completion.pop(draw(st.sampled_from(["text", "token_ids"])), None)
        if "text" not in completion and "token_ids" not in completion:
            completion["text"] = draw(st.text(min_size=1, max_size=12))
    return completion


@st.composite
def shaped(draw, model: str, group_ids: list[str]) -> Any:
    """A body of `model` from its schema, then fitted to the rules between fields that a JSON schema does
    not say (exactly one prompt; a group's feedback or external completions; OpenAI's neutral values), so
    that many reach the orchestrator and the sampler."""
    body = draw(schema_strategy(COMPONENTS[model]))
    if not isinstance(body, dict) or draw(st.sampled_from(["shape", "shape", "shape", "as is"])) == "as is":
        return body  # as the schema made it, now and then
    body = dict(body)
    if model == "CompletionsRequest":
        _one_prompt(draw, body, model)
    elif model == "TokenizeRequest":
        _one_prompt(draw, body, model, ("prompt", "messages"))
        if "prompt" in body:
            body.pop("continue_from", None)
    elif model == "FeedbackRequest":
        if draw(st.booleans()):
            for key in PROMPT_FIELDS + ("completions",):
                body.pop(key, None)
            body["group_id"] = draw(st.one_of(st.sampled_from(group_ids), st.text(max_size=20)))
            extra = [_one_of_text_or_ids(draw, c) for c in body.get("extra_completions") or []]
            body["extra_completions"] = extra or None
        else:
            body.pop("group_id", None)
            body.pop("extra_completions", None)
            _one_prompt(draw, body, model)
            completions = [_one_of_text_or_ids(draw, c) for c in (body.get("completions") or [{}, {}])]
            body["completions"] = completions
            body["rewards"] = (body["rewards"] * len(completions))[:len(completions)]
    elif model in ("ChatCompletionRequest", "CompletionRequest"):
        for key in list(body):  # the others are mostly rejected unless neutral: keep a few
            if key not in HONOURED and draw(st.sampled_from(["drop", "drop", "drop", "keep"])) == "drop":
                del body[key]
        body["model"] = draw(st.sampled_from([FUZZ_EXP, FUZZ_EXP, FUZZ_EXP, body.get("model", "")]))
        if model == "CompletionRequest":
            if isinstance(body.get("logprobs"), int) and draw(st.booleans()):
                body["logprobs"] = draw(st.sampled_from([0, 1, None]))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) > 1 and draw(st.booleans()):
                body["prompt"] = prompt[:1]
    return {k: v for k, v in body.items() if v is not None} if draw(st.booleans()) else body


def body_strategy(endpoint: Endpoint, operation: dict[str, Any], group_ids: list[str]) -> st.SearchStrategy:
    """(bytes or None, content type or None)."""
    junk = st.one_of(
        json_values.flatmap(encoded),
        st.tuples(junk_bytes, CONTENT_TYPES),
        st.tuples(msgpack_garbage, st.just(MSGPACK)),
    )
    if endpoint.request is None:  # a GET or DELETE: usually no body, sometimes junk
        return st.sampled_from(["none", "none", "none", "junk"]).flatmap(
            lambda kind: st.just((None, None)) if kind == "none" else junk)
    model = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    valid = shaped(model, group_ids)
    kinds = {"valid": valid.map(cheapen).flatmap(encoded), "mutated": mutated(valid).map(cheapen).flatmap(encoded),
             "junk": junk}
    return st.sampled_from(["valid", "valid", "valid", "mutated", "junk"]).flatmap(kinds.__getitem__)


OTHER_NAMES = st.one_of(st.just("no-such-experiment"), st.from_regex(r"^[a-z0-9_-]{1,64}$", fullmatch=True),
                        st.text(max_size=80)).filter(lambda n: n not in (".", "..", FUZZ_EXP))
# ("." and ".." are not names: the URL's dot segments take the request to another route.)


@st.composite
def experiment_name(draw, endpoint: Endpoint) -> str:
    """Mostly the fuzzed experiment (never for DELETE), else any name."""
    if endpoint.method != "DELETE" and draw(st.sampled_from(["target", "target", "target", "any"])) == "target":
        return FUZZ_EXP
    return draw(OTHER_NAMES)


def query_strategy(operation: dict[str, Any]) -> st.SearchStrategy[str]:
    declared = [p["name"] for p in operation.get("parameters", []) if p["in"] == "query"]
    values = st.one_of(st.integers(-3, 3).map(str), st.integers().map(str), st.text(max_size=20))
    pairs = st.lists(st.tuples(st.sampled_from(declared) if declared else st.text(max_size=8), values),
                     max_size=2)
    extra = st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=2)
    encoded_query = st.builds(lambda a, b: urllib.parse.urlencode(a + b), pairs, extra)
    raw = st.text(alphabet=string.ascii_letters + string.digits + "%&=;+-_.~[]", max_size=30)
    return st.one_of(st.just(""), encoded_query, encoded_query, raw)


BAD_AUTH = st.one_of(
    st.just({}),
    st.just({"Authorization": "Bearer wrong-key"}),
    HEADER_TEXT.map(lambda token: {"Authorization": f"Bearer {token}"}),
    HEADER_TEXT.map(lambda value: {"Authorization": value}),
)


@st.composite
def auth(draw) -> dict[str, str]:
    """Mostly the admin key, so that the body is looked at; the experiment's key; no key or a bad one."""
    pick = draw(st.sampled_from(["admin"] * 7 + ["own", "bad", "bad"]))
    if pick == "admin":
        return {"Authorization": f"Bearer {ADMIN_KEY}"}
    if pick == "own":
        return {"Authorization": f"Bearer {FUZZ_KEY}"}
    return draw(BAD_AUTH)


@dataclass
class Case:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes | None = None

    def __repr__(self) -> str:  # hypothesis prints the falsifying case: keep a 9 MiB body short
        data = None if self.data is None else (self.data[:300] + b"..." if len(self.data) > 300 else self.data)
        return f"Case({self.method} {self.path!r}, headers={self.headers!r}, data={data!r})"


@st.composite
def cases(draw, endpoint: Endpoint, operation: dict[str, Any], group_ids: list[str]) -> Case:
    path = endpoint.path
    if "{name}" in path:
        path = path.replace("{name}", urllib.parse.quote(draw(experiment_name(endpoint)), safe=""))
    query = draw(query_strategy(operation))
    headers = draw(auth())
    data, content_type = draw(body_strategy(endpoint, operation, group_ids))
    if content_type is not None:
        headers["Content-Type"] = content_type
    if draw(st.sampled_from(["json", "json", "json", "msgpack"])) == "msgpack":
        headers["Accept"] = MSGPACK
    return Case(endpoint.method, path + (f"?{query}" if query else ""), headers, data)


