"""POST /v1/messages and /v1/messages/count_tokens (the Anthropic Messages API) with the official `anthropic`
package against the real server on the tiny model: plain and streamed messages (the events checked in order, the
text deltas adding up to the text), a tool round trip in an episode with the drift-free reuse of sampled ids and a
train step from it, count_tokens against the prompt a call samples from, keys as `x-api-key` or bearer, errors in
the Messages API's shape, the refusals; a pydantic-ai agent on its Anthropic model whose episode trains a step; the
guide's block; and the pure parts (conversions, the events as the SDK accumulates them). The tiny random model
writes garbage unless constrained, so only forced calls (tool_choice any or tool, an enum argument) are asserted
on content."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any, Literal

import aiohttp
import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message
from pydantic import BaseModel

from grpo_server.api.anthropic.convert import chat_history, message_answer, to_sample
from grpo_server.api.anthropic.models import MessagesRequest
from grpo_server.api.anthropic.routes import matched_stop
from grpo_server.api.anthropic.streaming import body_events
from grpo_server.api_models import ChatMessage, CompletionOut, CompletionsResponse
from grpo_server.client import AsyncClient, GrpoServerError
from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.wire import ToolCall
from tests.serving import ADMIN_KEY

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "anthropic.md"
CITIES = ["Paris", "Rome", "Oslo"]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                            "required": ["city"]}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "max_tokens": 96}
OTHER_KEY = "key-anthropic-other-7c1e"


# ------------------------------------------------------------------------------------------------
# Pure: the conversions and the events
# ------------------------------------------------------------------------------------------------


def _request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "exp", "max_tokens": 8, "messages": [USER], **fields})


def test_history_is_the_chat_paths_messages():
    body = _request(system=[{"type": "text", "text": "Use tools."}, {"type": "text", "text": "Be brief."}],
                    messages=[USER, {"role": "assistant", "content": [
                        {"type": "text", "text": "Let me see."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                              {"role": "user", "content": [
                                  {"type": "tool_result", "tool_use_id": "toolu_1",
                                   "content": [{"type": "text", "text": "18 C"}], "cache_control": {"type": "x"}},
                                  {"type": "text", "text": "And Rome?"}]}])
    assert chat_history(body) == [
        ChatMessage(role="system", content="Use tools.\nBe brief."),
        ChatMessage(role="user", content=USER["content"]),
        ChatMessage.model_validate({"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
        ChatMessage(role="tool", content="18 C", tool_call_id="toolu_1"),
        ChatMessage(role="user", content="And Rome?")]
    sample = to_sample(_request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather",
                                                              "disable_parallel_tool_use": True},
                                stop_sequences=["\n\n"], temperature=0.5, metadata={"user_id": "u1"}))
    assert sample.n == 1 and sample.stop == ["\n\n"] and sample.parallel_tool_calls is False
    assert sample.tool_choice.function == {"name": "get_weather"}
    assert sample.tools[0].function.parameters == WEATHER["input_schema"]
    assert to_sample(_request(tools=[WEATHER], tool_choice={"type": "any"})).tool_choice == "required"


@pytest.mark.parametrize("fields, code", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "unsupported_content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "unsupported_content"),
    ({"messages": [USER, {"role": "assistant", "content": "The weather is"}]}, "unsupported_prefill"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "unsupported_tool"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "unsupported_tool_choice"),
    ({"top_k": 5}, "unsupported_parameter"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "unsupported_parameter"),
    ({"system": [{"type": "image"}]}, "unsupported_content"),
])
def test_what_cannot_be_honoured_is_a_400(fields, code):
    with pytest.raises(ApiError) as info:
        to_sample(_request(**fields))
    assert (info.value.status, info.value.code) == (400, code)


def test_error_shape_by_status():
    kinds = {status: ApiError("x", status=status).anthropic_body()["error"]["type"]
             for status in (400, 401, 403, 404, 409, 413, 422, 429, 500, 502, 503)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                     422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 502: "api_error",
                     503: "overloaded_error"}
    assert ApiError("x", code="c").anthropic_body() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "x", "code": "c"}}


def test_the_stop_sequence_that_matched_is_named():
    pieces = {1: "Sky", 2: " is", 3: "\n\nblue", 4: ""}  # 4: an end-of-turn token

    class Prompts:  # what matched_stop reads of a PromptBuilder
        class tokenizer:  # noqa: N801
            @staticmethod
            def decode(ids: list[int], skip_special_tokens: bool) -> str:
                return "".join(pieces[i] for i in ids)

    cut = CompletionOut(text="Sky is", token_ids=[1, 2, 3], logprobs=[0.0] * 3, finish_reason="stop")
    ended = CompletionOut(text="Sky is", token_ids=[1, 2, 4], logprobs=[0.0] * 3, finish_reason="stop")
    assert matched_stop(Prompts, cut, ["END", "\n\n"]) == "\n\n"
    assert matched_stop(Prompts, ended, ["\n\n"]) is None
    answer = message_answer("exp", CompletionsResponse(group_id="g", policy_version=0, prompt_token_ids=[1],
                                                       completions=[cut]), "\n\n")
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", "\n\n")


def _accumulated(events: list[BaseModel]) -> Any:
    """The message the `anthropic` package's own stream accumulator makes of these events."""
    snapshot, buffers = None, {}
    for event in events:
        snapshot = accumulate_event(event=json.loads(event.model_dump_json()), current_snapshot=snapshot,
                                    json_bufs=buffers)
    return snapshot


