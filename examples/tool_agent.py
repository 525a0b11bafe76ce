"""A tool-using agent on the OpenAI Agents SDK (`openai-agents`), trained through grpo_server's episodes.

    STEPS=2 TASKS=tool_agent scripts/demo                        # a server of its own, then this
    GRPO_SERVER_API_KEY=... python examples/tool_agent.py --steps 2  # against a running server
    TOOL_CHOICE=required python examples/tool_agent.py --steps 8     # the forced variant

The agent has one function tool, `add(a, b)`, and is asked "What is 17 + 25?". The SDK drives it as it
would drive any model: turn 1 should call `add` (the server renders the tool in the Hermes format for
SmolLM2 and parses the model's `<tool_call>` into `message.tool_calls`), the SDK runs the tool and sends its
result back, turn 2 should answer with the sum. Nothing in the agent knows about GRPO: it gets an
`AsyncOpenAI` pointed at the server whose every call carries the episode's id (`Episode.openai_client()`),
so the server keeps the episode's turns. A group is G runs of the same question, each its own episode,
run at once; `rate_episodes` then rates them together: every token the model sampled in an episode trains
with that episode's advantage (the prompts and the tool's output are masked).

The first turn's `tool_choice` is "auto" by default: the model decides whether to call. Left free, the
untrained SmolLM2-135M-Instruct never calls the tool (0 parsed calls in 192 chat completions and 32 SDK
runs at T=1 with this and five other prompts, one-shot examples included; most groups all zero: nothing
to compare). So a warm start comes first (examples/tool_agent_warmstart.py): WARM_START waves (default 4),
each one question whose two groups (the model's own tries at the call, then at the answer after a
demonstrated call) get DEMOS demonstrations (default 4) added as external completions rated 1.0, in the
exact tokens the server's Hermes parser reads; one learner step a wave. Then RL under "auto" with `score`,
whose format part now matters. An evaluation pass (EVAL_RUNS unforced runs, default 32, the same
questions each time, never rated) runs before training, after the warm start and after RL, and prints the
share of runs that called `add`, the share that answered with the sum and the mean reward. Measured
(docs/benchmarks/findings.md "The tool agent"; `STEPS=10 TASKS=tool_agent scripts/demo`, 797 s at load ~3): runs that
called `add` 0/32 -> 22/32 after the 4 waves (3 versions) -> 32/32 after RL (version 13); answered with
the sum 4/32 -> 19/32 -> 32/32; mean reward 0.05 -> 0.64 -> 1.00.

`TOOL_CHOICE=required` forces the first call instead (no warm start): the server's grammar makes the call
well formed and the model chooses the arguments and the answer (23 of 32 runs passed both numbers, 11 of
32 answered with the sum before training), but a forced token barely trains (docs/guides/agents.md, "What the
constraint does to the importance ratio"), so this teaches the arguments and the answer, not the call.

Reward (`score`, 0..1), shaped so that a 135M model finds some from the start and can climb:
- the format (0.3): the first call is a parsed call to `add` (0.3); a parsed call to another function
  (0.15); no parsed call but a `<tool_call>` tag written as text, a call the parser could not read (0.1);
- the arguments (0.3): 0.15 for each of the question's two numbers among the call's `a` and `b`;
- the answer (0.4): the run's final message (a turn without calls) has the sum in it.
Under "required" the format part is always earned; under "auto" it rewards making the call at all.

Nothing here calls api.openai.com: tracing is off, the model is an `OpenAIChatCompletionsModel` on the
episode's client (no default client or provider is used).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agents import (Agent, AgentsException, ModelSettings, OpenAIChatCompletionsModel, RunConfig,  # noqa: E402
                    RunHooks, Runner, function_tool, set_tracing_disabled)
from openai import APIStatusError  # noqa: E402
from tqdm import tqdm  # noqa: E402

from examples.task_runner import (StepRow, ensure_experiment, experiment_config, parse_args, retrying,  # noqa: E402
                                  run_episodes)
from grpo_server.client import AsyncClient, Episode  # noqa: E402

set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI

# The first turn's tool_choice (the SDK resets it to "auto" once a tool ran, so the answer is free).
TOOL_CHOICE = os.environ.get("TOOL_CHOICE", "auto")
# Under "auto": demonstration waves before RL (examples/tool_agent_warmstart.py), each one question, two
# groups (the call, the answer) and one learner step; demonstrations per group. Under "required": none.
WARM_START = int(os.environ.get("WARM_START", "4" if TOOL_CHOICE == "auto" else "0"))
DEMOS = int(os.environ.get("DEMOS", "4"))
EVAL_RUNS = int(os.environ.get("EVAL_RUNS", "32"))  # unforced runs at each evaluation point (0: none)
CONFIG = {  # the experiment (as configs/*.yaml); `--config FILE` replaces it
    "name": "tool_agent",
    # 2e-3 under "auto": the warm start has a few steps to move the call from never sampled to likely (at
    # 2e-3 its logprob went -22 -> -11 -> -4 nats in three waves; at 5e-4, after one wave of 2 demos, 0 of
    # 8 evaluation runs called). The forced variant was measured at 5e-4.
    "algorithm": {"learning_rate": 2.0e-3 if TOOL_CHOICE == "auto" else 5.0e-4, "batch_groups": 2,
                  "micro_batch_size": 4},  # ~300-token episodes
    "sampling": {"n": 8, "temperature": 1.0, "max_tokens": 48},  # n: episodes per group
}
INSTRUCTIONS = ("You are a calculator assistant. To add two numbers, call the add function. "
                "Then answer with the result.")
MAX_TURNS = 2  # call, then answer
NUMBER = re.compile(r"-?\d+")


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def question(rng: random.Random) -> tuple[int, int]:
    return rng.randint(10, 49), rng.randint(10, 49)


def prompt(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


# --- what one run did, and its reward ---------------------------------------------------------------------


@dataclass
class Turn:
    """One model response: its text, and the tool calls the server parsed out of it (name, JSON arguments)."""

    text: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)


class Transcript(RunHooks):
    """Records every model response of a run, also when the run ends in an error."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.tool_results: list[Any] = []  # what the SDK's tool runs returned
        self.error: str | None = None

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: Any) -> None:
        self.tool_results.append(result)

    async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
        turn = Turn()
        for item in response.output:
            if item.type == "function_call":
                turn.calls.append((item.name, item.arguments))
            elif item.type == "message":
                turn.text += "".join(getattr(part, "text", None) or "" for part in item.content)
        self.turns.append(turn)


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def score(turns: list[Turn], a: int, b: int) -> float:
    """The reward of one run (see the module docstring)."""
    calls = [call for turn in turns for call in turn.calls]
    if calls:
        name, arguments = calls[0]
        form = 0.3 if name == "add" else 0.15
    else:
        form = 0.1 if any("<tool_call>" in turn.text for turn in turns) else 0.0
    given: list[Any] = []
    add_calls = [arguments for name, arguments in calls if name == "add"]
    if add_calls:
        parsed = _arguments(add_calls[0])
        given = [parsed.get("a"), parsed.get("b")]
    wanted = [a, b]
    matched = 0
    for value in given:
        if value in wanted:
            wanted.remove(value)
            matched += 1
    final = turns[-1] if turns and not turns[-1].calls else None
    answered = final is not None and a + b in [int(n) for n in NUMBER.findall(final.text)]
    return round(form + 0.15 * matched + 0.4 * answered, 4)


