"""One experiment's owner in the front end: the only code that changes its serving version, its loaded
adapter versions, its groups (pending and queued for training), its counters and its background tasks.

Requests come in through `complete` and `feedback`; its training task (`runtime/training.py`) takes
batches, and reports trained steps and pushed versions back through the methods below, as its version
checks (`runtime/verification.py`) do; `stop` cancels and awaits every task it started. Everything else
(status, /metrics, the orchestrator's re-syncs) reads it and calls its methods, never writes its fields."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine, Iterator

from grpo_server.api_models import (CompletionOut, CompletionsRequest, CompletionsResponse, ExperimentCounters,
                                    FeedbackRequest, FeedbackResponse, VerificationResult)
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol import log_context
from grpo_server.protocol.errors import TooManyRequests, Unprocessable
from grpo_server.protocol.wire import (AdapterRef, AdapterVersion, GenerateRequest, GenerateResponse, ScoreRequest,
                                       TrainMetrics)
from grpo_server.runtime.advantages import rate
from grpo_server.runtime.chat_render import tool_calling_of
from grpo_server.runtime.episodes import EpisodeStore, check_rateable, trajectory_group
from grpo_server.runtime.external import external_token_ids, score_external
from grpo_server.runtime.groups import Group, GroupStore
from grpo_server.runtime.journal import FeedbackJournal
from grpo_server.runtime.tasks import OwnedTasks
from grpo_server.runtime.token_budget import TokenBudget

if TYPE_CHECKING:
    from grpo_server.runtime.prompts import PromptBuilder
    from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

RECENT_GROUPS = 32  # the window of "recent reward mean"
MAX_ERRORS_SHOWN = 20


@dataclass(eq=False)
class Experiment:
    config: ExperimentConfig
    # What it works with (the orchestrator's; None in tests that drive only its training side).
    workers: "WorkerPool | None" = None
    server: ServerConfig | None = None  # the server's limits
    prompts: "PromptBuilder | None" = None
    groups: GroupStore | None = None  # sampled groups awaiting feedback (the server's store, by experiment)
    episodes: EpisodeStore | None = None  # episodes awaiting their reward (the server's store, by experiment)
    journal: FeedbackJournal | None = None
    budget: TokenBudget = field(default_factory=lambda: TokenBudget(2**62, 2**62))  # the server's (orchestrator)
    serving_version: int = 0  # the version new completions are sampled from
    learner_version: int = 0  # the newest version the learner has written
    step: int = 0
    adapter_paths: dict[int, str] = field(default_factory=dict)  # versions loaded on the samplers
    inflight: Counter = field(default_factory=Counter)  # requests per version still being sampled
    sampling_requests: float = 0  # groups being sampled (sampling_request); an episode's turn is 1/n of one
    last_sampling_at: float = -math.inf  # time.monotonic() when its latest sampler request was admitted
    staleness: Counter = field(default_factory=Counter)  # trained groups by optimizer steps behind the learner
    version_steps: dict[int, int] = field(default_factory=lambda: {0: 0})  # the learner step of each version
    counters: ExperimentCounters = field(default_factory=ExperimentCounters)
    queue: list[Group] = field(default_factory=list)  # groups with feedback, waiting for a batch
    # Bumped when the queue is rebuilt from the journal (a learner restart): a batch taken before
    # that is in the new queue again and must not be sent as well.
    queue_generation: int = 0
    queue_changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The learner holds gradients a Tinker forward_backward summed for this experiment, which only its optim_step
    # applies: no batch is taken meanwhile (training.py), as a native step would meet them (409).
    gradients_pending: bool = False
    recent_rewards: deque = field(default_factory=lambda: deque(maxlen=RECENT_GROUPS))
    last_metrics: dict[str, Any] | None = None
    last_push_at: float | None = None
    last_push_seconds: float | None = None
    last_verification: VerificationResult | None = None
    last_served_as: str | None = None  # how the sampler ran the latest completions (wire.ServedAs)
    probe: Group | None = None  # a trained group, used to check sampler vs learner after a push
    versions_in_check: set[int] = field(default_factory=set)  # kept loaded until the samplers scored them
    versions_loading: set[int] = field(default_factory=set)  # old versions being loaded for a client's samples
    # Versions a client names and may sample later (a Tinker sampler, saved sampler weights): kept on disk by
    # pruning (runtime/training.py prune_versions) while named, however old. Counted: names come and go apiece.
    named_versions: Counter = field(default_factory=Counter)
    errors: deque = field(default_factory=lambda: deque(maxlen=MAX_ERRORS_SHOWN))
    training_task: asyncio.Task | None = None
    created_at: float = field(default_factory=time.time)  # epoch seconds (OpenAI's model `created`)
    tasks: OwnedTasks = field(init=False)  # background work besides training: unloads, probes

    def __post_init__(self) -> None:
        self.tasks = OwnedTasks(self.name, on_error=self.record_error)

    @property
    def name(self) -> str:
        return self.config.name

    def record_error(self, message: str) -> None:
        self.errors.append(message)

    def recall_rewards(self, group_means: list[float]) -> None:
        """Group mean rewards from before a restart (the metrics log's), oldest first, ahead of any rated since:
        the recent reward a restarted server shows (the window keeps the newest RECENT_GROUPS)."""
        rated_since = list(self.recent_rewards)
        self.recent_rewards.clear()
        self.recent_rewards.extend([*group_means, *rated_since])

    async def complete(self, request: CompletionsRequest, group_id: str | None = None,
                       admitted: asyncio.Event | None = None) -> CompletionsResponse:
        """A group of completions under the serving version, kept for its feedback (or one turn of an episode).
        A stream (api/openai/streaming.py) names the group first (`group_id`) and starts once `admitted` is set.
        Requests admitted count from here to their end (tokenising included): their groups reach the queue
        later, and admitting more while the queue looks short only makes groups that go stale. An episode's
        later turns are work already admitted: held back, its earlier turns would be lost."""
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
                        stop=request.stop, seed=request.seed, adapter=AdapterRef(name=self.name, version=version),
                        tool_calling=tool_calling_of(request),
                    ))
        self.last_served_as = result.served_as
        self.counters.completions_sampled += len(result.completions)
        self.counters.tokens_sampled += sum(len(c.token_ids) for c in result.completions)
        return result, version

    async def feedback(self, request: FeedbackRequest) -> FeedbackResponse:
        """Rewards for a sampled group, possibly with external completions added to it, or for a group of
        external completions only; or with `episode_ids`, rewards for episodes. Everything is checked before
        the group (or an episode) is taken, so a 4xx loses nothing; a failed journal write puts it back (503)."""
        name = self.name
        if request.episode_ids is not None:
            return await self._rate_episodes(request)
        if request.group_id is None:
            group = Group(group_id=self.groups.new_id(), experiment=name, completions=[],
                          prompt_token_ids=await self.prompts.off_loop(self.prompts.token_ids, request),
                          policy_version=self.serving_version,
                          temperature=self.config.sampling.temperature, max_tokens=self.config.sampling.max_tokens)
            external = request.completions
        else:
            group = self.groups.peek(name, request.group_id)
            external = request.extra_completions or []
            if len(request.rewards) != len(group.completions) + len(external):
                raise Unprocessable(
                    f"group {group.group_id} has {len(group.completions)} completions"
                    + (f" + {len(external)} extra" if external else "")
                    + f" but {len(request.rewards)} rewards were sent", code="reward_count_mismatch")
        if group.temperature == 0:
            raise Unprocessable("a group sampled at temperature 0 (greedy) has no policy gradient to train on: "
                                "sample with temperature > 0 to give feedback", code="greedy_group")
        skipped, advantages = rate(request.rewards, self.config.algorithm)
        external_ids = []
        if external:  # a bad one is a 400 here, before anything is taken
            external_ids = await self.prompts.off_loop(external_token_ids, self.prompts, group, external)
        # What this feedback adds to the tokens held: a new group's prompt, and the external completions.
        new_prompt = len(group.prompt_token_ids) if request.group_id is None else 0
        self.budget.check(name, new_prompt + sum(len(ids) for ids in external_ids))
        scored_version = None
        external_logprobs = None
        if external_ids and skipped is None:
            scored_version, added = await score_external(self, group, external_ids)
            external_logprobs = [c.logprobs for c in added]
        # Nothing below can fail for the request's sake: the group is only taken now (put back if not journalled).
        if request.group_id is not None:
            self.groups.take(name, request.group_id)  # 404/409 if it expired or was rated meanwhile
        rated = replace(group, completions=group.completions + added) if external and skipped is None else group

        def put_back() -> None:  # the group as it was (`rated` is a copy); a group made here was in no store
            if request.group_id is not None:
                self.groups.put_back(group)

        await asyncio.shield(self._accept(rated, request.rewards, advantages, skipped, put_back=put_back))
        self.counters.completions_external += len(rated.completions) - len(group.completions)
        return FeedbackResponse(group_id=group.group_id, scored_version=scored_version,
                                external_logprobs=external_logprobs, skipped=skipped)

    async def _rate_episodes(self, request: FeedbackRequest) -> FeedbackResponse:
        """A group of episodes: each episode's reward, relative to the others', trains every token the model
        sampled in it (runtime/episodes.py)."""
        episodes = self.episodes.peek(self.name, request.episode_ids)  # 404/409 before anything is taken
        check_rateable(episodes)
        skipped, advantages = rate(request.rewards, self.config.algorithm)
        group = trajectory_group(self.groups.new_id(), self.name, episodes)
        self.episodes.take(self.name, request.episode_ids)
        await asyncio.shield(self._accept(group, request.rewards, advantages, skipped,
                                          put_back=lambda: self.episodes.put_back(self.name, episodes)))
        self.counters.episodes_rated += len(episodes)
        return FeedbackResponse(group_id=group.group_id, skipped=skipped)

    async def _accept(self, group: Group, rewards: list[float], advantages: list[float], skipped: str | None,
                      put_back: Callable[[], Any] = lambda: None) -> None:
        """A rated group, taken from its store: (unless skipped) journalled, durable before the 202, queued, counted.
        A failed journal write (503 journal_write_failed) calls `put_back` instead, so the retry succeeds. Callers
        shield it: a request cancelled meanwhile cannot leave the group taken but neither queued nor put back."""
        if not skipped:
            group.rewards = list(rewards)
            group.advantages = advantages
            group.sampled_step = self.version_steps.get(group.policy_version, 0)  # max_staleness counts from it
            try:  # on a thread; queued as soon as it is durable, before any later append: in journal order
                await self.journal.append_async(group, then=lambda: self.queue.append(group))
            except Exception:  # not cancelled: the write goes on, and queues the group if it succeeds
                put_back()
                raise
            self.queue_changed.set()
        self.counters.groups_received += 1
        self.counters.groups_zero_variance += skipped is not None
        self.recent_rewards.append(sum(rewards) / len(rewards))

    # --- versions on the samplers ---------------------------------------------------------------------

    def serve(self, version: int, path: str) -> None:
        """`version`, loaded on every sampler, is served from now on; versions nobody uses are unloaded."""
        self.adapter_paths[version] = path
        self.serving_version = version
        self.retire_unused_versions()

    def learned(self, version: int, step: int) -> None:
        """The learner wrote `version`: its weights after `step` optimizer steps."""
        self.learner_version = version
        self.version_steps[version] = step

    def pushed(self, seconds: float, at: float) -> None:
        """A push took `seconds` and ended `at` (epoch seconds)."""
        self.last_push_seconds = seconds
        self.last_push_at = at

    def keep_for_check(self, version: int) -> None:
        """Keep `version` loaded on the samplers until `checked` (a probe may score it)."""
        self.versions_in_check.add(version)

    def checked(self, version: int) -> None:
        self.versions_in_check.discard(version)
        self.retire_unused_versions()

    def retire_unused_versions(self) -> None:
        """Unload versions that are neither served, nor used by an in-flight request, nor being checked."""
        for version in [v for v in self.adapter_paths
                        if v != self.serving_version and self.inflight[v] == 0 and v not in self.versions_in_check]:
            del self.adapter_paths[version]
            self.inflight.pop(version, None)
            if self.workers is not None:
                self.spawn(self.workers.unload_everywhere(AdapterRef(name=self.name, version=version)),
                           f"unload-{self.name}-v{version}", finish_on_stop=True)

    @contextlib.contextmanager
    def sampling_request(self, share: float = 1.0) -> Iterator[None]:
        """Counts a sampler request (`share` of a group) from its admission (it may await a turn) to its end."""
        self.sampling_requests += share
        self.last_sampling_at = time.monotonic()
        try:
            yield
        finally:
            self.sampling_requests -= share

    @contextlib.contextmanager
    def pinned_serving_version(self, version: int | None = None) -> Iterator[int]:
        """The serving version (or `version`, loaded), kept loaded on the samplers until the block ends even if a
        push replaces it."""
        version = self.serving_version if version is None else version
        self.inflight[version] += 1
        try:
            yield version
        finally:
            self.inflight[version] -= 1
            if version != self.serving_version:
                self.retire_unused_versions()

    @contextlib.asynccontextmanager
    async def version_loaded(self, version: int, path: str) -> AsyncIterator[None]:
        """`version` (its folder `path`) loaded on every sampler, and kept loaded while the block runs: a Tinker
        sampler names saved weights the samplers may have let go since (only the serving version, versions in use
        and versions being checked stay loaded). At most max_loaded_versions of this experiment are loaded at
        once, as for its pushes: the samplers' adapter table is shared by every experiment, and one key sampling
        many old versions would fill it (429 while it would go over)."""
        with self.pinned_serving_version(version):  # pinned first: nothing retires it between load and use
            if version not in self.adapter_paths:
                limit = self.server.max_loaded_versions if self.server is not None else math.inf
                if len(self.adapter_paths) + len(self.versions_loading - {version}) >= limit:
                    raise TooManyRequests(f"{len(self.adapter_paths)} versions of {self.name!r} are loaded on the "
                                          f"samplers (max_loaded_versions {limit}); retry once fewer are in use",
                                          code="too_many_loaded_versions", retry_after=2.0)
                self.versions_loading.add(version)
                try:
                    await self.workers.load_everywhere(AdapterRef(name=self.name, version=version), path)
                finally:
                    self.versions_loading.discard(version)
                self.adapter_paths[version] = path
            yield

    def name_version(self, version: int) -> None:
        """A client names `version` (see `named_versions`): pruning keeps it until `unname_version`."""
        self.named_versions[version] += 1

    def unname_version(self, version: int) -> None:
        self.named_versions[version] -= 1
        if self.named_versions[version] <= 0:
            del self.named_versions[version]

    def gradients_summed(self) -> None:
        """A Tinker forward_backward left gradients on the learner for its optim_step: batches wait for it."""
        self.gradients_pending = True

    def optimizer_stepped(self, step: int) -> None:
        """A Tinker optim_step moved the weights to optimizer step `step` (native steps count in `trained`), and
        applied the gradients pending: the queue's batches may go on."""
        self.step = step
        self.gradients_pending = False
        self.queue_changed.set()

    async def sample_for_client(self, request: GenerateRequest, version: tuple[int, str] | None,
                                score_prompt: bool = False) -> tuple[GenerateResponse, list[float] | None]:
        """Samples a client keeps itself (the Tinker API's asample), under `version` (its number and folder, loaded
        and pinned while they run; None: the base model), with the prompt's own logprobs when `score_prompt`. Not
        a group for training, so no admission by the learner's backlog; but the same walls as `complete`
        otherwise: the token budget holds the worst case while it runs (429 before any work), it is sampled in
        this experiment's sampling turn, and the counters count it."""
        loaded = self.version_loaded(*version) if version is not None else None
        adapter = AdapterRef(name=self.name, version=version[0]) if version is not None else None
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

    # --- training: the training task's side of the queue ---------------------------------------------

    def resume_from(self, state: AdapterVersion) -> None:
        """Take the learner's durable position: every journalled group after it is queued (again)."""
        self.step = state.step
        self.learner_version = state.version
        self.version_steps[state.version] = state.step
        self.counters.groups_trained = state.groups_trained
        self.queue[:] = self.journal.pending(after_seq=state.journal_seq)
        self.queue_generation += 1
        self.gradients_pending = False  # a learner that restarted holds none
        self.queue_changed.set()

    def batch_ready(self, size: int) -> bool:
        """A batch of `size` fresh groups can be taken, and no Tinker gradients wait for their optim_step. One rule
        for both kinds of step: neither fails the other, and each waits its turn in this queue."""
        return self.drop_stale() >= size and not self.gradients_pending

    async def queue_grew(self, timeout_s: float) -> bool:
        """Wait until a group is queued, the queue is rebuilt or pending gradients are applied; False after
        `timeout_s` without any of these."""
        self.queue_changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.queue_changed.wait(), timeout_s)
        return self.queue_changed.is_set()

    def drop_stale(self) -> int:
        """Drop queued groups sampled more than max_staleness optimizer steps (not versions) ago; return the rest."""
        limit = self.config.algorithm.max_staleness
        fresh = [g for g in self.queue if self.step - g.sampled_step <= limit]
        self.counters.groups_dropped_stale += len(self.queue) - len(fresh)
        self.queue[:] = fresh
        return len(fresh)

    def take_batch(self, size: int) -> tuple[list[Group], int]:
        """The oldest `size` queued groups, and the queue's generation they were taken from."""
        batch = self.queue[:size]
        del self.queue[:size]
        return batch, self.queue_generation

    def put_back(self, batch: list[Group], generation: int) -> bool:
        """A batch whose step failed, at the head of the queue again (True), so that no later step records a
        journal position past it: its groups were acknowledged (202) and must be trained. Not if the queue was
        rebuilt from the journal since (a learner restart): it holds them already."""
        if generation != self.queue_generation:
            return False
        self.queue[:0] = batch
        return True

    def trained(self, groups: list[Group], metrics: TrainMetrics | None, truncated: int = 0) -> None:
        self.counters.completions_masked_truncated += truncated  # left out by mask_truncated; metrics None: no step
        if metrics is None:
            return
        self.staleness.update(self.step - g.sampled_step for g in groups)  # behind the weights this step started from
        self.step = metrics.step
        self.counters.groups_trained += len(groups)
        if metrics.checkpointed_journal_seq is not None:  # on a thread, after the appends asked before it
            self.spawn(self.journal.compact_async(metrics.checkpointed_journal_seq), "compact", finish_on_stop=True)
        self.last_metrics = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                             for k, v in metrics.model_dump().items()}  # JSON has no inf/NaN: shown as null
        self.probe = groups[-1]

    def verified(self, result: VerificationResult) -> None:
        if self.last_verification is None or self.last_verification.version <= result.version:
            self.last_verification = result

    # --- tasks ----------------------------------------------------------------------------------------

    def start_training(self, run: Coroutine[Any, Any, None]) -> None:
        self.training_task = asyncio.create_task(run, name=f"train-{self.name}")
        self.training_task.add_done_callback(self._training_ended)

    def _training_ended(self, task: asyncio.Task) -> None:
        """The training task ends only by cancellation (deleted, stopping): anything else is a bug to show."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        log.error("%s: training stopped by an internal error", self.name, exc_info=exc)
        self.record_error(f"training stopped by an internal error ({type(exc).__name__}: {exc}); feedback is still "
                          "journalled, and a server restart resumes training from it")

    def spawn(self, work: Coroutine[Any, Any, Any], name: str, finish_on_stop: bool = False) -> asyncio.Task:
        """Background work this experiment owns (runtime/tasks.py)."""
        return self.tasks.spawn(work, name, finish_on_stop)

    async def stop(self) -> None:
        """Cancel and await the training task and every background task; close the journal."""
        if self.training_task is not None:
            self.training_task.cancel()
            await asyncio.gather(self.training_task, return_exceptions=True)
        await self.tasks.stop()
        if self.journal is not None:
            await self.journal.aclose()


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