def test_events_accumulate_to_the_plain_answer():
    texts = {1: "Sky", 2: " is", 3: " blue", 4: ""}  # 4: an end-of-turn token, which adds no text
    decode = lambda ids: "".join(texts[i] for i in ids)  # noqa: E731
    said = CompletionOut(text="Sky is blue", token_ids=[1, 2, 3, 4], logprobs=[-1.0] * 4, finish_reason="stop")
    called = CompletionOut(text='Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
                           token_ids=[5, 6], logprobs=[-1.0, -0.5], finish_reason="tool_calls", content="Sure",
                           tool_calls=[ToolCall(id="chatcmpl-tool-ab12", name="get_weather",
                                                arguments='{"city": "Rome"}')])
    for completion, reason in ((said, "end_turn"), (called, "tool_use")):
        result = CompletionsResponse(group_id="grp_1", policy_version=2, prompt_token_ids=[9, 9], completions=[
            completion])
        answer = message_answer("exp", result, None)
        assert answer.stop_reason == reason and answer.usage.input_tokens == 2 and answer.id == "msg_grp_1"
        Message.model_validate(json.loads(answer.model_dump_json()))  # strictly, as the SDK's own model
        events = list(body_events(answer, decode))
        types = [e.type for e in events]
        assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
        final = _accumulated(events)
        assert [b.to_dict() for b in final.content] == [b.model_dump() for b in answer.content]
        assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == (reason, len(
            completion.token_ids), 2)
    deltas = [e.delta.text for e in body_events(message_answer("exp", CompletionsResponse(
        group_id="g", policy_version=0, prompt_token_ids=[1], completions=[said]), None), decode)
              if e.type == "content_block_delta"]
    assert deltas == ["Sky", " is", " blue", ""]  # a token a piece; the end-of-turn id rides on the last
    tool = message_answer("exp", CompletionsResponse(group_id="g", policy_version=0, prompt_token_ids=[1],
                                                     completions=[called]), None).content
    assert [b.type for b in tool] == ["text", "tool_use"] and tool[1].id == "toolu_ab12"
    assert tool[1].input == {"city": "Rome"}


# ------------------------------------------------------------------------------------------------
# Over HTTP, with the anthropic package
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def experiment(server):
    name = f"messages-{uuid.uuid4().hex[:8]}"
    async with AsyncClient(server.url, server.api_key) as client:
        await client.create_experiment({"name": name, "sampling": {"n": 2, "max_tokens": 8, "temperature": 1.0}})
        await client.create_experiment({"name": f"{name}-other", "api_key": OTHER_KEY})
        yield name
        await client.delete_experiment(f"{name}-other")
        await client.delete_experiment(name)


def llm(server, key: str | None = None, **headers: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=key or server.api_key, max_retries=0, timeout=300,
                                    default_headers=headers or None)


def extra(message: Message) -> dict[str, Any]:
    return message.model_extra or {}


def only_call(message: Message):
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather", message.content
    assert calls[0].input["city"] in CITIES and calls[0].id.startswith("toolu_") and message.stop_reason == "tool_use"
    return calls[0]


