"""POST /v1/responses (the OpenAI Responses API) with the official `openai` package against the real server on
the tiny model, and an OpenAI Agents SDK agent on its default model (`OpenAIResponsesModel`) pointed at the
server with `set_default_openai_client`: plain and streamed responses checked against `openai.types.responses`
strictly, the prompt equal to the chat route's, function calls and their outputs round-tripped, episodes with the
drift-free reuse of sampled ids, previous_response_id, the 400s; and the pure parts (conversions, the store).
The tiny random model writes garbage unless constrained, so only forced calls (tool_choice required, an enum
argument) are asserted on content."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from grpo_server.api.openai.responses_items import items_to_messages
from grpo_server.api.openai.responses_models import Echo
from grpo_server.api.openai.responses_store import ResponseStore, StoredResponse
from grpo_server.api.openai.responses_stream import body_events
from grpo_server.api_models import ChatMessage, CompletionOut, CompletionsResponse
from grpo_server.client import AsyncClient, GrpoServerError
from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.wire import ToolCall

CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                          "required": ["city"], "additionalProperties": False}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
FORCED = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 96}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
async def experiment(client: AsyncClient):
    name = f"responses-{uuid.uuid4().hex[:8]}"
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1},
                                    "sampling": {"n": 2, "max_tokens": 8, "temperature": 1.0}})
    yield name
    await client.delete_experiment(name)


def openai_client(server, **headers: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300,
                              default_headers=headers or None)


async def create(oai: openai.AsyncOpenAI, **kwargs) -> Response:
    """The answer checked against the `openai` package's own model, strictly (the SDK parses leniently)."""
    raw = await oai.responses.with_raw_response.create(**kwargs)
    Response.model_validate(json.loads(raw.http_response.text))
    return raw.parse()


def extra(response: Response) -> dict[str, Any]:
    return response.model_extra or {}


def only_call(response: Response):
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", response.output
    assert json.loads(calls[0].arguments)["city"] in CITIES and calls[0].call_id and calls[0].id.startswith("fc_")
    return calls[0]


# ------------------------------------------------------------------------------------------------
# Pure: the conversions and the store
# ------------------------------------------------------------------------------------------------

ECHO = dict(model="exp", instructions=None, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=True,
            temperature=1.0, top_p=1.0, max_output_tokens=8, previous_response_id=None, store=True, metadata={},
            user=None, truncation="disabled", logprobs=False)
CALLED = CompletionOut(text='Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
                       token_ids=[5, 6, 7], logprobs=[-1.0, -0.5, -0.1], finish_reason="tool_calls", content="Sure",
                       tool_calls=[ToolCall(id="call_a", name="get_weather", arguments='{"city": "Rome"}')])


def test_answer_parses_as_openai_response_and_reads_back_as_the_reply():
    result = CompletionsResponse(group_id=None, episode_id="ep-1", policy_version=3, prompt_token_ids=[1, 2],
                                 completions=[CALLED])
    body = json.loads(Echo(**ECHO).answer(result, None).model_dump_json())
    parsed = Response.model_validate(body)
    assert [item.type for item in parsed.output] == ["message", "function_call"]
    assert parsed.output_text == "Sure" and parsed.status == "completed" and parsed.id.startswith("resp_")
    assert parsed.usage.input_tokens == 2 and parsed.usage.output_tokens == 3 and parsed.usage.total_tokens == 5
    assert body["episode_id"] == "ep-1" and body["group_id"] is None and body["token_ids"] == [5, 6, 7]
    # What a client sends back is the one assistant turn the episode remembers (runtime/episodes.reply_key).
    messages = items_to_messages([item.model_dump() for item in parsed.output])
    assert len(messages) == 1 and messages[0].role == "assistant" and messages[0].content == "Sure"
    assert [(c.id, c.function.name) for c in messages[0].tool_calls] == [("call_a", "get_weather")]