# --- one run, one group -----------------------------------------------------------------------------------


def make_agent(episode: Episode, settings: ModelSettings) -> tuple[Agent, Any]:
    """The agent on this episode's client (returned too, to be closed after the run)."""
    # 429 (the learner is behind: turns wait while it trains) and 503 are retried, after the Retry-After
    # the server sends; the SDK leaves these retries to the openai client.
    llm = episode.openai_client(max_retries=1000)
    model = OpenAIChatCompletionsModel(model=episode.experiment, openai_client=llm)
    return Agent(name="calculator", instructions=INSTRUCTIONS, tools=[add], model=model,
                 model_settings=settings), llm


async def run_once(episode: Episode, settings: ModelSettings, a: int, b: int,
                   max_turns: int = MAX_TURNS) -> Transcript:
    """One run of the agent as one episode; its transcript, whatever the run's end."""
    agent, llm = make_agent(episode, settings)
    transcript = Transcript()
    try:
        await Runner.run(agent, prompt(a, b), max_turns=max_turns, hooks=transcript,
                         run_config=RunConfig(tracing_disabled=True))
    except AgentsException as exc:  # too many turns, an unknown tool, unreadable arguments: the model's doing
        transcript.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    except APIStatusError as exc:  # the server refused a turn: the run is scored as it went, and said so
        transcript.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        tqdm.write(f"tool_agent: a run ended with {transcript.error}")
    finally:
        await llm.close()
    return transcript