async def test_plain_message_renders_as_chat_and_is_a_group(server, client, experiment, tokenizer):
    async with llm(server) as claude:
        message = await claude.messages.create(model=experiment, max_tokens=4, system="Answer in one word.",
                                               messages=[{"role": "user", "content": "Sky colour?"}],
                                               metadata={"user_id": "u-1"})
    chat = await client.complete(experiment, messages=[{"role": "system", "content": "Answer in one word."},
                                                       {"role": "user", "content": "Sky colour?"}], n=1, max_tokens=1)
    assert extra(message)["prompt_token_ids"] == chat.prompt_token_ids  # the chat path's rendering
    assert message.id.startswith("msg_") and message.model == experiment and message.role == "assistant"
    assert message.usage.input_tokens == len(chat.prompt_token_ids)
    assert message.usage.output_tokens == len(extra(message)["token_ids"]) <= 4
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
    assert message.content[0].text == tokenizer.decode(extra(message)["token_ids"], skip_special_tokens=True)
    assert (await client.feedback(experiment, extra(message)["group_id"], [1.0])).accepted


async def test_stream_events_in_order_and_deltas_add_up(server, experiment):
    async with llm(server) as claude:
        async with claude.messages.stream(model=experiment, max_tokens=6,
                                          messages=[{"role": "user", "content": "Tell me a story"}]) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
        async with claude.messages.stream(model=experiment, messages=[USER], **FORCED) as called:
            call_events = [event async for event in called]
            call_final = await called.get_final_message()
    raw = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                "content_block_stop", "message_delta", "message_stop")]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text and final.stop_reason in ("end_turn", "max_tokens")
    start = next(e for e in events if e.type == "message_start").message
    assert start.usage.input_tokens == final.usage.input_tokens > 0 and extra(start)["group_id"]
    call = only_call(call_final)
    assert [e.delta.type for e in call_events if e.type == "content_block_delta"][-1] == "input_json_delta"
    assert call_final.stop_reason == "tool_use" and call.input["city"] in CITIES


