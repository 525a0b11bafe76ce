"""The tool agent's warm start (examples/tool_agent_warmstart.py) on the real server and the tiny model (the
embedded SmolLM2 tokenizer): the demonstrated call is the Hermes text the parser reads, ended by the
model's end-of-turn token and not the template's newline, and one wave posts its demonstrations beside the
model's own tries as two trained groups."""

from __future__ import annotations

import random
import uuid

import pytest
from openai import AsyncOpenAI

from examples import tool_agent_warmstart as warm
from grpo_server.client import AsyncClient


def test_model_turn_cuts_after_the_end_of_turn_token():
    assert warm.model_turn([1, 2, 7, 8, 90, 91], [1, 2], [90, 91]) == [7, 8, 90]
    with pytest.raises(AssertionError):
        warm.model_turn([1, 3, 7, 90, 91], [1, 2], [90, 91])  # not rendered after the prompt
    with pytest.raises(AssertionError):
        warm.model_turn([1, 2, 7, 90], [1, 2], [90, 91])  # not closed as the template closes a turn


async def test_the_demonstrated_call_is_the_parsers_format_in_the_models_tokens(client: AsyncClient, tokenizer):
    end = await warm.turn_end(client)
    assert tokenizer.decode(end) == "<|im_end|>\n" and end[0] == tokenizer.eos_token_id
    messages = warm.first_messages(17, 25)
    prompt = (await client.tokenize(messages=messages, tools=[warm.TOOL])).token_ids
    rendered = (await client.tokenize(messages=messages + [warm.call_message(17, 25)], tools=[warm.TOOL],
                                      add_generation_prompt=False)).token_ids
    call = warm.model_turn(rendered, prompt, end)
    assert tokenizer.decode(call) == ('<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n'
                                      '</tool_call><|im_end|>')
    assert '"name": "add"' in tokenizer.decode(prompt)  # the SDK's tool schema is in the system prompt


async def test_a_wave_trains_demonstrations_beside_the_models_tries(server, client: AsyncClient):
    name = f"warm-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 2},
                                    "sampling": {"n": 4, "max_tokens": 16, "temperature": 1.0}})
    llm = AsyncOpenAI(base_url=client.base_url + "/v1", api_key=server.api_key, max_retries=20)
    try:
        end = await warm.turn_end(client)
        trained, rewards, logprob = await warm.wave(client, llm, name, 17, 25, {"n": 4, "temperature": 1.0,
                                                                               "max_tokens": 16},
                                                    2, end, random.Random(0))
        # The random model neither calls nor answers: its tries score (nearly) 0 beside demonstrations at 1.
        assert trained == 2 and len(rewards) == 4 and logprob < -1.0, (trained, rewards, logprob)
        status = await client.status(name)
        assert status.counters.completions_external == 4 and status.counters.groups_received == 2, status
    finally:
        await llm.close()
        await client.delete_experiment(name)