def test_cut_output_is_incomplete_and_streams_with_every_event_type():
    cut = CompletionOut(text="abc", token_ids=[1, 2, 3], logprobs=[-1.0] * 3, finish_reason="length")
    result = CompletionsResponse(group_id="grp_1", policy_version=0, prompt_token_ids=[9], completions=[cut, CALLED])
    answer = Echo(**{**ECHO, "logprobs": True}).answer(result, {1: "a", 2: "b", 3: "c", 5: "x", 6: "y", 7: "z"})
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output[0].content[0].logprobs[1].token == "b" and len(answer.samples) == 2
    events = [json.loads(e.model_dump_json()) for e in body_events(answer, lambda ids: "".join("_abc"[i] for i in ids))]
    for event in events:
        EVENTS.validate_python(event)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "abc" and [len(e["logprobs"]) for e in deltas] == [1, 1, 1]
    assert events[-1]["type"] == "response.incomplete"


def test_unsupported_items_are_400s_naming_their_type():
    for item, kind in [({"type": "reasoning", "id": "rs_1", "summary": []}, "reasoning"),
                       ({"type": "web_search_call", "id": "ws_1"}, "web_search_call"),
                       ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
                       ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input_file")]:
        with pytest.raises(BadRequest) as info:
            items_to_messages([USER, item])
        assert kind in info.value.message and "input.1" in info.value.message


def test_store_is_bounded_expires_and_keeps_experiments_apart():
    store = ResponseStore(per_experiment=2, total=3, ttl_s=10.0)
    message, now = (ChatMessage(role="user", content="hi"),), time.monotonic()
    for i, experiment in enumerate(["a", "a", "a", "b", "b"]):
        store.put(f"r{i}", StoredResponse(experiment, 1.0, message, stored_at=now + i / 1000))
    assert store.count("a") == 1 and store.count("b") == 2 and len(store) == 3  # a's oldest went, then the total's
    for experiment, incarnation, response_id in [("a", 1.0, "r0"), ("b", 1.0, "r2"), ("a", 2.0, "r2")]:
        with pytest.raises(BadRequest) as info:  # dropped, another experiment's, a predecessor's
            store.get(experiment, incarnation, response_id)
        assert info.value.code == "previous_response_not_found"
    assert store.get("a", 1.0, "r2").messages == message and len(store) == 3
    store._expire(now + 10.01)  # r2, r3 and r4 are over 10 s old
    assert len(store) == 0 and store.count("b") == 0


# ------------------------------------------------------------------------------------------------
# Over HTTP with the openai package
# ------------------------------------------------------------------------------------------------


async def test_response_is_a_group_rated_like_any_and_renders_as_chat(server, client, experiment, tokenizer):
    async with openai_client(server) as oai:
        one = await create(oai, model=experiment, input="Sky colour?", instructions="Answer in one word.",
                           max_output_tokens=4, metadata={"task": "sky"})
        chat = await oai.chat.completions.create(model=experiment, n=1, max_tokens=1, messages=[
            {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}])
        group = await create(oai, model=experiment, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Sky colour?"}]}], max_output_tokens=4, extra_body={"n": 2})
    assert extra(one)["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]  # the chat path's rendering
    assert one.model == experiment and one.metadata == {"task": "sky"} and one.instructions == "Answer in one word."
    assert one.usage.input_tokens == len(extra(one)["prompt_token_ids"])
    assert one.usage.output_tokens == len(extra(one)["token_ids"]) <= 4
    assert one.status in ("completed", "incomplete") and (one.status == "incomplete") == (
        one.incomplete_details is not None and one.incomplete_details.reason == "max_output_tokens")
    assert one.output_text == tokenizer.decode(extra(one)["token_ids"], skip_special_tokens=True)
    assert extra(one)["group_id"] and extra(one)["samples"] is None
    samples = extra(group)["samples"]
    assert len(samples) == 2 and samples[0]["token_ids"] == extra(group)["token_ids"]
    assert group.usage.output_tokens == sum(len(s["token_ids"]) for s in samples)
    assert (await client.feedback(experiment, extra(group)["group_id"], [1.0, 0.0])).accepted


async def test_function_call_round_trip_in_an_episode_reuses_the_sampled_ids(server, client, experiment, tokenizer):
    episode = f"resp-ep-{uuid.uuid4().hex[:8]}"
    async with openai_client(server, **{"X-Episode-Id": episode}) as oai:
        first = await create(oai, model=experiment, input=[USER], **FORCED)
        call = only_call(first)
        replay = [USER, *[item.model_dump() for item in first.output],
                  {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
        second = await create(oai, model=experiment, input=replay, tools=[WEATHER], tool_choice="none",
                              max_output_tokens=4)
    assert extra(first)["episode_id"] == episode and extra(first)["group_id"] is None
    before = extra(first)["prompt_token_ids"] + extra(first)["token_ids"]
    assert extra(second)["prompt_token_ids"][:len(before)] == before  # no re-rendering of the model's call
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in tokenizer.decode(extra(second)["prompt_token_ids"])
    partner = client.episode(experiment)
    await client.complete(experiment, messages=[USER], episode_id=partner, max_tokens=2)
    assert (await client.rate_episodes(experiment, [episode, partner], [1.0, 0.0])).accepted


async def test_previous_response_id_continues_and_store_false_does_not(server, client, experiment, tokenizer):
    episode = f"resp-prev-{uuid.uuid4().hex[:8]}"
    async with openai_client(server) as oai:
        first = await create(oai, model=experiment, input=[USER], instructions="Use tools.",
                             extra_body={"episode_id": episode}, **FORCED)
        call = only_call(first)
        second = await create(oai, model=experiment, previous_response_id=first.id, instructions="Use tools.",
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
                              tools=[WEATHER], max_output_tokens=4, extra_body={"episode_id": episode})
        plain = await create(oai, model=experiment, input="Hello there", store=False, max_output_tokens=2)
        errors = []
        for previous in (plain.id, "resp_unknown"):
            with pytest.raises(openai.BadRequestError) as info:
                await oai.responses.create(model=experiment, previous_response_id=previous, input="More?")
            errors.append(info.value.code)
    assert second.previous_response_id == first.id
    before = extra(first)["prompt_token_ids"] + extra(first)["token_ids"]
    assert extra(second)["prompt_token_ids"][:len(before)] == before
    assert "sunny" in tokenizer.decode(extra(second)["prompt_token_ids"][len(before):])
    assert errors == ["previous_response_not_found"] * 2
    other = f"responses-other-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": other, "sampling": {"n": 2, "max_tokens": 4}})
    try:
        async with openai_client(server) as oai:
            with pytest.raises(openai.BadRequestError) as info:  # another experiment's response: not found
                await oai.responses.create(model=other, previous_response_id=first.id, input="More?")
        assert info.value.code == "previous_response_not_found"
    finally:
        await client.delete_experiment(other)


async def test_streamed_text_and_call_events(server, experiment):
    async with openai_client(server) as oai:
        stream = await oai.responses.create(model=experiment, input="Tell me a story", max_output_tokens=6,
                                            stream=True)
        events = [event async for event in stream]
        async with oai.responses.stream(model=experiment, input=[USER], **FORCED) as called:
            call_events = [event async for event in called]
            final = await called.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    last = events[-1].response
    assert types[-1] == ("response.incomplete" if last.status == "incomplete" else "response.completed")
    assert events[0].response.status == "in_progress" and events[0].response.id == last.id
    assert (events[0].response.model_extra or {}).get("group_id") == last.model_extra["group_id"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == last.output_text
    call = only_call(final)
    call_types = [e.type for e in call_events]
    assert "response.function_call_arguments.delta" in call_types and call_types[-1] == "response.completed"
    done = next(e for e in call_events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and final.status == "completed"


@pytest.mark.parametrize("kwargs, code", [
    ({"extra_body": {"frobnicate": 1}}, "unknown_parameter"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "unsupported_item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "unsupported_content"),
    ({"tools": [{"type": "web_search"}]}, "unsupported_tool"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "unsupported_tool_choice"),
    ({"text": {"format": {"type": "json_object"}}}, "unsupported_parameter"),
    ({"top_logprobs": 3}, "unsupported_parameter"),
    ({"conversation": "conv_1"}, "unsupported_parameter"),
    ({"background": True}, "unsupported_parameter"),
    ({"input": []}, "empty_input"),
    ({"tool_choice": "required"}, "tools_missing"),
])
async def test_bad_requests_are_400s(server, experiment, kwargs, code):
    async with openai_client(server) as oai:
        with pytest.raises(openai.BadRequestError) as info:
            await oai.responses.create(model=experiment, **{"input": "Hi", "max_output_tokens": 2, **kwargs})
    assert info.value.code == code and info.value.message


async def test_schema_errors_are_422s(server, experiment):
    async with openai_client(server) as oai:
        for kwargs in ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},  # no call_id
                       {"input": "Hi", "temperature": 5.0}):
            with pytest.raises(openai.UnprocessableEntityError):
                await oai.responses.create(model=experiment, max_output_tokens=2, **kwargs)


# ------------------------------------------------------------------------------------------------
# The OpenAI Agents SDK on its default model (the Responses API)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def default_client(server, monkeypatch):
    """The SDK's default client pointed at the server (restored after); its tracing exporter must never send."""
    from agents import set_default_openai_client, set_tracing_disabled
    from agents.models import _openai_shared
    from agents.tracing import processors

    def export(self, items):
        raise AssertionError(f"the Agents SDK tried to export {len(items)} trace items to OpenAI")

    monkeypatch.setattr(processors.BackendSpanExporter, "export", export)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    set_tracing_disabled(True)
    before = _openai_shared.get_default_openai_client()
    llm = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=100, timeout=300)
    set_default_openai_client(llm, use_for_tracing=False)
    yield llm
    _openai_shared.set_default_openai_client(before)


async def test_agents_sdk_default_model_streams_tool_turns_as_episodes_that_train(client, experiment,
                                                                                  default_client):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.agent import ToolsToFinalOutputResult
    from agents.models.openai_responses import OpenAIResponsesModel
    from agents.models.multi_provider import MultiProvider

    assert isinstance(MultiProvider().get_model(experiment), OpenAIResponsesModel)  # the default, unchanged
    ran: list[str] = []

    @function_tool
    def weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city.

        Args:
            city: The city.
        """
        ran.append(city)
        return f"18 C in {city}"

    async def run(episode) -> tuple[list[str], list]:
        calls = []

        def two_calls(context, results) -> ToolsToFinalOutputResult:  # two forced turns, then done
            calls.extend(results)
            return ToolsToFinalOutputResult(is_final_output=len(calls) >= 2, final_output=str(results[-1].output))

        agent = Agent(name="weather", instructions="Answer with the weather tool.", model=experiment, tools=[weather],
                      tool_use_behavior=two_calls, reset_tool_choice=False, model_settings=ModelSettings(
                          temperature=1.0, max_tokens=96, tool_choice="required", parallel_tool_calls=False,
                          extra_body={"episode_id": episode.id}))
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3, run_config=RunConfig(
            tracing_disabled=True))
        kinds = [event.data.type async for event in result.stream_events() if event.type == "raw_response_event"]
        return kinds, result.raw_responses

    before = (await client.status(experiment)).counters
    episodes = [client.episode(experiment) for _ in range(2)]
    runs = await asyncio.wait_for(asyncio.gather(*(run(e) for e in episodes)), timeout=240)
    for kinds, responses in runs:
        assert len(responses) == 2 and all(r.response_id.startswith("resp_") for r in responses)
        assert kinds.count("response.completed") == 2 and "response.function_call_arguments.delta" in kinds
    assert len(ran) == 4 and set(ran) <= set(CITIES)
    status = await client.status(experiment)
    assert status.counters.episode_turns - before.episode_turns == 4
    assert status.counters.episodes_started - before.episodes_started == 2 and status.pending_episodes == 2

    answer = await client.rate_episodes(experiment, episodes, [1.0, 0.0])
    assert answer.accepted and answer.skipped is None, answer
    with pytest.raises(GrpoServerError) as again:
        await client.rate_episodes(experiment, episodes, [1.0, 0.0])
    assert again.value.status == 409
    for _ in range(240):  # batch_groups 1: this group is a train step
        status = await client.status(experiment)
        if status.counters.groups_trained > before.groups_trained:
            break
        await asyncio.sleep(1)
    assert status.counters.groups_trained == before.groups_trained + 1 and status.step >= 1, status


async def test_tool_errors_of_a_stream_come_before_it(server, experiment):
    async with openai_client(server) as oai:
        for kwargs, code in (({"tool_choice": "required"}, "tools_missing"),
                             ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
                              "unknown_tool")):
            with pytest.raises(openai.BadRequestError) as info:  # a plain JSON 400, not response.failed
                await oai.responses.create(model=experiment, input="Hi", stream=True, **kwargs)
            assert info.value.code == code