async def test_raw_stream_has_pings_and_event_names(server, experiment):
    """The wire as a plain client sees it: `event:` and `data:` lines, a `ping` before `message_start`."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/v1/messages", headers={
                "x-api-key": server.api_key, "anthropic-version": "2023-06-01", "anthropic-beta": "x-2025"},
                json={"model": experiment, "max_tokens": 3, "stream": True, "messages": [USER]}) as answer:
            assert answer.status == 200 and answer.headers["X-Group-Id"]
            text = await answer.text()
    events = []
    for block in text.strip("\n").split("\n\n"):
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if lines:
            assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
            assert json.loads(lines[1][6:])["type"] == lines[0][7:], block
            events.append(lines[0][7:])
    assert events[0] == "ping" and events[events.index("message_start") - 1] == "ping"
    assert events[-1] == "message_stop" and "error" not in events


async def test_tool_round_trip_in_an_episode_reuses_ids_and_trains(server, client, tokenizer):
    name = f"messages-ep-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1},
                                    "sampling": {"max_tokens": 8, "temperature": 1.0}})
    try:
        episode = client.episode(name)
        async with llm(server, **episode.headers) as claude:
            first = await claude.messages.create(model=name, messages=[USER], **FORCED)
            call = only_call(first)
            replay = [USER, {"role": "assistant", "content": first.content},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                    "content": "18 C and sunny"}]}]
            second = await claude.messages.create(model=name, messages=replay, tools=[WEATHER], max_tokens=4,
                                                  tool_choice={"type": "none"})
        assert extra(first)["episode_id"] == episode.id and extra(first)["group_id"] is None
        before = extra(first)["prompt_token_ids"] + extra(first)["token_ids"]
        assert extra(second)["prompt_token_ids"][:len(before)] == before  # no re-rendering of the model's call
        assert "<tool_response>\n18 C and sunny\n</tool_response>" in tokenizer.decode(
            extra(second)["prompt_token_ids"])
        partner = client.episode(name)
        async with llm(server) as claude:
            await claude.messages.create(model=name, messages=[USER], max_tokens=2,
                                         extra_body={"episode_id": partner.id})
        status = await client.status(name)
        assert status.counters.episode_turns == 3 and status.pending_episodes == 2
        assert (await client.rate_episodes(name, [episode, partner], [1.0, 0.0])).accepted
        await trained_a_step(client, name)
    finally:
        await client.delete_experiment(name)


async def trained_a_step(client: AsyncClient, name: str) -> None:
    for _ in range(240):  # batch_groups 1: the rated episodes are a train step
        status = await client.status(name)
        if status.counters.groups_trained >= 1:
            break
        await asyncio.sleep(1)
    assert status.counters.groups_trained == 1 and status.step >= 1, status


async def test_stop_sequences_end_a_message_and_are_named(server, experiment):
    stops = [" ", "e", "a", "o", "i", "t", "n", "s", "r", "l"]  # a random model writes one of them soon
    async with llm(server) as claude:
        messages = [await claude.messages.create(model=experiment, max_tokens=16, messages=[USER],
                                                 stop_sequences=stops) for _ in range(3)]
    for message in messages:
        text = message.content[0].text
        assert not any(stop in text for stop in stops), text
        if message.stop_reason == "stop_sequence":
            assert message.stop_sequence in stops
        else:
            assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert "stop_sequence" in [m.stop_reason for m in messages], [(m.content, m.stop_reason) for m in messages]


async def test_count_tokens_is_the_prompt_a_call_samples_from(server, experiment):
    conversation = dict(system="Use tools.", messages=[USER], tools=[WEATHER])
    async with llm(server) as claude:
        counted = await claude.messages.count_tokens(model=experiment, **conversation)
        message = await claude.messages.create(model=experiment, max_tokens=2, **conversation)
        with pytest.raises(anthropic.BadRequestError) as info:
            await claude.messages.count_tokens(model=experiment, messages=[
                {"role": "user", "content": [{"type": "document", "source": {}}]}])
    assert counted.input_tokens == message.usage.input_tokens == len(extra(message)["prompt_token_ids"])
    assert info.value.body["error"]["code"] == "unsupported_content"


async def test_keys_as_x_api_key_or_bearer_and_errors_in_the_messages_shape(server, experiment):
    body = {"model": experiment, "max_tokens": 1, "messages": [USER]}
    async with aiohttp.ClientSession() as session:
        answers = {}
        for who, headers in {"x-api-key": {"x-api-key": server.api_key}, "bearer": {
                "Authorization": f"Bearer {server.api_key}"}, "wrong": {"x-api-key": "wrong-key-0000"}, "none": {},
                "other": {"x-api-key": OTHER_KEY}}.items():
            async with session.post(f"{server.url}/v1/messages", json=body,
                                    headers={"anthropic-version": "2023-06-01", **headers}) as answer:
                answers[who] = answer.status, await answer.json()
        async with session.post(f"{server.url}/v1/messages", json={**body, "model": "no-such-experiment"},
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as answer:
            answers["unknown"] = answer.status, await answer.json()
    assert answers["x-api-key"][0] == answers["bearer"][0] == 200
    expected = {"wrong": (401, "authentication_error", "invalid_key"), "none": (401, "authentication_error",
                                                                                 "missing_key"),
                "other": (403, "permission_error", "wrong_experiment"),
                "unknown": (404, "not_found_error", "experiment_not_found")}
    for who, (status, kind, code) in expected.items():
        got, data = answers[who]
        assert got == status and data == {"type": "error", "error": {"type": kind, "message": data["error"]["message"],
                                                                     "code": code}}, (who, data)
    async with llm(server, key="wrong-key-0000") as claude:
        with pytest.raises(anthropic.AuthenticationError):
            await claude.messages.create(**body)


@pytest.mark.parametrize("fields, status, code", [
    ({"extra_body": {"top_k": 5}}, 400, "unsupported_parameter"),  # (sent by older versions of the package)
    ({"messages": [USER, {"role": "assistant", "content": "It is"}]}, 400, "unsupported_prefill"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, 400, "unsupported_tool"),
    ({"tool_choice": {"type": "any"}}, 400, "tools_missing"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "unknown_tool"),
    ({"max_tokens": 1_000_000}, 422, "over_limit"),  # the server's max_tokens
    ({"messages": [{"role": "user", "content": "many words " * 20_000}]}, 400, "prompt_too_long"),
    ({"messages": [{"role": "user", "content": "x" * 10_000_000}]}, 413, "payload_too_large"),
    ({"stop_sequences": [str(i) for i in range(17)]}, 422, "invalid_request"),
    ({"extra_body": {"temperature": 5.0}}, 422, "invalid_request"),  # (sent by older versions of the package)
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, 422, "invalid_request"),
])
async def test_refusals_are_plain_answers_with_their_status(server, experiment, fields, status, code):
    for stream in (False, True):  # a stream's refusals come before its headers
        async with llm(server) as claude:
            with pytest.raises(anthropic.APIStatusError) as info:
                await claude.messages.create(**{"model": experiment, "max_tokens": 2, "messages": [USER], **fields,
                                                "stream": stream})
        assert info.value.status_code == status and info.value.body["error"]["code"] == code, info.value.body
        assert info.value.body["type"] == "error" and info.value.body["error"]["message"]


# ------------------------------------------------------------------------------------------------
# A framework that speaks Messages: pydantic-ai's AnthropicModel
# ------------------------------------------------------------------------------------------------


async def test_pydantic_ai_agent_runs_an_episode_that_trains(server, client):
    from pydantic_ai import Agent, RunContext, ToolOutput
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    class Forecast(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]

    name = f"messages-agent-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1},
                                    "sampling": {"max_tokens": 64, "temperature": 1.0}})
    ran: list[str] = []

    def settings(ctx: RunContext) -> dict[str, Any]:  # the weather tool first, then the answer: both forced
        return {"max_tokens": 64, "temperature": 1.0,
                "tool_choice": ["get_weather"] if ctx.run_step <= 1 else ["final_result"]}

    async def run(episode) -> Forecast:
        # The API version whose requests carry temperature (pydantic-ai drops it for newer ones).
        client = llm(server, **episode.headers, **{"anthropic-version": "2023-06-01"})
        model = AnthropicModel(name, provider=AnthropicProvider(anthropic_client=client))
        agent = Agent(model, output_type=ToolOutput(Forecast, name="final_result"), model_settings=settings)

        @agent.tool_plain
        def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
            """The weather in a city."""
            ran.append(city)
            return f"18 C in {city}"

        return (await agent.run("What is the weather in Paris?")).output

    try:
        episodes = [client.episode(name) for _ in range(2)]
        outputs = await asyncio.wait_for(asyncio.gather(*(run(e) for e in episodes)), timeout=240)
        assert all(o.city in CITIES for o in outputs) and len(ran) == 2 and set(ran) <= set(CITIES)
        status = await client.status(name)
        assert status.counters.episode_turns == 4 and status.pending_episodes == 2, status.counters
        assert (await client.rate_episodes(name, episodes, [1.0, 0.0])).accepted
        with pytest.raises(GrpoServerError):
            await client.rate_episodes(name, episodes, [1.0, 0.0])
        await trained_a_step(client, name)
    finally:
        await client.delete_experiment(name)


# ------------------------------------------------------------------------------------------------
# The guide's block (docs/guides/anthropic.md)
# ------------------------------------------------------------------------------------------------


def guide_block(test: str) -> str:
    text = GUIDE.read_text()
    blocks = re.findall(rf"<!-- run: tests/test_anthropic.py::{test} -->\n```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, f"{GUIDE.name}: {len(blocks)} blocks marked for {test}"
    return blocks[0]


async def test_guide_block_runs(server, client):
    name = f"docs-msg-{uuid.uuid4().hex[:6]}"
    code = guide_block("test_guide_block_runs").replace('"weather"', repr(name)).replace(
        '"http://127.0.0.1:8000"', repr(server.url)).replace('"my-admin-key-change-me"', repr(server.api_key))

    def run() -> None:
        try:
            exec(compile(code, "guide", "exec"), {"__name__": "guide"})  # noqa: S102 - the guide's own code
        except BaseException as exc:  # a StopIteration would never reach the awaiting test through to_thread
            raise RuntimeError(f"the guide's block failed: {exc!r}") from exc

    try:
        await asyncio.to_thread(run)
        status = await client.status(name)
        assert status.counters.episode_turns == 4 and status.counters.episodes_rated == 2, status.counters
    finally:
        await client.delete_experiment(name)
