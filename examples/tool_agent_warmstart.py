"""The tool agent's warm start and its evaluation pass (examples/tool_agent.py runs both).

Warm start: the untrained SmolLM2-135M-Instruct never calls the tool when the choice is left to it
("auto"), so every run of a group earns the same format reward and RL has nothing to compare. A few
demonstrations fix that. One wave is one question and two groups, each a step's worth (`batch_groups` 2):
- turn 1: the model's own n samples of the first turn (chat completions with the tool, tool_choice
  "auto", the prompt the SDK sends), scored with the example's `score`, plus `demos` demonstrations of
  the call to `add` rated 1.0 (what a full run with that call and the right answer earns);
- turn 2: the model's n samples of the answer after the demonstrated call and the tool's result, rated 1
  when the final message has the sum, plus demonstrated answers rated 1.
The demonstrations are posted as `extra_completions` of the sampled groups, so the model's own tries are
the worse alternatives: the group has reward variance, the demonstrations get a positive advantage and
the unsampled-call tries a negative one. Their token ids are the server's own rendering of the
conversation (`POST /v1/tokenize` with the assistant `tool_calls` message and the tool), cut where the
model's turn ends (its end-of-turn token, not the template's newline after it): exactly the tokens the
model would have to sample for the Hermes parser to read a call.

Waves go one at a time, each waiting for the version its groups train: the server scores an external
completion under the version serving when the feedback arrives, so a demonstration posted now and trained
three steps later would start at a ratio the PPO clip already cuts (the earlier waves raised it).

Evaluation: `runs` SDK runs under "auto" at the experiment's temperature, on questions fixed by a seed (the
same ones at every point), each an episode never rated (it expires after `episode_ttl_s`; it trains
nothing). Reported: the share of runs whose first turn is a parsed call to `add`, the share that answered
with the sum, and the mean `score`.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

from agents.models.chatcmpl_converter import Converter
from openai import AsyncOpenAI

from examples.task_runner import retrying
from examples.tool_agent import (INSTRUCTIONS, MAX_TURNS, NUMBER, Turn, add, prompt, question, run_once,
                                 sampling_settings, score)
from grpo_server.client import AsyncClient

TOOL = Converter.tool_to_openai(add)  # the schema the SDK sends, so the rendered prompt is the SDK's
CALL_ID = "call_demo"


def first_messages(a: int, b: int) -> list[dict]:
    """The SDK's first turn: the agent's instructions as the system message, then the question."""
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": prompt(a, b)}]


def call_message(a: int, b: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}]}


def tool_message(a: int, b: int) -> dict:
    return {"role": "tool", "tool_call_id": CALL_ID, "content": str(a + b)}  # the SDK sends str(result)


ANSWERS = ("{a} + {b} = {s}.", "The answer is {s}.", "{a} + {b} is {s}.", "{s}")


async def turn_end(client: AsyncClient) -> list[int]:
    """The tokens the chat template puts after an assistant message's content (ChatML: end-of-turn, then a
    newline). The model samples only the first (its stop token); the rest is the template's."""
    user = [{"role": "user", "content": "Hi"}]
    opened = (await client.tokenize(messages=user)).token_ids
    closed = (await client.tokenize(messages=user + [{"role": "assistant", "content": "Yes"}],
                                    add_generation_prompt=False)).token_ids
    content = (await client.tokenize("Yes")).token_ids
    assert closed[:len(opened) + len(content)] == opened + content, "the template does not render turn by turn"
    return closed[len(opened) + len(content):]


def model_turn(conversation: list[int], prompt_ids: list[int], end: list[int]) -> list[int]:
    """The model's turn inside `conversation` (the prompt, its turn, the template's end of it), as sampled."""
    assert conversation[:len(prompt_ids)] == prompt_ids, "the demonstration is not rendered after the prompt"
    turn = conversation[len(prompt_ids):]
    assert turn[-len(end):] == end, "the demonstration does not end its turn as the template does"
    return turn[:len(turn) - len(end) + 1]


def _turn(choice: Any) -> Turn:
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return Turn(text=choice.message.content or "", calls=calls)


