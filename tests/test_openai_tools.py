"""Tool calls on POST /v1/chat/completions, with the official `openai` package against the real server on the
tiny model (the SmolLM2 tokenizer, so the Hermes format of grpo_server/runtime/chat_render.py): tools offered
and forced, calls parsed back, histories with calls and results, episode ids, and the tool errors."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from grpo_server.api.openai.models import chat_response
from grpo_server.api_models import CompletionOut, CompletionsResponse
from grpo_server.protocol.wire import ToolCall

CITIES = ["Paris", "Rome", "Oslo"]
# Enums keep a random model's forced arguments short.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
HISTORY = [
    {"role": "system", "content": "You answer with tools."},
    USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]


@pytest.fixture
async def experiment(client, request):
    name = "tools-" + request.node.name.lower().replace("[", "-").replace("]", "").replace("_", "-")[:50]
    await client.create_experiment({"name": name, "sampling": {"n": 2, "max_tokens": 8}})
    yield name
    await client.delete_experiment(name)


def openai_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


async def create(oai: openai.AsyncOpenAI, **kwargs) -> ChatCompletion:
    """The answer checked against the `openai` package's own model, strictly (the SDK itself parses leniently)."""
    raw = await oai.chat.completions.with_raw_response.create(**kwargs)
    body = json.loads(raw.http_response.text)
    ChatCompletion.model_validate(body)
    return raw.parse()


def check_calls(resp: ChatCompletion, names: set[str]) -> None:
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and all(c.type == "function" and c.id and c.function.name in names for c in calls)
        for c in calls:
            arguments = json.loads(c.function.arguments)
            assert isinstance(arguments, dict)
            if c.function.name == "get_weather":
                assert arguments == {"city": arguments["city"]} and arguments["city"] in CITIES
        assert choice.message.content is None or isinstance(choice.message.content, str)


# ------------------------------------------------------------------------------------------------
# Pure conversion (no server)
# ------------------------------------------------------------------------------------------------


