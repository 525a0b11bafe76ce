"""A verifiers environment trained through grpo_server: verifiers runs the rollouts and scores them with its
rubric, the server samples them (its OpenAI-compatible /v1) and trains on the rewards.

    scripts/setup     # verifiers==0.1.10 (the `verifiers` extra, in `dev` too; GRPO_EXTRAS=verifiers names it)
    GRPO_SERVER_API_KEY=... .venv/bin/python examples/verifiers_env.py --steps 20
    TASKS=verifiers scripts/demo                 # the same, with the server started on the embedded model

The task: which of two words comes first in alphabetical order, answered with that word alone. The dataset is
made here from examples/words.py (300 pairs, fixed seed; nothing is downloaded). verifiers' `SingleTurnEnv`
holds it with a `Rubric` of two reward functions: the right word named and the other not (0.7), and a
one-word answer (0.3). SmolLM2-135M answers in sentences at first, naming one word or both, so the rewards
of a group spread from the start.

Each rollout is one episode of the server's (README, Agents): verifiers' own `env.rollout` with the server's
`AsyncOpenAI` and the episode's id in `extra_body`, so the server keeps the turn's tokens and logprobs. A
group is `rollouts_per_example` rollouts of one question; `env.rubric.score_group` scores them and the
rewards go back as `{episode_ids, rewards}`, so that each rollout trains with its advantage in the group.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.task_runner import StepRow, parse_args, retrying, run_episodes  # noqa: E402
from examples.words import WORDS  # noqa: E402
from grpo_server.client import AsyncClient  # noqa: E402

DATASET_SIZE = 300
DATASET_SEED = 27
QUESTION = "Which word comes first in alphabetical order, {a} or {b}? Answer with that one word only."
CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "verifiers_env.yaml"


def word_pairs(size: int = DATASET_SIZE, seed: int = DATASET_SEED) -> list[dict[str, Any]]:
    """The dataset's rows (verifiers' columns: `question`, `answer`, `info`), the same every run."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.sample(WORDS, 2)
        rows.append({"question": QUESTION.format(a=a, b=b), "answer": min(a, b), "info": {"other": max(a, b)}})
    return rows


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def right_word(completion: Any, answer: str, info: dict, parser: Any) -> float:
    """1 for naming the first word and not the other; 0.3 for naming both, the right one first."""
    named = [w for w in _words(parser.parse_answer(completion) or "") if w in (answer, info["other"])]
    if not named:
        return 0.0
    if set(named) == {answer}:
        return 1.0
    return 0.3 if named[0] == answer else 0.0


def one_word(completion: Any, parser: Any) -> float:
    """1 for a one-word answer, less for each word more (nothing at 9 words)."""
    count = len(_words(parser.parse_answer(completion) or ""))
    return 0.0 if count == 0 else max(0.0, 1.0 - (count - 1) / 8)


def load_environment(size: int = DATASET_SIZE) -> Any:
    """The verifiers environment (as verifiers' `load_environment` convention names it)."""
    import verifiers as vf
    from datasets import Dataset

    parser = vf.Parser()  # the answer is the completion's text as it is
    rubric = vf.Rubric(funcs=[right_word, one_word], weights=[0.7, 0.3], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(word_pairs(size)), parser=parser, rubric=rubric)


def sampling_args(config: dict) -> dict:
    sampling = config.get("sampling", {})
    # n: 1, one turn of one episode per call (verifiers checks for one choice). logprobs and vLLM's
    # return_token_ids: verifiers then keeps each turn's prompt and completion ids and logprobs in its
    # trajectory (`tokens`), as it does against vLLM for a trainer of its own.
    return {"n": 1, "temperature": sampling.get("temperature", 1.0), "max_tokens": sampling.get("max_tokens", 16),
            "logprobs": True, "extra_body": {"return_token_ids": True}}


async def rate_group(env: Any, oai: Any, client: AsyncClient, name: str, row: dict, size: int,
                     sampling: dict) -> tuple[list[float], list[Any]]:
    """`size` rollouts of `row`, each its own episode, scored together by the rubric and rated together on the
    server. Returns the rewards and verifiers' states (each with its `trajectory`)."""
    import verifiers as vf

    episodes = [client.episode(name) for _ in range(size)]
    states = await asyncio.gather(*(
        env.rollout(dict(row), oai, name, {**sampling, "extra_body": {**sampling.get("extra_body", {}),
                                                                      **episode.extra_body}})
        for episode in episodes))
    # verifiers calls an empty answer an error (EmptyModelResponseError), but the server sampled it: it is rated
    # (the rubric gives it 0). Any other error is a call that failed, whose episode the server does not have.
    failed = [s["error"] for s in states if s.get("error") is not None
              and not isinstance(s["error"], vf.EmptyModelResponseError)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {size} rollouts failed: {failed[0]!r}")
    await env.rubric.score_group(states)
    rewards = [float(s["reward"]) for s in states]
    await retrying(lambda: client.rate_episodes(name, episodes, rewards))
    return rewards, states


def make_episode(config: dict, api_key: str, url: str):
    """The task_runner `Episode`: one group of verifiers rollouts per call."""
    import openai

    env = load_environment()
    rows = list(env.get_dataset())
    size = int(config.get("sampling", {}).get("n", 8))  # rollouts per example
    sampling = sampling_args(config)
    # verifiers' client calls go straight to the server's /v1; back-pressure (429) is waited out by the SDK
    oai = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=1000, timeout=600)

    async def one_group(client: AsyncClient, name: str, rng: random.Random) -> list[StepRow]:
        rewards, _ = await rate_group(env, oai, client, name, rng.choice(rows), size, sampling)
        version = (await client.status(name)).policy_version
        return [{"turn": 1, "policy_version": version, "reward": statistics.fmean(rewards)}]
    return one_group


if __name__ == "__main__":
    args = parse_args(__doc__, default_config=str(CONFIG_PATH))
    from examples.task_runner import experiment_config

    asyncio.run(run_episodes(args, make_episode(experiment_config(args), args.api_key, args.url)))