def sampling_settings(config: dict, tool_choice: str = TOOL_CHOICE, **more: Any) -> ModelSettings:
    sampling = config.get("sampling", {})
    return ModelSettings(temperature=sampling.get("temperature", 1.0), max_tokens=sampling.get("max_tokens", 48),
                         tool_choice=tool_choice, **more)


async def group(client: AsyncClient, name: str, a: int, b: int, size: int,
                settings: ModelSettings) -> tuple[list[float], list[Transcript], int]:
    """`size` runs of one question at once, rated together: (rewards, transcripts, the policy version once
    they ended: while the learner trains, turns wait (429) and are sampled by the version it pushes)."""
    episodes = [client.episode(name) for _ in range(size)]
    transcripts = await asyncio.gather(*(run_once(e, settings, a, b) for e in episodes))
    version = (await client.status(name)).policy_version
    rewards = [score(t.turns, a, b) for t in transcripts]
    sampled = [(e, r) for e, r, t in zip(episodes, rewards, transcripts) if t.turns]  # a run the server saw
    if len(sampled) >= 2:
        await retrying(lambda: client.rate_episodes(name, [e for e, _ in sampled], [r for _, r in sampled]))
    return rewards, list(transcripts), version


def make_episode(config: dict):
    """The task_runner `Episode` (here: one group of agent runs per call)."""
    size = int(config.get("sampling", {}).get("n", 8))
    settings = sampling_settings(config)

    async def one_group(client: AsyncClient, name: str, rng: random.Random) -> list[StepRow]:
        a, b = question(rng)
        rewards, _, version = await group(client, name, a, b, size, settings)
        return [{"turn": 1, "policy_version": version, "reward": statistics.fmean(rewards)}]
    return one_group


async def main(args: Any) -> dict:
    """Evaluate, warm-start (under "auto"), evaluate, RL for `--steps` versions, evaluate."""
    # The warm start imports this module's agent and reward (as `examples.tool_agent`, a second copy of it
    # when this file runs as __main__: the same code, so the same agent).
    from examples.tool_agent_warmstart import describe, evaluate, warm_start

    config = experiment_config(args)
    name, seed = config["name"], args.seed + 1  # the evaluation's questions: the same at every point
    report: dict[str, Any] = {"tool_choice": TOOL_CHOICE}
    started = time.monotonic()
    async with AsyncClient(args.url, args.api_key) as client:
        await ensure_experiment(client, config)
        if EVAL_RUNS:
            report["before"] = await evaluate(client, name, config, EVAL_RUNS, seed)
            print(describe("before training", report["before"]))
        if WARM_START:
            report["warm_start"] = await warm_start(client, args.api_key, name, config, WARM_START, DEMOS, args.seed)
            print(f"tool_agent warm start: {report['warm_start']}")
            if EVAL_RUNS:
                report["after_warm_start"] = await evaluate(client, name, config, EVAL_RUNS, seed)
                print(describe("after the warm start", report["after_warm_start"]))
    report["rl"] = await run_episodes(args, make_episode(config))
    if EVAL_RUNS:
        async with AsyncClient(args.url, args.api_key) as client:
            report["after_rl"] = await evaluate(client, name, config, EVAL_RUNS, seed)
        for point, key in (("before training", "before"), ("after the warm start", "after_warm_start"),
                           ("after RL", "after_rl")):
            if key in report:
                print(describe(point, report[key]))
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(f"tool_agent: {TOOL_CHOICE}, warm start {WARM_START} waves x {DEMOS} demos, {report['wall_s']} s in all")
    return report


if __name__ == "__main__":
    asyncio.run(main(parse_args(__doc__, default_config=CONFIG)))
