"""POST /v1/responses against the Open Responses specification, version 2026-04-24: every answer of the route, on
the real server with the tiny model, validated with jsonschema against the spec's published OpenAPI document,
which the `openresponses-py` package ships as `openresponses/openapi/2026-04-24.json` (a dev dependency, pinned
in constraints.txt). A plain answer against `ResponseResource`, each streamed event against the schema of its
type in the spec's event union (an event type the spec lacks fails), an error against `ErrorPayload`; for plain
text input, instructions, two multi-turn forms, function tools, streams of text and of a call, and refusals (an
image part on this text model, background mode, penalties). The events the server cannot be made to send here
(`response.failed`, `response.incomplete`) are built from the same code and validated too."""

from __future__ import annotations

import importlib.metadata
import json
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from jsonschema import Draft202012Validator

from grpo_server.api.openai.responses_models import Echo, FunctionTool, ResponseError
from grpo_server.api.openai.responses_stream import ResponseLifecycleEvent, body_events
from grpo_server.api_models import CompletionOut, CompletionsResponse
from grpo_server.client import AsyncClient

SPEC_VERSION = "2026-04-24"
SPEC_PACKAGE = "openresponses-py"


def _spec() -> dict[str, Any]:
    """The spec's OpenAPI document, read from the pinned package's files (importing it is not needed)."""
    path = Path(str(importlib.metadata.distribution(SPEC_PACKAGE).locate_file(
        f"openresponses/openapi/{SPEC_VERSION}.json")))
    document = json.loads(path.read_text())
    assert document["info"] == {"title": "Open Responses", "version": SPEC_VERSION}, document["info"]
    return document


SPEC = _spec()


def _validator(schema: dict[str, Any]) -> Draft202012Validator:
    """`schema` with the spec's components beside it, so its `#/components/schemas/...` refs resolve."""
    return Draft202012Validator({**schema, "components": SPEC["components"]})


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


RESOURCE = _validator(_ref("ResponseResource"))
ERROR = _validator(_ref("ErrorPayload"))
_STREAM = SPEC["paths"]["/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
# Each event type of the spec's union (`oneOf`, discriminated by `type`) and the schema of its events.
EVENTS = {SPEC["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["enum"][0]:
          _validator(ref) for ref in _STREAM["oneOf"]}
RESOURCE_EVENTS = ("response.created", "response.in_progress", "response.completed", "response.incomplete",
                   "response.failed")


def conforms(validator: Draft202012Validator, instance: Any) -> None:
    """Fails naming each place where `instance` breaks the spec (the first ten)."""
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
                                 for e in errors[:10])


def event_conforms(event: dict[str, Any]) -> None:
    assert event.get("type") in EVENTS, f"an event type the spec does not have: {event.get('type')!r}"
    conforms(EVENTS[event["type"]], event)


CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                          "required": ["city"], "additionalProperties": False}}
BARE = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}  # no
# description, no strict: echoed as null
USER = {"role": "user", "content": "What is the weather in Paris?"}


# ------------------------------------------------------------------------------------------------
# Pure: the terminal events the server sends only on a failure or a cut
# ------------------------------------------------------------------------------------------------

ECHO = dict(model="exp", instructions=None, tools=[FunctionTool(**BARE)], tool_choice="auto",
            parallel_tool_calls=True, temperature=1.0, top_p=1.0, max_output_tokens=8, previous_response_id=None,
            store=True, metadata={}, user=None, truncation="disabled", logprobs=True)


def test_a_cut_answer_and_a_failed_stream_conform():
    cut = CompletionOut(text="abc", token_ids=[1, 2, 3], logprobs=[-1.0] * 3, finish_reason="length")
    result = CompletionsResponse(group_id="grp_1", policy_version=0, prompt_token_ids=[9], completions=[cut])
    echo = Echo(**ECHO)
    answer = echo.answer(result, {1: "a", 2: "b", 3: "c"})
    events = [json.loads(e.model_dump_json())
              for e in body_events(answer, lambda ids: "".join("_abc"[i] for i in ids))]  # ids 1, 2, 3: a, b, c
    assert events[-1]["type"] == "response.incomplete"
    for event in events:
        event_conforms(event)
    failed = echo.skeleton("grp_1", None).model_copy(update={
        "status": "failed", "error": ResponseError(code="worker_error", message="sampler-0: out of memory")})
    event_conforms(json.loads(ResponseLifecycleEvent(type="response.failed", sequence_number=3,
                                                     response=failed).model_dump_json()))


# ------------------------------------------------------------------------------------------------
# Over HTTP, as the spec's compliance suite would call it
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def experiment(server):
    name = f"open-responses-{uuid.uuid4().hex[:8]}"
    async with AsyncClient(server.url, server.api_key) as client:
        await client.create_experiment({"name": name, "sampling": {"n": 2, "max_tokens": 8, "temperature": 1.0}})
        yield name
        await client.delete_experiment(name)


