"""`Experiment.complete`'s back-pressure (max_queued_batches x batch_groups): a request counts from its admission,
so requests still tokenising on the tokenizer threads cannot all slip past the check at once (the mixed load
round saw 35 groups queued against a limit of 8); an episode's later turns are not new work and are never held
back by it, or the episode's earlier turns would be lost."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from grpo_server.api_models import CompletionsRequest
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol.errors import TooManyRequests
from grpo_server.protocol.wire import Completion, GenerateResponse
from grpo_server.runtime.episodes import EpisodeStore
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.groups import GroupStore


class HeldPrompts:
    """A tokenizer thread that answers once `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def off_loop(self, method, *args, **kwargs):
        await self.release.wait()
        return method(*args, **kwargs)

    def token_ids(self, request) -> list[int]:
        return [1, 2, 3]

    def check_fits(self, *args) -> None:
        pass


class Sampler:
    async def generate(self, request) -> GenerateResponse:
        return GenerateResponse(prompt_token_ids=request.prompt_token_ids, completions=[
            Completion(text="x", token_ids=[5], logprobs=[-0.5], finish_reason="stop")] * request.n)


class Workers:
    @contextlib.asynccontextmanager
    async def sampler(self, take_turn: bool = True, experiment: str | None = None):
        yield Sampler()

    async def unload_everywhere(self, ref) -> None:
        pass


def experiment() -> Experiment:
    config = ExperimentConfig.model_validate({"name": "exp", "algorithm": {"batch_groups": 2},
                                              "sampling": {"n": 2}})
    return Experiment(config=config, workers=Workers(), server=ServerConfig(max_queued_batches=1),
                      prompts=HeldPrompts(), groups=GroupStore(ttl_s=600), episodes=EpisodeStore(ttl_s=600))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_requests_still_tokenising_count_against_the_backlog():
    exp = experiment()  # backlog: 1 batch x 2 groups
    tasks = [asyncio.create_task(exp.complete(CompletionsRequest(prompt="hi"))) for _ in range(5)]
    await settle()
    exp.prompts.release.set()
    answers = await asyncio.gather(*tasks, return_exceptions=True)
    refused = [a for a in answers if isinstance(a, TooManyRequests)]
    assert len(refused) == 3 and {a.code for a in refused} == {"learner_behind"}, answers
    assert exp.groups.pending_count("exp") == 2 and exp.sampling_requests == 0


async def test_an_episodes_later_turns_are_not_held_back():
    exp = experiment()
    exp.prompts.release.set()
    first = CompletionsRequest(prompt="hi", episode_id="ep1")
    await exp.complete(first)  # the episode's first turn
    exp.queue.extend([object(), object()])  # the learner is behind: the backlog is full
    with pytest.raises(TooManyRequests) as new_episode:
        await exp.complete(CompletionsRequest(prompt="hi", episode_id="ep2"))
    assert new_episode.value.code == "learner_behind"
    assert (await exp.complete(CompletionsRequest(prompt="more", episode_id="ep1"))).episode_id == "ep1"
    assert exp.episodes.pending_count("exp") == 1
