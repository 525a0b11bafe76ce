"""The OpenAI-compatible endpoints, with the official `openai` package as the client, against the real
server on the tiny model; and the pure conversions of grpo_server/api/openai/models.py on their own."""

from __future__ import annotations

import asyncio
import math
import time

import openai
import pytest

from grpo_server.api_models import CompletionOut, CompletionsResponse
from grpo_server.protocol.errors import BadRequest
from grpo_server.api.openai.models import (ChatCompletionRequest, CompletionRequest, chat_response, chat_to_request,
                                    completion_response, completion_to_request)
from tests.test_layout import imported_after

MESSAGES = [{"role": "user", "content": "Name a colour."}]


# ------------------------------------------------------------------------------------------------
# Pure conversions (no server)
# ------------------------------------------------------------------------------------------------


def test_openai_api_imports_no_ml_package():
    assert not imported_after("grpo_server.api.openai.models") & {"torch", "vllm", "transformers", "deepspeed", "peft"}


def test_chat_request_conversion():
    body = ChatCompletionRequest.model_validate({
        "model": "x", "n": 3, "temperature": 0.5, "top_p": 0.9, "max_tokens": 50, "max_completion_tokens": 7,
        "stop": "\n", "seed": 5, "user": "u", "metadata": {"a": "b"}, "frequency_penalty": 0,
        "logit_bias": {}, "tool_choice": "none", "response_format": {"type": "text"}, "stream": False,
        "some_framework_field": {"x": 1},
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "one."}]},
                     {"role": "assistant", "content": None}]})
    request = chat_to_request(body)
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."), ("user", "Name\none."), ("assistant", "")]
    assert (request.n, request.temperature, request.top_p, request.max_tokens, request.stop, request.seed) == (
        3, 0.5, 0.9, 7, ["\n"], 5)  # max_completion_tokens wins over max_tokens


