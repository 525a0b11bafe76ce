"""The live state of one experiment in the front end, and its status as clients see it."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_server.api_models import ExperimentCounters, ExperimentStatus, VerificationResult
from grpo_server.config import ExperimentConfig
from grpo_server.runtime.groups import Group
from grpo_server.runtime.journal import FeedbackJournal
from grpo_server.protocol.wire import AdapterRef

if TYPE_CHECKING:
    from grpo_server.workers.pool import WorkerPool

RECENT_GROUPS = 32  # the window of "recent reward mean"
MAX_ERRORS_SHOWN = 20


@dataclass
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


def retire_unused_versions(exp: Experiment, workers: "WorkerPool") -> None:
    """Unload versions that are neither served, nor used by an in-flight request, nor being checked."""
    for version in [v for v in exp.adapter_paths
                    if v != exp.serving_version and exp.inflight[v] == 0 and v not in exp.versions_in_check]:
        del exp.adapter_paths[version]
        exp.inflight.pop(version, None)
        asyncio.create_task(workers.unload_everywhere(AdapterRef(name=exp.name, version=version)))
