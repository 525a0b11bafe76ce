"""A two-step agent task with feedback per step: add two numbers, then add a third to that answer.

    GRPO_SERVER_API_KEY=... python examples/arithmetic_agent.py --steps 20

Each episode is a conversation. Step 1 asks for a + b and samples a group of answers, each rated by a
verifier. The episode then continues from one of those answers (picked at random, as an agent acts on
one candidate): step 2's prompt is step 1's prompt + that answer's token ids + the user's next turn,
built with `next_turn_prompt`, so the model's own tokens are never re-tokenized. Step 2 asks to add c
to the previous answer and is rated against the number the model actually gave in step 1 (or the true
sum when it gave none). Each step's group gets its own feedback; the learner trains each on its own
completions only (the conversation before them is prompt, masked out of the loss).

Reward per answer, with partial credit so that SmolLM2-135M finds some from the start (it names the
right sum somewhere in about a fifth of its answers, and rarely answers with the number alone): 0.5 when
the right number appears, 0.3 more when it is the first number, 0.2 more when the answer is that number
and nothing else.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.task_runner import StepRow, parse_args, retrying, run_episodes  # noqa: E402
from grpo_server.client import AsyncClient  # noqa: E402

NUMBER = re.compile(r"-?\d+")


def first_number(text: str) -> int | None:
    match = NUMBER.search(text)
    return int(match.group(0)) if match else None


def score(text: str, expected: int) -> float:
    numbers = [int(n) for n in NUMBER.findall(text)]
    if expected not in numbers:
        return 0.0
    leads = numbers[0] == expected
    alone = text.strip().rstrip(".") == str(expected)
    return round(0.5 + 0.3 * leads + 0.2 * alone, 4)


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]


def follow_up(c: int) -> list[dict]:
    return [{"role": "user", "content": f"Add {c} to that. Answer with the number only."}]


async def episode(client: AsyncClient, name: str, rng: random.Random) -> list[StepRow]:
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    first = await retrying(lambda: client.complete(name, messages=question(a, b)))
    first_rewards = [score(x.text, a + b) for x in first.completions]
    await retrying(lambda: client.feedback(name, first.group_id, first_rewards))

    chosen = rng.choice(first.completions)
    prompt_ids = await retrying(lambda: client.next_turn_prompt(first, chosen, follow_up(c), experiment=name))
    second = await retrying(lambda: client.complete(name, prompt_token_ids=prompt_ids))
    previous = first_number(chosen.text)
    expected = (a + b if previous is None else previous) + c
    second_rewards = [score(x.text, expected) for x in second.completions]
    await retrying(lambda: client.feedback(name, second.group_id, second_rewards))
    return [
        {"turn": 1, "policy_version": first.policy_version, "reward": statistics.fmean(first_rewards)},
        {"turn": 2, "policy_version": second.policy_version, "reward": statistics.fmean(second_rewards)},
    ]


if __name__ == "__main__":
    args = parse_args(__doc__, default_config=str(Path(__file__).parent.parent / "configs" / "arithmetic_agent.yaml"))
    asyncio.run(run_episodes(args, episode))
