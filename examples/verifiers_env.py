"""A verifiers environment trained through grpo_server: verifiers (0.4.0) runs the rollouts and scores them
with its rewards, the server samples them (its OpenAI-compatible /v1) and trains on the rewards.

    scripts/setup     # also makes .venv-verifiers: grpo-server's client + verifiers==0.4.0 (the `verifiers` extra)
    GRPO_SERVER_API_KEY=... .venv-verifiers/bin/python examples/verifiers_env.py --steps 20
    TASKS=verifiers scripts/demo                 # the same, with the server started on the embedded model

verifiers 0.4.0 wants openai>=2.54,<3 and the project's dev tools openai 3.57 (the Agents SDK 0.24 needs >=3),
so it lives in its own environment, `.venv-verifiers`, beside the server's `.venv`; only HTTP joins them.

The task: which of two words comes first in alphabetical order, answered with that word alone. The dataset is
made here from examples/words.py (300 pairs, fixed seed; nothing is downloaded). verifiers holds it as the
taskset `alphabetical-first` (examples/alphabetical_first.py) whose tasks carry two weighted `@vf.reward`s:
the right word named and the other not (0.7), and a one-word answer (0.3). SmolLM2-135M answers in sentences
at first, naming one word or both, so the rewards of a group spread from the start.

Each rollout is one episode of the server's (docs/guides/agents.md): verifiers' own `env.run_episode` on its
`SingleAgentEnv`, the model reached through verifiers' interception and eval client (an OpenAI-compatible
endpoint: the server's /v1, `EvalClientConfig`), the episode's id in the rollout's sampling (`episode_id`,
which verifiers puts in the body of every call), so the server keeps the turn's tokens and logprobs. A group
is `sampling.n` rollouts of one task; each trace's `reward` is verifiers' weighted sum of its rewards, and the
rewards go back as `{episode_ids, rewards}`, so that each rollout trains with its advantage in the group.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES.parent))

from examples.task_runner import StepRow, parse_args, retrying, run_episodes  # noqa: E402
from examples.words import WORDS  # noqa: E402
from grpo_server.client import AsyncClient  # noqa: E402

DATASET_SIZE = 300
DATASET_SEED = 27
QUESTION = "Which word comes first in alphabetical order, {a} or {b}? Answer with that one word only."
CONFIG_PATH = EXAMPLES.parent / "configs" / "verifiers_env.yaml"
TASKSET_ID = "alphabetical-first"  # examples/alphabetical_first.py
WEIGHTS = {"right_word": 0.7, "one_word": 0.3}
API_KEY_VAR = "GRPO_SERVER_API_KEY"  # verifiers' client configs name the key's variable, not the key


def word_pairs(size: int = DATASET_SIZE, seed: int = DATASET_SEED) -> list[dict[str, Any]]:
    """The dataset's rows (`question`, `answer`, `other`), the same every run."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.sample(WORDS, 2)
        rows.append({"question": QUESTION.format(a=a, b=b), "answer": min(a, b), "other": max(a, b)})
    return rows


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def right_word(reply: str, answer: str, other: str) -> float:
    """1 for naming the first word and not the other; 0.3 for naming both, the right one first."""
    named = [w for w in _words(reply) if w in (answer, other)]
    if not named:
        return 0.0
    if set(named) == {answer}:
        return 1.0
    return 0.3 if named[0] == answer else 0.0


def one_word(reply: str) -> float:
    """1 for a one-word answer, less for each word more (nothing at 9 words)."""
    count = len(_words(reply))
    return 0.0 if count == 0 else max(0.0, 1.0 - (count - 1) / 8)


def load_environment(size: int = DATASET_SIZE) -> Any:
    """verifiers' `SingleAgentEnv` on the `alphabetical-first` taskset, its harness run in this process
    (verifiers' `subprocess` runtime: nothing is provisioned, no container or sandbox)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # verifiers imports a taskset id as a top-level module
    import verifiers.v1 as vf

    config = vf.SingleAgentEnvConfig(taskset={"id": TASKSET_ID, "size": size},
                                     agent={"runtime": {"type": "subprocess"}})
    return vf.load_environment(config)


def sampling_args(config: dict) -> dict:
    """The rollouts' sampling, which verifiers imposes on every model call (n 1: one turn of one episode).
    logprobs and vLLM's return_token_ids: the server's token fields come back through verifiers' relay to
    the harness, which keeps them on the trace (examples/alphabetical_first.py)."""
    sampling = config.get("sampling", {})
    return {"temperature": sampling.get("temperature", 1.0), "max_tokens": sampling.get("max_tokens", 16),
            "n": 1, "logprobs": True, "extra_body": {"return_token_ids": True}}


def model_context(url: str, name: str, episode: Any, sampling: dict) -> Any:
    """The model of one rollout: the experiment `name` on the server's /v1, the episode's id in its body."""
    import verifiers.v1 as vf

    extra_body = {**sampling.get("extra_body", {}), **episode.extra_body}
    client = vf.EvalClientConfig(base_url=url.rstrip("/") + "/v1", api_key_var=API_KEY_VAR,
                                 timeout={"connect": 30.0, "read": 600.0})
    return vf.ModelContext(model=name, client=client, sampling=vf.Sampling(**{**sampling, "extra_body": extra_body}))


async def rate_group(env: Any, client: AsyncClient, url: str, name: str, task: Any, size: int,
                     sampling: dict) -> tuple[list[float], list[Any]]:
    """`size` rollouts of `task`, each its own episode, scored by verifiers and rated together on the
    server. Call inside `env.serving()`. Returns the rewards and verifiers' traces."""
    episodes = [client.episode(name) for _ in range(size)]
    results = await asyncio.gather(*(env.run_episode(task, model_context(url, name, episode, sampling))
                                      for episode in episodes))
    # A failed rollout is one whose call failed: the server has no turn of that episode to rate.
    failed = [(r.errors or [e for t in r.traces for e in t.errors]) for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {size} rollouts failed: {failed[0]!r}")
    traces = [r.traces[0] for r in results]
    rewards = [float(t.reward) for t in traces]
    await retrying(lambda: client.rate_episodes(name, episodes, rewards))
    return rewards, traces


def make_episode(env: Any, config: dict, url: str):
    """The task_runner `Episode`: one group of verifiers rollouts per call (inside `env.serving()`)."""
    tasks = list(env.taskset)
    size = int(config.get("sampling", {}).get("n", 8))  # rollouts per task
    sampling = sampling_args(config)

    async def one_group(client: AsyncClient, name: str, rng: random.Random) -> list[StepRow]:
        rewards, _ = await rate_group(env, client, url, name, rng.choice(tasks), size, sampling)
        version = (await client.status(name)).policy_version
        return [{"turn": 1, "policy_version": version, "reward": statistics.fmean(rewards)}]
    return one_group


async def main(args: Any) -> dict:
    from examples.task_runner import experiment_config

    os.environ[API_KEY_VAR] = args.api_key
    env = load_environment()
    async with env.serving():
        return await run_episodes(args, make_episode(env, experiment_config(args), args.url))


if __name__ == "__main__":
    asyncio.run(main(parse_args(__doc__, default_config=str(CONFIG_PATH))))