@pytest.mark.parametrize("extra, code", [
    ({"top_logprobs": 2, "logprobs": True}, "unsupported_parameter"),
    ({"presence_penalty": 0.5}, "unsupported_parameter"),
    ({"logit_bias": {"50256": -100}}, "unsupported_parameter"),
    ({"functions": [{"name": "f"}]}, "tools_unsupported"),  # legacy: tools are sent as 'tools'
    ({"function_call": {"name": "f"}}, "tools_unsupported"),
    ({"response_format": {"type": "json_object"}}, "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "unsupported_content"),
])
def test_chat_request_rejections(extra, code):
    body = ChatCompletionRequest.model_validate({"model": "x", "messages": MESSAGES, **extra})
    with pytest.raises(BadRequest) as info:
        chat_to_request(body)
    assert info.value.code == code and info.value.status == 400


def test_legacy_prompt_forms():
    def convert(prompt, **extra):
        return completion_to_request(CompletionRequest.model_validate({"model": "x", "prompt": prompt, **extra}))

    assert convert("Hi").prompt == "Hi"
    assert convert(["Hi"]).prompt == "Hi"
    assert convert([1, 2, 3]).prompt_token_ids == [1, 2, 3]
    assert convert([[4, 5]]).prompt_token_ids == [4, 5]
    assert convert("Hi", logprobs=1, best_of=2, n=2).n == 2
    for prompt, extra in [(["a", "b"], {}), ([[1], [2]], {}), ([], {}), ("Hi", {"logprobs": 2}),
                          ("Hi", {"echo": True}), ("Hi", {"suffix": "end"}), ("Hi", {"best_of": 3, "n": 2})]:
        with pytest.raises(BadRequest):
            convert(prompt, **extra)


def test_response_conversion():
    result = CompletionsResponse(group_id="grp_1", policy_version=3, prompt_token_ids=[1, 2], completions=[
        CompletionOut(text="héllo", token_ids=[10, 11], logprobs=[-0.5, -1.5], finish_reason="length"),
        CompletionOut(text="!", token_ids=[12], logprobs=[-0.1], finish_reason="stop")])
    tokens = {10: "h", 11: "éllo", 12: "!"}
    chat = chat_response("exp", result, 1700000000, tokens).model_dump()
    assert chat["id"] == "chatcmpl-grp_1" and chat["object"] == "chat.completion"
    assert chat["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    first = chat["choices"][0]
    assert first["message"] == {"role": "assistant", "content": "héllo"} and first["token_ids"] == [10, 11]
    assert first["logprobs"]["content"][1] == {"token": "éllo", "logprob": -1.5,
                                               "bytes": list("éllo".encode()), "top_logprobs": []}
    assert chat_response("exp", result, 0).choices[0].logprobs is None
    legacy = completion_response("exp", result, 1700000000, tokens).model_dump()
    assert legacy["id"] == "cmpl-grp_1" and legacy["object"] == "text_completion"
    assert legacy["choices"][0]["logprobs"] == {"tokens": ["h", "éllo"], "token_logprobs": [-0.5, -1.5],
                                                "top_logprobs": [{"h": -0.5}, {"éllo": -1.5}],
                                                "text_offset": [0, 1]}
    assert (legacy["group_id"], legacy["policy_version"], legacy["prompt_token_ids"]) == ("grp_1", 3, [1, 2])


# ------------------------------------------------------------------------------------------------
# Over HTTP with the openai package
# ------------------------------------------------------------------------------------------------


@pytest.fixture
async def experiment(client, request):
    name = "oai-" + request.node.name.lower().replace("[", "-").replace("]", "").replace("_", "-")[:56]
    await client.create_experiment({"name": name, "api_key": f"experiment-key-{name}",
                                    "sampling": {"n": 2, "max_tokens": 6}})
    yield name
    await client.delete_experiment(name)


def openai_client(server, key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key or server.api_key, max_retries=0,
                              timeout=300)


async def test_chat_completions_group_logprobs_and_feedback(server, client, experiment, tokenizer):
    async with openai_client(server) as oai:
        resp = await oai.chat.completions.create(model=experiment, messages=MESSAGES, n=3, max_tokens=6,
                                                 temperature=1.0, logprobs=True)
    group_id = resp.model_extra["group_id"]
    assert group_id.startswith("grp_") and resp.id == f"chatcmpl-{group_id}"
    assert resp.object == "chat.completion" and resp.model == experiment and resp.created > 1_600_000_000
    assert resp.model_extra["policy_version"] == 0
    prompt_ids = resp.model_extra["prompt_token_ids"]
    assert prompt_ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert [c.index for c in resp.choices] == [0, 1, 2]
    total = 0
    for choice in resp.choices:
        token_ids = choice.model_extra["token_ids"]
        total += len(token_ids)
        assert 1 <= len(token_ids) <= 6
        assert choice.message.role == "assistant" and choice.message.content == tokenizer.decode(token_ids, skip_special_tokens=True)
        assert choice.finish_reason in ("stop", "length")
        entries = choice.logprobs.content
        assert [e.token for e in entries] == [tokenizer.decode([t]) for t in token_ids]
        assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in entries)
        assert all(math.isfinite(e.logprob) and e.logprob <= 0 for e in entries)
    assert resp.usage.completion_tokens == total
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.total_tokens == total + len(prompt_ids)

    accepted = await client.feedback(experiment, group_id, [1.0, 0.0, 0.5])
    assert accepted.accepted and accepted.group_id == group_id
    assert (await client.status(experiment)).counters.groups_received == 1


async def test_chat_matches_native_endpoint_and_experiment_defaults(server, client, experiment, tokenizer):
    """Same seed and sampling through both APIs -> the same tokens: every parameter reaches the sampler."""
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    as_native = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name\na colour."}]
    async with openai_client(server) as oai:
        resp = await oai.chat.completions.create(model=experiment, messages=messages, n=3, max_completion_tokens=5,
                                                 max_tokens=100, temperature=0.9, top_p=0.95, seed=11,
                                                 user="someone", metadata={"k": "v"}, store=False,
                                                 extra_body={"some_framework_field": 1})
        default = await oai.chat.completions.create(model=experiment, messages=MESSAGES)
    native = await client.complete(experiment, messages=as_native, n=3, max_tokens=5, temperature=0.9,
                                   top_p=0.95, seed=11)
    assert resp.model_extra["prompt_token_ids"] == native.prompt_token_ids
    assert [c.model_extra["token_ids"] for c in resp.choices] == [c.token_ids for c in native.completions]
    assert all(c.logprobs is None for c in resp.choices)  # not asked for
    assert len(default.choices) == 2  # the experiment's sampling.n, when n is absent
    assert all(len(c.model_extra["token_ids"]) <= 6 for c in default.choices)


async def test_legacy_completions_text_prompt(server, experiment, tokenizer):
    async with openai_client(server) as oai:
        resp = await oai.completions.create(model=experiment, prompt="Once upon a time", n=2, max_tokens=5,
                                            logprobs=1, stop=["\n\n"])
    assert resp.object == "text_completion" and resp.id == f"cmpl-{resp.model_extra['group_id']}"
    assert resp.model_extra["prompt_token_ids"] == tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        token_ids = choice.model_extra["token_ids"]
        assert 1 <= len(token_ids) <= 5 and choice.text == tokenizer.decode(token_ids, skip_special_tokens=True)
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in token_ids]
        assert len(lp.token_logprobs) == len(token_ids) and all(x <= 0 for x in lp.token_logprobs)
        assert lp.top_logprobs == [{tok: x} for tok, x in zip(lp.tokens, lp.token_logprobs)]
        assert lp.text_offset[0] == 0 and len(lp.text_offset) == len(token_ids)
    assert resp.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in resp.choices)


