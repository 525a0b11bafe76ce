"""One experiment's owner in the front end: the only code that changes its serving version, its loaded
adapter versions, its queue of rated groups, its counters and its background tasks.

The orchestrator creates it, the request handlers call its methods, its training task
(`runtime/training.py`) and version checks (`runtime/verification.py`) report to it, and `stop` cancels and
awaits every task it started. Everything else reads it (status, /metrics) and never writes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Coroutine, Iterator

from grpo_server.api_models import ExperimentCounters, ExperimentStatus, VerificationResult
from grpo_server.config import ExperimentConfig
from grpo_server.runtime.groups import Group
from grpo_server.runtime.journal import FeedbackJournal
from grpo_server.protocol.wire import AdapterRef, AdapterVersion, TrainMetrics

if TYPE_CHECKING:
    from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

RECENT_GROUPS = 32  # the window of "recent reward mean"
MAX_ERRORS_SHOWN = 20


@dataclass(eq=False)
class Experiment:
    config: ExperimentConfig
    serving_version: int = 0  # the version new completions are sampled from
    learner_version: int = 0  # the newest version the learner has written
    step: int = 0
    adapter_paths: dict[int, str] = field(default_factory=dict)  # versions loaded on the samplers
    inflight: Counter = field(default_factory=Counter)  # requests per version still being sampled
    sampling_requests: int = 0  # sampler requests admitted and not answered yet (some may await their turn)
    staleness: Counter = field(default_factory=Counter)  # trained groups by (learner version - sampled version)
    counters: ExperimentCounters = field(default_factory=ExperimentCounters)
    queue: list[Group] = field(default_factory=list)  # groups with feedback, waiting for a batch
    # Bumped when the queue is rebuilt from the journal (a learner restart): a batch taken before
    # that is in the new queue again and must not be sent as well.
    queue_generation: int = 0
    journal: FeedbackJournal | None = None
    queue_changed: asyncio.Event = field(default_factory=asyncio.Event)
    recent_rewards: deque = field(default_factory=lambda: deque(maxlen=RECENT_GROUPS))
    last_metrics: dict[str, Any] | None = None
    last_push_at: float | None = None
    last_push_seconds: float | None = None
    last_verification: VerificationResult | None = None
    last_served_as: str | None = None  # how the sampler ran the latest completions (wire.ServedAs)
    probe: Group | None = None  # a trained group, used to check sampler vs learner after a push
    versions_in_check: set[int] = field(default_factory=set)  # kept loaded until the samplers scored them
    errors: deque = field(default_factory=lambda: deque(maxlen=MAX_ERRORS_SHOWN))
    training_task: asyncio.Task | None = None
    workers: "WorkerPool | None" = None  # unloads retired versions
    tasks: set[asyncio.Task] = field(default_factory=set)  # background work besides training (unloads, probes)

    @property
    def name(self) -> str:
        return self.config.name

    def record_error(self, message: str) -> None:
        self.errors.append(message)

    def status(self, pending_groups: int) -> ExperimentStatus:
        verification_failed = self.last_verification is not None and not self.last_verification.ok
        training_stopped = (self.training_task is not None and self.training_task.done()
                            and not self.training_task.cancelled())
        return ExperimentStatus(
            name=self.name,
            state="error" if verification_failed or training_stopped else "active",
            policy_version=self.serving_version,
            learner_version=self.learner_version,
            step=self.step,
            counters=self.counters,
            queued_groups=len(self.queue),
            pending_groups=pending_groups,
            recent_reward_mean=statistics.fmean(self.recent_rewards) if self.recent_rewards else None,
            kl=self.last_metrics.get("kl") if self.last_metrics else None,
            last_metrics=self.last_metrics,
            last_push_at=self.last_push_at,
            last_push_seconds=self.last_push_seconds,
            last_verification=self.last_verification,
            served_as=self.last_served_as,
            errors=list(self.errors),
            config=self.config.public_dict(),
        )

    # --- versions on the samplers ---------------------------------------------------------------------

    def serve(self, version: int, path: str) -> None:
        """`version`, loaded on every sampler, is served from now on; versions nobody uses are unloaded."""
        self.adapter_paths[version] = path
        self.serving_version = version
        self.retire_unused_versions()

    def learned(self, version: int) -> None:
        """The learner wrote `version` (it is served once every sampler loaded it)."""
        self.learner_version = version

    def pushed(self, seconds: float, at: float) -> None:
        self.last_push_seconds, self.last_push_at = seconds, at

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
    def sampling_request(self) -> Iterator[None]:
        """Counts a sampler request from its admission (it may wait for a sampling turn) to its end."""
        self.sampling_requests += 1
        try:
            yield
        finally:
            self.sampling_requests -= 1

    @contextlib.contextmanager
    def pinned_serving_version(self) -> Iterator[int]:
        """The serving version, kept loaded on the samplers until the block ends even if a push replaces it."""
        version = self.serving_version
        self.inflight[version] += 1
        try:
            yield version
        finally:
            self.inflight[version] -= 1
            if version != self.serving_version:
                self.retire_unused_versions()

    # --- groups and counters --------------------------------------------------------------------------

    def sampled(self, completions: int, tokens: int, served_as: str) -> None:
        self.last_served_as = served_as
        self.counters.groups_sampled += 1
        self.counters.completions_sampled += completions
        self.counters.tokens_sampled += tokens

    def rated(self, rewards: list[float], zero_variance: bool) -> None:
        self.counters.groups_received += 1
        self.recent_rewards.append(sum(rewards) / len(rewards))
        if zero_variance:
            self.counters.groups_zero_variance += 1

    def enqueue(self, group: Group, external_completions: int = 0) -> None:
        """A rated group for training: journalled (durable before the client's 202), then queued."""
        self.counters.completions_external += external_completions
        self.journal.append(group)
        self.queue.append(group)
        self.queue_changed.set()

    def expired(self, count: int) -> None:
        self.counters.groups_expired += count

    def resume_from(self, state: AdapterVersion) -> None:
        """Take the learner's durable position: every journalled group after it is queued (again)."""
        self.step = state.step
        self.learner_version = state.version
        self.counters.groups_trained = state.groups_trained
        self.queue[:] = self.journal.pending(after_seq=state.journal_seq)
        self.queue_generation += 1
        self.queue_changed.set()

    async def queue_grew(self, timeout_s: float) -> bool:
        """Wait until a group is queued (or the queue is rebuilt); False after `timeout_s` without one."""
        self.queue_changed.clear()
        try:
            await asyncio.wait_for(self.queue_changed.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def drop_stale(self) -> int:
        """Drop queued groups sampled more than max_staleness versions ago; return how many remain."""
        limit = self.config.algorithm.max_staleness
        fresh = [g for g in self.queue if self.learner_version - g.policy_version <= limit]
        self.counters.groups_dropped_stale += len(self.queue) - len(fresh)
        self.queue[:] = fresh
        return len(fresh)

    def take_batch(self, size: int) -> tuple[list[Group], int]:
        """The oldest `size` queued groups, and the queue's generation they were taken from."""
        batch, self.queue[:size] = self.queue[:size], []
        return batch, self.queue_generation

    def trained(self, groups: list[Group], metrics: TrainMetrics) -> None:
        self.step = metrics.step
        self.counters.groups_trained += len(groups)
        self.staleness.update(self.learner_version - g.policy_version for g in groups)
        if metrics.checkpointed_journal_seq is not None:
            self.journal.compact(through_seq=metrics.checkpointed_journal_seq)
        # JSON has no inf/NaN: a non-finite metric (say, an empty ratio range) is shown as null.
        self.last_metrics = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                             for k, v in metrics.model_dump().items()}
        self.probe = groups[-1]

    def verified(self, result: VerificationResult) -> None:
        if self.last_verification is None or self.last_verification.version <= result.version:
            self.last_verification = result

    # --- tasks ----------------------------------------------------------------------------------------

    def start_training(self, run: Coroutine[Any, Any, None]) -> None:
        self.training_task = asyncio.create_task(run, name=f"train-{self.name}")
        self.training_task.add_done_callback(self._training_ended)

    def spawn(self, work: Coroutine[Any, Any, Any], name: str, finish_on_stop: bool = False) -> asyncio.Task:
        """Background work this experiment owns: kept until done, its error reported; `stop` cancels it, or
        with `finish_on_stop` (a short unload that must not be cut off) awaits it."""
        task = asyncio.create_task(work, name=name)
        task.finish_on_stop = finish_on_stop  # type: ignore[attr-defined]
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("%s: %s failed", self.name, task.get_name(), exc_info=exc)
            self.record_error(f"{task.get_name()} failed: {type(exc).__name__}: {exc}")

    def _training_ended(self, task: asyncio.Task) -> None:
        """The training task only ends by cancellation (deleted, server stopping), so anything else is a bug
        that must show in the log and the status, not vanish."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("%s: training stopped by an internal error", self.name, exc_info=exc)
        self.record_error(f"training stopped by an internal error ({type(exc).__name__}: {exc}); feedback is still "
                          "journalled, and a server restart resumes training from it")

    async def stop(self) -> None:
        """Cancel and await the training task and every background task; close the journal."""
        tasks = [t for t in [self.training_task, *self.tasks] if t is not None]
        for task in tasks:
            if not getattr(task, "finish_on_stop", False):
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.journal is not None:
            self.journal.close()
