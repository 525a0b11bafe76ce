"""An experiment's sampling verbs: completions for feedback (a group, or an episode's turn), samples a client keeps
itself (Tinker's asample), and the bookkeeping of requests in flight. Part of `Experiment` (owner.py), whose fields
they read and write; `sample_and_score` is also the admin's path to the base model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Iterator

from grpo_server.api_models import CompletionOut, CompletionsRequest, CompletionsResponse
from grpo_server.protocol import log_context
from grpo_server.protocol.errors import TooManyRequests, Unavailable, Unprocessable
from grpo_server.protocol.wire import GenerateRequest, GenerateResponse, ScoreRequest
from grpo_server.runtime.chat_render import tool_calling_of
from grpo_server.runtime.groups import Group

if TYPE_CHECKING:
    from grpo_server.runtime.token_budget import TokenBudget
    from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

PAUSED_RETRY_AFTER_S = 30.0  # a pause is an operator's, for minutes or more: clients need not ask often


class SamplingVerbs:
    """`Experiment`'s sampling side (its fields are declared in owner.py)."""

    def refuse_while_paused(self) -> None:
        """An admin's pause holds every verb that samples or trains, whichever API family calls it: a 503 whose
        Retry-After makes a client's loop wait for the unpause rather than fail."""
        if self.paused:
            raise Unavailable(f"experiment {self.name!r} is paused by an admin: it samples and trains again once "
                              f"unpaused (POST /v1/experiments/{self.name}/unpause)", code="experiment_paused",
                              retry_after=PAUSED_RETRY_AFTER_S)

    async def complete(self, request: CompletionsRequest, group_id: str | None = None,
                       admitted: asyncio.Event | None = None) -> CompletionsResponse:
        """A group of completions under the serving version, kept for its feedback (or one turn of an episode).
        A stream (api/openai/streaming.py) names the group first (`group_id`) and starts once `admitted` is set.
        Requests admitted count from here to their end (tokenising included): their groups reach the queue
        later, and admitting more while the queue looks short only makes groups that go stale. An episode's
        later turns are work already admitted: held back, its earlier turns would be lost. A paused experiment
        samples nothing (`refuse_while_paused`)."""
        self.refuse_while_paused()
        backlog = self.server.max_queued_batches * self.config.algorithm.batch_groups
        in_pipeline = len(self.queue) + self.sampling_requests
        if in_pipeline >= backlog and not self.episodes.started(self.name, request.episode_id):
            raise TooManyRequests(f"{in_pipeline:.3g} groups of {self.name!r} are being sampled or wait for the "
                                  f"learner (max_queued_batches x batch_groups = {backlog}); retry shortly",
                                  code="learner_behind", retry_after=2.0)
        with self.sampling_request(1 / self.config.sampling.n if request.episode_id is not None else 1.0):
            return await self._admitted(request, group_id, admitted)

    async def _admitted(self, request: CompletionsRequest, group_id: str | None,
                        admitted: asyncio.Event | None) -> CompletionsResponse:
        name = self.name
        limits = self.server
        defaults = self.config.sampling
        n = request.n or defaults.n
        max_tokens = request.max_tokens or defaults.max_tokens
        if request.episode_id is not None:
            if request.n not in (None, 1):
                raise Unprocessable(f"an episode's turn is one completion (n = 1), not {request.n}: a group is "
                                    "several episodes, each with its own episode_id", code="episode_needs_n_1")
            n = 1
        if n > limits.max_n or max_tokens > limits.max_tokens:
            raise Unprocessable(f"n {n} / max_tokens {max_tokens} exceed the server's limits (max_n "
                                f"{limits.max_n}, max_tokens {limits.max_tokens})", code="over_limit")
        temperature = defaults.temperature if request.temperature is None else request.temperature
        decoding = (temperature, request.top_p or defaults.top_p)  # the distribution the learner scores under
        if request.episode_id is not None:
            return await self._episode_turn(request, max_tokens, decoding, admitted)
        if self.groups.pending_count(name) >= limits.max_pending_groups:
            raise TooManyRequests(f"{limits.max_pending_groups} groups of {name!r} await feedback "
                                  "(max_pending_groups); post feedback or let them expire",
                                  code="too_many_pending_groups", retry_after=5.0)
        prompt_ids = await self.prompts.off_loop(self.prompts.token_ids, request)
        self.prompts.check_fits(len(prompt_ids), max_tokens)
        result, version = await self._generate(request, prompt_ids, n, max_tokens, decoding, admitted)
        group = Group(group_id=group_id or self.groups.new_id(), experiment=name, prompt_token_ids=prompt_ids,
                      completions=result.completions, policy_version=version, temperature=temperature,
                      max_tokens=max_tokens, top_p=decoding[1])
        self.groups.add(group)
        self.counters.groups_sampled += 1
        return CompletionsResponse(group_id=group.group_id, policy_version=version, prompt_token_ids=prompt_ids,
                                   completions=[CompletionOut(**c.model_dump()) for c in result.completions])

    async def _episode_turn(self, request: CompletionsRequest, max_tokens: int, decoding: tuple[float, float],
                            admitted: asyncio.Event | None) -> CompletionsResponse:
        """One completion in its episode (runtime/episodes.py): a repeated history continues from its sampled ids."""
        limits = self.server
        episode = self.episodes.open(self.name, request.episode_id, limits.max_pending_episodes,
                                     limits.max_episode_turns)
        try:
            episode.check_decoding(*decoding)
            continued = episode.continuation(request.messages)
            prompt_ids = await (self.prompts.off_loop(self.prompts.continue_conversation, *continued,
                                                      tools=request.tools)
                                if continued else self.prompts.off_loop(self.prompts.token_ids, request))
            self.prompts.check_fits(len(prompt_ids), max_tokens)
            if episode.tokens_with(prompt_ids, max_tokens) > limits.max_episode_tokens:
                raise Unprocessable(f"episode {episode.episode_id} would hold more than max_episode_tokens "
                                    f"({limits.max_episode_tokens}) with this turn", code="episode_too_long")
            result, version = await self._generate(request, prompt_ids, 1, max_tokens, decoding, admitted)
            self.counters.episodes_started += episode.turns == 0
            self.counters.episode_turns += 1
            episode.add_turn(prompt_ids, result.completions[0], version, request.messages, decoding)
        finally:
            self.episodes.done(episode)
        return CompletionsResponse(
            group_id=None, episode_id=episode.episode_id, policy_version=version, prompt_token_ids=prompt_ids,
            completions=[CompletionOut(**c.model_dump()) for c in result.completions],
        )

    async def _generate(self, request: CompletionsRequest, prompt_ids: list[int], n: int, max_tokens: int,
                        decoding: tuple[float, float], admitted: asyncio.Event | None) -> tuple[GenerateResponse, int]:
        """Sample under the serving version, once its worst case fits the token budget (else 429 before `admitted`
        is set; the caller stores the result before any await, as the reservation ends), chosen once the sampling
        turn starts: a request that waited for a train step samples the version that step pushed."""
        with self.budget.reserve(self.name, len(prompt_ids) + n * max_tokens):
            if admitted is not None:
                admitted.set()
            async with self.workers.sampler(experiment=self.name) as sampler:
                with self.pinned_serving_version() as version, log_context.bound(version=version):
                    result = await sampler.generate(GenerateRequest(
                        prompt_token_ids=prompt_ids, n=n, temperature=decoding[0], top_p=decoding[1],
                        max_tokens=max_tokens,
                        stop=request.stop, seed=request.seed, adapter=self.adapter(version),
                        tool_calling=tool_calling_of(request),
                    ))
        self.last_served_as = result.served_as
        self.counters.completions_sampled += len(result.completions)
        self.counters.tokens_sampled += sum(len(c.token_ids) for c in result.completions)
        return result, version

    @contextlib.contextmanager
    def sampling_request(self, share: float = 1.0) -> Iterator[None]:
        """Counts a sampler request (`share` of a group) from its admission (it may await a turn) to its end."""
        self.sampling_requests += share
        self.last_sampling_at = time.monotonic()
        try:
            yield
        finally:
            self.sampling_requests -= share

    async def sample_for_client(self, request: GenerateRequest, version: tuple[int, str] | None,
                                score_prompt: bool = False) -> tuple[GenerateResponse, list[float] | None]:
        """Samples a client keeps itself (the Tinker API's asample), under `version` (its number and folder, loaded
        and pinned while they run; None: the base model), with the prompt's own logprobs when `score_prompt`. Not
        a group for training, so no admission by the learner's backlog; but the same walls as `complete`
        otherwise: the token budget holds the worst case while it runs (429 before any work), it is sampled in
        this experiment's sampling turn, the counters count it, and a pause holds it."""
        self.refuse_while_paused()
        loaded = self.version_loaded(*version) if version is not None else None
        adapter = self.adapter(version[0]) if version is not None else None
        self.last_sampling_at = time.monotonic()
        result, scored = await sample_and_score(self.workers, self.budget, self.name, self.name,
                                                request.model_copy(update={"adapter": adapter}), score_prompt, loaded)
        self.counters.completions_sampled += len(result.completions)
        self.counters.tokens_sampled += sum(len(c.token_ids) for c in result.completions)
        return result, scored

    def abandon(self, group_id: str | None, episode_id: str | None = None) -> None:
        """Drop what `complete` stored for a client that left before receiving it (a stream cut short): its group
        (unrateable, it would hold a pending slot), or its episode's newest turn (a retry continues before it)."""
        if group_id is not None and self.groups.discard(self.name, group_id):
            log.info("%s: group %s dropped: its client left the stream before receiving it", self.name, group_id)
        if episode_id is not None:
            self.episodes.undo_turn(self.name, episode_id)
            log.info("%s: episode %s: newest turn undone: its client left the stream before it", self.name, episode_id)

    def expired(self, groups: int = 0, episodes: int = 0) -> None:
        """Their stores dropped `groups` and `episodes` of this experiment without feedback."""
        self.counters.groups_expired += groups
        self.counters.episodes_expired += episodes


async def sample_and_score(workers: "WorkerPool", budget: TokenBudget, holder: str, experiment: str | None,
                           request: GenerateRequest, score_prompt: bool,
                           loaded: contextlib.AbstractAsyncContextManager | None = None,
                           ) -> tuple[GenerateResponse, list[float] | None]:
    """`request` sampled in `experiment`'s sampling turn (None: no experiment's) and, with `score_prompt`, the
    prompt's own logprobs (from its second token: the first has none) on the same weights; the token budget holds
    the worst case under `holder` meanwhile (429 before any work, `loaded` included: what to enter before sampling,
    e.g. the version loaded). `Experiment.sample_for_client`'s work, and the admin's samples of the base model."""
    prompt, scored = request.prompt_token_ids, None
    with budget.reserve(holder, len(prompt) * (2 if score_prompt else 1) + request.n * request.max_tokens):
        async with loaded or contextlib.nullcontext(), workers.sampler(experiment=experiment) as sampler:
            result = await sampler.generate(request)
            if score_prompt and len(prompt) > 1:
                scored = (await sampler.score(ScoreRequest(prompt_token_ids=prompt[:1],
                                                           completions_token_ids=[prompt[1:]],
                                                           adapter=request.adapter))).logprobs[0]
    return result, scored