def test_response_with_calls_parses_in_the_openai_package():
    result = CompletionsResponse(group_id=None, episode_id="ep-1", policy_version=0, prompt_token_ids=[1], completions=[
        CompletionOut(text='<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', token_ids=[5], logprobs=[-1.0],
                      finish_reason="tool_calls", tool_calls=[ToolCall(id="call_a", name="f", arguments="{}")]),
        CompletionOut(text="Hi <tool_call>", token_ids=[6], logprobs=[-1.0], finish_reason="stop", tool_calls=[],
                      content="Hi <tool_call>"),
        CompletionOut(text="plain", token_ids=[7], logprobs=[-1.0], finish_reason="length")])
    body = json.loads(chat_response("exp", result, 1700000000).model_dump_json())
    parsed = ChatCompletion.model_validate(body)
    assert body["group_id"] is None and body["episode_id"] == "ep-1" and body["id"].startswith("chatcmpl-ep-1-")
    first, second, third = body["choices"]
    assert first["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert first["finish_reason"] == "tool_calls" and parsed.choices[0].message.tool_calls[0].function.name == "f"
    assert second["message"] == {"role": "assistant", "content": "Hi <tool_call>"}  # no calls: no tool_calls
    assert third["message"] == {"role": "assistant", "content": "plain"}
    grouped = result.model_copy(update={"group_id": "grp_1", "episode_id": None})
    assert "episode_id" not in json.loads(chat_response("exp", grouped, 0).model_dump_json())


# ------------------------------------------------------------------------------------------------
# Over HTTP with the openai package
# ------------------------------------------------------------------------------------------------


async def test_required_choice_gives_parsed_calls(server, client, experiment, tokenizer):
    async with openai_client(server) as oai:
        resp = await create(oai, model=experiment, messages=[USER], tools=[WEATHER, TIME], tool_choice="required",
                            parallel_tool_calls=False, n=2, max_tokens=96, temperature=1.0, seed=3)
    check_calls(resp, {"get_weather", "get_time"})
    assert all(len(c.message.tool_calls) == 1 for c in resp.choices)  # parallel_tool_calls=False
    prompt = tokenizer.decode(resp.model_extra["prompt_token_ids"])
    assert "# Tools" in prompt and json.dumps(WEATHER) in prompt and '"name": <function-name>' in prompt
    for choice in resp.choices:
        assert "<tool_call>" in tokenizer.decode(choice.model_extra["token_ids"])
    group_id = resp.model_extra["group_id"]
    assert (await client.feedback(experiment, group_id, [1.0, 0.0])).accepted  # rated like any group


async def test_named_choice(server, experiment):
    async with openai_client(server) as oai:
        resp = await create(oai, model=experiment, messages=[USER], tools=[WEATHER, TIME], n=2, max_tokens=96,
                            tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=5)
    check_calls(resp, {"get_time"})
    for choice in resp.choices:
        assert json.loads(choice.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")


async def test_auto_and_none_choices(server, experiment, tokenizer):
    async with openai_client(server) as oai:
        auto = await create(oai, model=experiment, messages=[USER], tools=[WEATHER], max_tokens=8, seed=1)
        none = await create(oai, model=experiment, messages=[USER], tools=[WEATHER], tool_choice="none",
                            max_tokens=8, seed=1)
    for resp in (auto, none):  # the tools are shown either way; free text comes back as content
        assert "# Tools" in tokenizer.decode(resp.model_extra["prompt_token_ids"])
        for choice in resp.choices:
            assert choice.finish_reason in ("stop", "length", "tool_calls")
            assert choice.message.tool_calls or isinstance(choice.message.content, str)
    assert all(c.message.tool_calls is None for c in none.choices)  # "none": the text is not parsed


async def test_history_with_calls_and_results(server, client, experiment, tokenizer):
    async with openai_client(server) as oai:
        resp = await create(oai, model=experiment, messages=HISTORY, tools=[WEATHER], max_tokens=6, n=2)
        again = await create(oai, model=experiment, messages=HISTORY, max_tokens=6, n=2)  # the tools not offered now
    prompt = tokenizer.decode(resp.model_extra["prompt_token_ids"])
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in prompt
    assert prompt.startswith("<|im_start|>system\nYou answer with tools.\n\n# Tools")
    assert prompt.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    again_prompt = tokenizer.decode(again.model_extra["prompt_token_ids"])
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in again_prompt and "# Tools" not in again_prompt
    # Native and OpenAI render the same history to the same ids.
    native = await client.complete(experiment, messages=HISTORY, tools=[WEATHER], n=2, max_tokens=2)
    assert native.prompt_token_ids == resp.model_extra["prompt_token_ids"]


async def test_episode_id_passes_through_both_endpoints(server, experiment):
    async with openai_client(server) as oai:
        chat = await create(oai, model=experiment, messages=[USER], tools=[WEATHER], n=1, max_tokens=4,
                            extra_body={"episode_id": "tools-ep-1"})
        raw = await oai.completions.with_raw_response.create(model=experiment, prompt="Once", n=1, max_tokens=4,
                                                             extra_body={"episode_id": "tools-ep-2"})
    assert chat.model_extra["episode_id"] == "tools-ep-1" and chat.model_extra["group_id"] is None
    body = json.loads(raw.http_response.text)
    Completion.model_validate(body)
    assert body["episode_id"] == "tools-ep-2" and body["group_id"] is None


BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": ["x"]}}}


@pytest.mark.parametrize("kwargs, error, code", [
    ({"tools": [BAD_SCHEMA]}, openai.BadRequestError, "bad_tool_schema"),
    ({"tools": [WEATHER, WEATHER]}, openai.BadRequestError, "duplicate_tool"),
    ({"messages": HISTORY[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "?"}]},
     openai.BadRequestError, "unknown_tool_call_id"),
    ({"tool_choice": {"type": "function", "function": {"name": "not_offered"}}}, openai.BadRequestError,
     "unknown_tool"),
    ({"messages": HISTORY[:3] + [{"role": "tool", "content": "18 C"}]}, openai.BadRequestError,
     "missing_tool_call_id"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "Paris"}}]}]},
     openai.BadRequestError, "bad_tool_arguments"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, openai.UnprocessableEntityError,
     "invalid_request"),
    ({"extra_body": {"episode_id": "has spaces"}}, openai.UnprocessableEntityError, "invalid_request"),
])
async def test_bad_tool_inputs_then_a_normal_answer(server, experiment, kwargs, error, code):
    async with openai_client(server) as oai:
        with pytest.raises(error) as info:
            await oai.chat.completions.create(model=experiment, **{"messages": [USER], "tools": [WEATHER],
                                                                   "max_tokens": 2, **kwargs})
        assert info.value.code == code and info.value.message
        after = await create(oai, model=experiment, messages=HISTORY, tools=[WEATHER], max_tokens=2)
    assert len(after.choices) == 2