async def wave(client: AsyncClient, llm: AsyncOpenAI, name: str, a: int, b: int, sampling: dict,
               demos: int, end: list[int], rng: random.Random) -> tuple[int, list[float], float]:
    """One question's two groups with their demonstrations: (groups accepted, the model's turn-1 rewards, the
    logprob of the first demonstrated call under the version serving, summed over its tokens)."""
    size, temperature, max_tokens = sampling.get("n", 8), sampling.get("temperature", 1.0), sampling.get(
        "max_tokens", 48)
    messages = first_messages(a, b)
    first = await llm.chat.completions.create(model=name, messages=messages, tools=[TOOL], tool_choice="auto",
                                              n=size, temperature=temperature, max_tokens=max_tokens)
    prompt_ids = first.model_extra["prompt_token_ids"]
    rewards = [score([_turn(c)], a, b) for c in sorted(first.choices, key=lambda c: c.index)]
    orders = [(a, b), (b, a)]  # both argument orders are right; `score` takes either
    calls = []
    for x, y in (orders[i % 2] for i in range(demos)):
        rendered = await client.tokenize(messages=messages + [call_message(x, y)], tools=[TOOL],
                                         add_generation_prompt=False)
        calls.append(model_turn(rendered.token_ids, prompt_ids, end))
    answers = [await retrying(lambda: client.feedback(name, first.model_extra["group_id"], rewards + [1.0] * demos,
                                                      extra_completions=calls))]

    # Turn 2, after the first demonstrated call: the prompt the server builds for an episode's next turn
    # (the previous prompt + the model's ids + the tool's result rendered), so no re-rendering drift.
    called = prompt_ids + calls[0]
    second_prompt = (await client.tokenize(messages=[tool_message(a, b)], continue_from=called,
                                           tools=[TOOL])).token_ids
    second = await retrying(lambda: client.complete(name, prompt_token_ids=second_prompt, n=size,
                                                    temperature=temperature, max_tokens=max_tokens))
    answered = [float("<tool_call>" not in c.text and a + b in [int(n) for n in NUMBER.findall(c.text)])
                for c in second.completions]
    replies = []
    for wording in rng.sample(ANSWERS, demos):
        text = wording.format(a=a, b=b, s=a + b)
        rendered = await client.tokenize(messages=[tool_message(a, b), {"role": "assistant", "content": text}],
                                         continue_from=called, tools=[TOOL], add_generation_prompt=False)
        replies.append(model_turn(rendered.token_ids, second_prompt, end))
    answers.append(await retrying(lambda: client.feedback(name, second.group_id, answered + [1.0] * demos,
                                                          extra_completions=replies)))
    call_logprob = sum(answers[0].external_logprobs[0]) if answers[0].external_logprobs else float("nan")
    return sum(answer.accepted and answer.skipped is None for answer in answers), rewards, call_logprob


async def _version(client: AsyncClient, name: str) -> int:
    return (await client.status(name)).policy_version


async def warm_start(client: AsyncClient, api_key: str, name: str, config: dict, waves: int, demos: int,
                     seed: int, timeout_s: float = 900.0) -> dict:
    """`waves` questions with demonstrations, each trained before the next is sampled; the versions made."""
    started, rng = time.monotonic(), random.Random(seed)
    sampling, batch = config.get("sampling", {}), int(config.get("algorithm", {}).get("batch_groups", 4))
    end = await turn_end(client)
    # Retries: 429 while the learner is behind, with the server's Retry-After.
    llm = AsyncOpenAI(base_url=client.base_url + "/v1", api_key=api_key, max_retries=1000)
    start_version, accepted, first_turn, logprobs = await _version(client, name), 0, [], []
    try:
        for _ in range(waves):
            trained, rewards, logprob = await wave(client, llm, name, *question(rng), sampling, demos, end, rng)
            accepted, first_turn = accepted + trained, first_turn + rewards
            logprobs.append(round(logprob, 1))
            goal = start_version + accepted // batch  # a partial batch waits for the next wave's groups
            while await _version(client, name) < goal:
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"warm start: version {goal} not pushed in {timeout_s:.0f} s")
                await asyncio.sleep(1.0)
    finally:
        await llm.close()
    return {"waves": waves, "demos_per_group": demos, "groups_trained": accepted,
            "versions": await _version(client, name) - start_version,
            "turn1_reward_sampled": round(statistics.fmean(first_turn), 3), "call_logprob_by_wave": logprobs,
            "wall_s": round(time.monotonic() - started, 1)}


async def evaluate(client: AsyncClient, name: str, config: dict, runs: int, seed: int,
                   concurrency: int = 16) -> dict:
    """`runs` agent runs under tool_choice "auto", never rated: how often the model calls `add` unforced."""
    started, rng = time.monotonic(), random.Random(seed)
    questions = [question(rng) for _ in range(runs)]
    settings = sampling_settings(config, tool_choice="auto")
    gate = asyncio.Semaphore(concurrency)

    async def one(a: int, b: int) -> tuple[bool, bool, float]:
        async with gate:
            transcript = await run_once(client.episode(name), settings, a, b, max_turns=MAX_TURNS)
        turns = transcript.turns
        called = bool(turns and turns[0].calls and turns[0].calls[0][0] == "add")
        reward = score(turns, a, b)
        final = turns[-1] if turns and not turns[-1].calls else None
        answered = final is not None and a + b in [int(n) for n in NUMBER.findall(final.text)]
        return called, answered, reward

    results = await asyncio.gather(*(one(a, b) for a, b in questions))
    return {"runs": runs, "called_add": sum(r[0] for r in results), "answered": sum(r[1] for r in results),
            "reward": round(statistics.fmean(r[2] for r in results), 3),
            "policy_version": await _version(client, name), "wall_s": round(time.monotonic() - started, 1)}


def describe(point: str, result: dict) -> str:
    runs = result["runs"]
    return (f"tool_agent eval {point} (version {result['policy_version']}, tool_choice auto, {runs} runs, "
            f"{result['wall_s']} s): called add {result['called_add']}/{runs} "
            f"({result['called_add'] / runs:.0%}), answered with the sum {result['answered']}/{runs} "
            f"({result['answered'] / runs:.0%}), mean reward {result['reward']:.3f}")