@pytest.fixture
async def post(server, experiment):
    """POST /v1/responses with `fields` (and the experiment as `model`): (status, the JSON body or the events)."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {server.api_key}"}) as session:

        async def call(**fields: Any) -> tuple[int, Any]:
            async with session.post(f"{server.url}/v1/responses", json={"model": experiment, **fields}) as answer:
                if answer.content_type == "text/event-stream":
                    return answer.status, sse_events(await answer.text())
                return answer.status, await answer.json()

        yield call


def sse_events(text: str) -> list[dict[str, Any]]:
    """The events of a stream, each `event: <type>` then `data: <JSON>` whose `type` is the same."""
    found = []
    for block in text.strip("\n").split("\n\n"):
        lines = [line for line in block.split("\n") if not line.startswith(":")]  # `: ping` comments
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        event = json.loads(lines[1][len("data: "):])
        assert event["type"] == lines[0][len("event: "):], block
        found.append(event)
    return found


async def answered(post, **fields: Any) -> dict[str, Any]:
    """A plain (not streamed) answer, which must conform (at most 4 tokens unless `fields` say)."""
    status, body = await post(**{"max_output_tokens": 4, **fields})
    assert status == 200, body
    conforms(RESOURCE, body)
    return body


async def test_plain_text_answer_conforms_and_echoes_what_it_used(post):
    body = await answered(post, input="Sky colour?", safety_identifier="user-7", prompt_cache_key="sky",
                          max_tool_calls=3, service_tier="flex", presence_penalty=0, top_logprobs=0)
    assert body["status"] in ("completed", "incomplete") and body["output"][0]["type"] == "message"
    assert (body["presence_penalty"], body["frequency_penalty"], body["top_logprobs"]) == (0, 0, 0)
    assert (body["background"], body["service_tier"]) == (False, "default")  # the one tier served, whatever asked
    assert (body["safety_identifier"], body["prompt_cache_key"], body["max_tool_calls"]) == ("user-7", "sky", 3)
    bare = await answered(post, input="Sky colour?")
    assert (bare["safety_identifier"], bare["prompt_cache_key"], bare["max_tool_calls"]) == (None, None, None)


async def test_instructions_answer_conforms(post):
    body = await answered(post, instructions="Answer in one word.", input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sky colour?"}]}])
    assert body["instructions"] == "Answer in one word."


async def test_multi_turn_answers_conform(post):
    first = await answered(post, input="Name a colour.")
    second = await answered(post, previous_response_id=first["id"], input="Another one.")
    assert second["previous_response_id"] == first["id"]
    replayed = await answered(post, input=[{"role": "user", "content": "Name a colour."}, *first["output"],
                                           {"role": "user", "content": "Another one."}])
    assert replayed["previous_response_id"] is None


async def test_function_tool_answer_conforms_and_echoes_tools_whole(post):
    body = await answered(post, input=[USER], tools=[WEATHER, BARE], tool_choice="required",
                          parallel_tool_calls=False, max_output_tokens=96)
    assert "function_call" in [item["type"] for item in body["output"]], body["output"]
    assert body["tools"] == [WEATHER, {**BARE, "description": None, "strict": None}]


async def test_streamed_events_conform_each_to_its_type(post):
    status, text_events = await post(input="Tell me a story", max_output_tokens=6, stream=True)
    assert status == 200
    status, call_events = await post(input=[USER], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=96, stream=True)
    assert status == 200
    for events in (text_events, call_events):
        for event in events:
            event_conforms(event)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        types = [e["type"] for e in events]
        assert types[:2] == ["response.created", "response.in_progress"]
        assert types[-1] in ("response.completed", "response.incomplete")
        resources = [e["response"] for e in events if e["type"] in RESOURCE_EVENTS]
        assert len(resources) == 3 and len({r["id"] for r in resources}) == 1
    assert "response.output_text.delta" in [e["type"] for e in text_events]
    assert "response.function_call_arguments.done" in [e["type"] for e in call_events]


@pytest.mark.parametrize("fields, status, code, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png",
                                              "detail": "auto"}]}]}, 400, "unsupported_content", "input.0.content.0"),
    ({"input": "Hi", "background": True}, 400, "unsupported_parameter", "background"),
    ({"input": "Hi", "presence_penalty": 0.5}, 400, "unsupported_parameter", "presence_penalty"),
    ({"input": "Hi", "frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    ({"input": "Hi", "temperature": 5.0}, 422, "invalid_request", "temperature"),
])
async def test_refusals_are_the_spec_error_payload(post, fields, status, code, param):
    got, body = await post(**fields)
    assert got == status and set(body) == {"error"}, body
    conforms(ERROR, body["error"])
    assert (body["error"]["code"], body["error"]["param"], body["error"]["type"]) == (
        code, param, "invalid_request_error"), body
    if code == "unsupported_content":  # a text model: said plainly
        assert "input_image" in body["error"]["message"] and "text only" in body["error"]["message"], body
