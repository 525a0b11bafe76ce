"""vLLM's token conventions beside our own (grpo_server/api/openai/vllm_fields.py, vllm_tokenize.py): the
`return_token_ids` fields where vLLM puts them, `return_tokens_as_token_ids`, its sampling extensions rejected
unless neutral, and `POST /tokenize` / `POST /detokenize` in vLLM's shapes, checked against our native
`POST /v1/tokenize` and the tokenizer itself, on the real server with the tiny model."""

from __future__ import annotations

import json
import re

import aiohttp
import openai
import pytest

from grpo_server.api.openai.models import (ChatCompletionRequest, CompletionRequest, chat_to_request,
                                           completion_to_request)
from grpo_server.protocol.errors import BadRequest

MESSAGES = [{"role": "user", "content": "Name a colour."}]
NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False,
           "stop_token_ids": [], "use_beam_search": False, "return_token_ids": True, "skip_special_tokens": False}


def test_neutral_vllm_fields_are_accepted_and_others_rejected():
    chat = chat_to_request(ChatCompletionRequest.model_validate(
        {"model": "x", "messages": MESSAGES, "add_generation_prompt": True, "chat_template_kwargs": {}, **NEUTRAL}))
    assert chat.messages[0].content == "Name a colour."
    assert completion_to_request(CompletionRequest.model_validate({"model": "x", "prompt": "Hi", **NEUTRAL}))
    for field, value in [("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2), ("min_tokens", 3),
                         ("ignore_eos", True), ("stop_token_ids", [2]), ("allowed_token_ids", [5]),
                         ("use_beam_search", True), ("guided_regex", "a+"), ("prompt_logprobs", 0),
                         ("structured_outputs", {"regex": "a"})]:
        for body, convert in [({"messages": MESSAGES}, chat_to_request), ({"prompt": "Hi"}, completion_to_request)]:
            kind = ChatCompletionRequest if "messages" in body else CompletionRequest
            with pytest.raises(BadRequest) as info:
                convert(kind.model_validate({"model": "x", **body, field: value}))
            assert info.value.code == "unsupported_parameter" and field in info.value.message
    for field, value in [("add_generation_prompt", False), ("continue_final_message", True), ("echo", True),
                         ("chat_template", "{{ x }}"), ("chat_template_kwargs", {"enable_thinking": False})]:
        with pytest.raises(BadRequest):
            chat_to_request(ChatCompletionRequest.model_validate({"model": "x", "messages": MESSAGES, field: value}))


@pytest.fixture
async def experiment(client, request):
    name = re.sub(r"[^a-z0-9-]+", "-", "vllm-" + request.node.name.lower().replace("_", "-"))[:60]
    await client.create_experiment({"name": name, "api_key": f"experiment-key-{name}",
                                    "sampling": {"n": 2, "max_tokens": 6}})
    yield name
    await client.delete_experiment(name)


@pytest.fixture
async def http(server):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {server.api_key}"}) as session:
        yield session


async def _post(http: aiohttp.ClientSession, url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json()


def _oai(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


async def test_tokenize_and_detokenize_in_vllm_shapes(server, http, experiment, tokenizer):
    url = server.url
    status, text = await _post(http, f"{url}/tokenize", {"model": experiment, "prompt": "Once upon a time",
                                                         "return_token_strs": True})
    assert status == 200, text
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert text["tokens"] == ids and text["count"] == len(ids) and text["max_model_len"] > len(ids)
    assert text["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    for add_generation_prompt in (True, False):
        _, chat = await _post(http, f"{url}/tokenize", {"model": experiment, "messages": MESSAGES,
                                                        "add_generation_prompt": add_generation_prompt})
        _, native = await _post(http, f"{url}/v1/tokenize", {"messages": MESSAGES, "experiment": experiment,
                                                             "add_generation_prompt": add_generation_prompt})
        assert chat["tokens"] == native["token_ids"] and chat["token_strs"] is None
        assert chat["tokens"] == tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)["input_ids"]
    status, back = await _post(http, f"{url}/detokenize", {"model": experiment, "tokens": chat["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(chat["tokens"])}
    assert (await _post(http, f"{url}/tokenize", {"model": experiment, "prompt": ""}))[1]["tokens"] == []


@pytest.mark.parametrize("path, body, status, code", [
    ("/detokenize", {"tokens": [1, 10**7]}, 400, "bad_token_ids"),
    ("/detokenize", {"tokens": [-1]}, 422, "invalid_request"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 422, "invalid_request"),
    ("/tokenize", {}, 422, "invalid_request"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "unsupported_parameter"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "unsupported_parameter"),
])
async def test_bad_tokenize_requests(server, http, experiment, path, body, status, code):
    got, data = await _post(http, server.url + path, {"model": experiment, **body})
    assert (got, data["error"]["code"]) == (status, code), data


async def test_tokenize_is_scoped_to_the_model(server, http, experiment):
    key = f"experiment-key-{experiment}"
    for path, body in [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})]:
        assert (await _post(http, server.url + path, {"model": experiment, **body}, key))[0] == 200
        status, data = await _post(http, server.url + path, {"model": "vllm-someone-else", **body}, key)
        assert status == 403 and data["error"]["code"] == "wrong_experiment"
        status, data = await _post(http, server.url + path, {"model": "vllm-no-such-experiment", **body})
        assert status == 404 and data["error"]["code"] == "experiment_not_found"


async def test_chat_return_token_ids_and_tokens_as_ids(server, http, experiment):
    async with _oai(server) as oai:
        resp = await oai.chat.completions.create(model=experiment, messages=MESSAGES, n=2, max_tokens=5, logprobs=True,
                                                 extra_body={"return_token_ids": True,
                                                             "return_tokens_as_token_ids": True, **NEUTRAL})
    _, tokens = await _post(http, f"{server.url}/tokenize", {"model": experiment, "messages": MESSAGES})
    assert resp.model_extra["prompt_token_ids"] == tokens["tokens"]  # vLLM's place: the top level
    for choice in resp.choices:
        ids = choice.model_extra["token_ids"]
        assert ids and [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in ids]


async def test_legacy_return_token_ids_per_choice_and_streamed(server, experiment, tokenizer):
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    async with _oai(server) as oai:
        plain = await oai.completions.create(model=experiment, prompt=prompt, n=2, max_tokens=4)
        asked = await oai.completions.create(model=experiment, prompt=prompt, n=2, max_tokens=4,
                                             extra_body={"return_token_ids": True})
        stream = await oai.completions.create(model=experiment, prompt=prompt, n=2, max_tokens=4, stream=True,
                                              extra_body={"return_token_ids": True})
        chunks = [chunk async for chunk in stream]
    assert all("prompt_token_ids" not in c.model_extra for c in plain.choices)  # as vLLM: only when asked
    for choice in asked.choices:  # vLLM's place on a legacy completion: each choice
        assert choice.model_extra["prompt_token_ids"] == prompt and choice.model_extra["token_ids"]
    streamed: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if (choice.model_extra or {}).get("prompt_token_ids") is not None:
                streamed.setdefault(choice.index, []).append(choice.model_extra["prompt_token_ids"])
    assert streamed == {0: [prompt], 1: [prompt]}, json.dumps([c.model_dump() for c in chunks])[:2000]