async def test_legacy_completions_token_ids_with_own_key(server, client, experiment):
    ids = [1, 9690, 198, 2683, 314]
    async with openai_client(server, f"experiment-key-{experiment}") as oai:
        resp = await oai.completions.create(model=experiment, prompt=ids, n=2, max_tokens=4, seed=3)
        nested = await oai.completions.create(model=experiment, prompt=[ids], n=2, max_tokens=4, seed=3)
    assert resp.model_extra["prompt_token_ids"] == ids and resp.usage.prompt_tokens == len(ids)
    assert [c.model_extra["token_ids"] for c in resp.choices] == [c.model_extra["token_ids"] for c in nested.choices]
    assert all(c.logprobs is None for c in resp.choices)
    accepted = await client.feedback(experiment, resp.model_extra["group_id"], [0.0, 1.0])
    assert accepted.accepted


async def test_unknown_model_is_not_found(server):
    async with openai_client(server) as oai:
        with pytest.raises(openai.NotFoundError) as info:
            await oai.chat.completions.create(model="no-such-experiment", messages=MESSAGES, max_tokens=2)
        assert info.value.code == "experiment_not_found"
        with pytest.raises(openai.NotFoundError):
            await oai.completions.create(model="no-such-experiment", prompt="x", max_tokens=2)


async def test_models(server, client, experiment):
    other = experiment + "-b"
    await client.create_experiment({"name": other, "api_key": f"experiment-key-{other}"})
    try:
        async with openai_client(server) as oai:  # the admin key: every experiment
            listed = [m.id async for m in oai.models.list()]
            assert {experiment, other} <= set(listed) and listed == sorted(listed)
            model = await oai.models.retrieve(experiment)
            assert (model.id, model.object, model.owned_by) == (experiment, "model", "grpo-server")
            assert abs(model.created - time.time()) < 3600
            with pytest.raises(openai.NotFoundError) as info:
                await oai.models.retrieve("no-such-experiment")
            assert info.value.code == "experiment_not_found"
        async with openai_client(server, f"experiment-key-{other}") as oai:  # an experiment's key: its own only
            assert [m.id async for m in oai.models.list()] == [other]
            assert (await oai.models.retrieve(other)).id == other
            with pytest.raises(openai.PermissionDeniedError):
                await oai.models.retrieve(experiment)
        async with openai_client(server, "wrong-key") as oai:
            with pytest.raises(openai.AuthenticationError):
                await oai.models.list()
    finally:
        await client.delete_experiment(other)


