"""Completions the model did not sample (a teacher's answer, a human fix), added to a group's feedback:
their token ids, and their behaviour logprobs scored by a sampler under the serving version."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from grpo_server.api_models import ExternalCompletion
from grpo_server.protocol.wire import Completion, ScoreRequest
from grpo_server.runtime.groups import Group

if TYPE_CHECKING:
    from grpo_server.runtime.prompts import PromptBuilder
    from grpo_server.workers.pool import WorkerPool


class Scorer(Protocol):
    """What scoring needs of an experiment (runtime/experiment/'s Experiment, which calls this module, so it
    is not imported here)."""

    name: str
    workers: "WorkerPool"
    prompts: "PromptBuilder"

    def sampling_request(self, share: float = 1.0) -> contextlib.AbstractContextManager[None]: ...

    def pinned_serving_version(self) -> contextlib.AbstractContextManager[int]: ...


def external_token_ids(prompts: "PromptBuilder", group: Group, external: list[ExternalCompletion]) -> list[list[int]]:
    """Each completion's ids, checked against the vocabulary and the context (400s name the bad one)."""
    token_ids = []
    for i, completion in enumerate(external):
        ids = prompts.external_completion_ids(completion, f"completions[{i}]")
        prompts.check_fits(len(group.prompt_token_ids), len(ids), f"completions[{i}]")
        token_ids.append(ids)
    return token_ids


async def score_external(exp: Scorer, group: Group, token_ids: list[list[int]]) -> tuple[int, list[Completion]]:
    """Score completions the model did not sample under the serving version: those logprobs are
    their behaviour logprobs, so the first step's importance ratio is 1 (docs/guides/python-client.md,
    "External completions")."""
    with exp.sampling_request():
        async with exp.workers.sampler(experiment=exp.name) as sampler:
            with exp.pinned_serving_version() as version:
                scored = await sampler.score(ScoreRequest(
                    prompt_token_ids=group.prompt_token_ids, completions_token_ids=token_ids,
                    temperature=group.temperature, adapter=exp.adapter(version),
                ))
    return version, [Completion(text=exp.prompts.decode(ids), token_ids=ids, logprobs=logprobs,
                                finish_reason="external")
                     for ids, logprobs in zip(token_ids, scored.logprobs)]