@pytest.mark.parametrize("kwargs, error, code", [
    ({"n": 0}, openai.UnprocessableEntityError, "invalid_request"),
    ({"temperature": -1}, openai.UnprocessableEntityError, "invalid_request"),
    ({"max_tokens": 600}, openai.BadRequestError, "prompt_too_long"),
    ({"messages": []}, openai.UnprocessableEntityError, "invalid_request"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.UnprocessableEntityError, "invalid_request"),
    ({"top_logprobs": 3, "logprobs": True}, openai.BadRequestError, "unsupported_parameter"),
    ({"tool_choice": "required"}, openai.BadRequestError, "tools_missing"),  # no tools to call
    ({"functions": [{"name": "f", "parameters": {}}]}, openai.BadRequestError, "tools_unsupported"),
    ({"frequency_penalty": 1.0}, openai.BadRequestError, "unsupported_parameter"),
])
async def test_bad_chat_requests(server, experiment, kwargs, error, code):
    async with openai_client(server) as oai:
        with pytest.raises(error) as info:
            await oai.chat.completions.create(model=experiment, **{"messages": MESSAGES, "max_tokens": 2, **kwargs})
    assert info.value.code == code and info.value.message


@pytest.mark.parametrize("kwargs, error", [
    ({"prompt": ["one", "two"]}, openai.BadRequestError),
    ({"prompt": "x", "logprobs": 3}, openai.BadRequestError),
    ({"prompt": "x", "echo": True}, openai.BadRequestError),
    ({"prompt": [1, 10**7]}, openai.BadRequestError),  # outside the vocabulary
    ({"prompt": ""}, openai.UnprocessableEntityError),
])
async def test_bad_legacy_requests(server, experiment, kwargs, error):
    async with openai_client(server) as oai:
        with pytest.raises(error):
            await oai.completions.create(model=experiment, max_tokens=2, **kwargs)


async def test_auth(server, client, experiment):
    async with openai_client(server, "wrong-key") as oai:
        with pytest.raises(openai.AuthenticationError):
            await oai.chat.completions.create(model=experiment, messages=MESSAGES, max_tokens=2)
    other = experiment + "-b"
    await client.create_experiment({"name": other, "api_key": f"experiment-key-{other}", "sampling": {"n": 2}})
    try:
        async with openai_client(server, f"experiment-key-{other}") as oai:
            with pytest.raises(openai.PermissionDeniedError):  # another experiment's key
                await oai.chat.completions.create(model=experiment, messages=MESSAGES, max_tokens=2)
            with pytest.raises(openai.PermissionDeniedError):
                await oai.completions.create(model=experiment, prompt="x", max_tokens=2)
            own = await oai.chat.completions.create(model=other, messages=MESSAGES, max_tokens=2)
            assert len(own.choices) == 2
    finally:
        await client.delete_experiment(other)


async def test_example_script(server, client):
    from examples import openai_client as example

    name = "openai-example-test"
    means = await asyncio.to_thread(example.main, ["--url", server.url, "--api-key", server.api_key,
                                                   "--experiment", name, "--rounds", "2", "--n", "2"])
    try:
        assert len(means) == 2 and all(0.0 <= m <= 1.0 for m in means)
        assert (await client.status(name)).counters.groups_received == 2
    finally:
        await client.delete_experiment(name)
