"""One experiment's owner in the front end: the only code that changes its serving version, its loaded
adapter versions, its groups (pending and queued for training), its counters and its background tasks, and the
only caller of the workers on its behalf.

`Experiment` is this file's facade over the verbs, a module each, split by meaning:
- sampling.py: `complete` (a group for feedback, or an episode's turn), `sample_for_client` (Tinker's asample);
- feedback.py: `feedback`, and the training task's side of the queue (batches taken, put back, trained);
- versions.py: which versions serve and stay loaded on the samplers;
- learner_calls.py: a client's learner calls (Tinker's forward_backward, optim_step, saved states, pushes).
It holds what is its own: its metrics log and trackers (opened by `open`), and its training loop
(runtime/training.py, with its version checks; built on this package, so the orchestrator builds it with the
server's settings and hands it to `start_training`). `stop` cancels and awaits every task it started and closes
them. Everything else (status, /metrics, the orchestrator's re-syncs, the API families) reads it and calls
its methods, never writes its fields."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Coroutine, Protocol

from grpo_server.api_models import ExperimentCounters, RatedGroup, VerificationResult
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol.wire import AdapterRef, VersionProbe
from grpo_server.runtime.episodes import EpisodeStore
from grpo_server.runtime.experiment.feedback import FeedbackVerbs
from grpo_server.runtime.experiment.learner_calls import LearnerVerbs
from grpo_server.runtime.experiment.sampling import SamplingVerbs
from grpo_server.runtime.experiment.versions import VersionVerbs
from grpo_server.runtime.groups import Group, GroupStore
from grpo_server.runtime.journal import FeedbackJournal
from grpo_server.runtime.metrics_log import MetricsLog, metrics_log_path
from grpo_server.runtime.rated import RatedLog
from grpo_server.runtime.tasks import OwnedTasks
from grpo_server.runtime.token_budget import TokenBudget

if TYPE_CHECKING:
    from grpo_server.runtime.prompts import PromptBuilder
    from grpo_server.trackers import TrackerSet
    from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

RECENT_GROUPS = 32  # the window of "recent reward mean"
MAX_ERRORS_SHOWN = 20


class Training(Protocol):
    """What the experiment needs of its training loop: runtime/training.py's TrainingLoop, which is built on this
    package (so it is handed in, not imported: `start_training`)."""

    def run(self) -> Coroutine[Any, Any, None]: ...

    async def push_now(self, probe: VersionProbe | None = None) -> int: ...


@dataclass(eq=False)
class Experiment(SamplingVerbs, FeedbackVerbs, VersionVerbs, LearnerVerbs):
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
    # Groups taken out of the queue untrained since the last step the learner took (id -> why: stale, failed,
    # nothing_to_train): sent with the next batch, for the learner's ledger (learner/ledger.py).
    passed_over: dict[str, str] = field(default_factory=dict)
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
    # An admin's pause (the orchestrator's `set_paused`, which also keeps it across restarts): no new group or
    # episode turn is sampled (sampling.py) and no batch is taken (feedback.py `batch_ready`).
    paused: bool = False
    rated: RatedLog = field(default_factory=RatedLog)  # its newest rated groups, for GET .../rated
    training_task: asyncio.Task | None = None
    # What it builds and holds (`open`): its training loop (with its version checks), metrics log and trackers.
    training: Training | None = None
    metrics_log: MetricsLog | None = None
    trackers: "TrackerSet | None" = None
    # This life of the name: in its adapters' names on the samplers (`adapter`), so that nothing one life loaded
    # or cached (vLLM keys its prefix cache by LoRA name) is ever taken for another's after a delete.
    life: str = field(default_factory=lambda: secrets.token_hex(4))
    created_at: float = field(default_factory=time.time)  # epoch seconds (OpenAI's model `created`)
    tasks: OwnedTasks = field(init=False)  # background work besides training: unloads, probes

    def __post_init__(self) -> None:
        self.tasks = OwnedTasks(self.name, on_error=self.record_error)

    @property
    def name(self) -> str:
        return self.config.name

    def adapter(self, version: int) -> AdapterRef:
        """`version` of this life's adapter, as the samplers know it."""
        return AdapterRef(name=self.name, version=version, life=self.life)

    def record_error(self, message: str) -> None:
        self.errors.append(message)

    def recall_rewards(self, group_means: list[float]) -> None:
        """Group mean rewards from before a restart (the metrics log's), oldest first, ahead of any rated since:
        the recent reward a restarted server shows (the window keeps the newest RECENT_GROUPS)."""
        rated_since = list(self.recent_rewards)
        self.recent_rewards.clear()
        self.recent_rewards.extend([*group_means, *rated_since])

    # --- what it holds --------------------------------------------------------------------------------

    def open(self, trackers: list[str]) -> None:
        """Open its metrics log and trackers, from the learner's step it resumed at (then `start_training`)."""
        from grpo_server.trackers import open_trackers

        server = self.server
        self.trackers = open_trackers(trackers, self.name, self.config.public_dict(), server.trackers,
                                      server.run_dir, step=self.step)
        self.metrics_log = MetricsLog(metrics_log_path(server.run_dir, self.name), feed=self.trackers.feed)
        self.recall_rewards(self.metrics_log.recent_group_rewards(RECENT_GROUPS))  # it survives a restart

    def set_paused(self, paused: bool) -> None:
        """Pause or unpause it; an unpaused training loop looks at its queue again at once."""
        self.paused = paused
        if not paused:
            self.queue_changed.set()

    async def rated_groups(self, limit: int) -> list[RatedGroup]:
        """Its newest `limit` rated groups, oldest first, their token tails decoded off the event loop."""
        entries = self.rated.newest(limit)
        return await self.prompts.off_loop(lambda: [entry.shown(self.prompts.decode) for entry in entries])

    def metric_records(self, kind: str | None, limit: int) -> list[dict[str, Any]]:
        """Its metrics log's newest records (of `kind`, or all)."""
        return self.metrics_log.records(kind, limit) if self.metrics_log is not None else []

    def log_sampling(self) -> None:
        """A `sampling` line in its metrics log: its counters now."""
        if self.metrics_log is not None:
            self.metrics_log.sampling(self.counters)

    # --- tasks ----------------------------------------------------------------------------------------

    def start_training(self, training: Training) -> None:
        """Hold `training` (its loop, over this experiment and its metrics log) and run it as its training task."""
        self.training = training
        self.training_task = asyncio.create_task(training.run(), name=f"train-{self.name}")
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
        """Cancel and await the training task and every background task; close the journal, the metrics log (its
        file stays) and the trackers (their runs stay in their stores)."""
        if self.training_task is not None:
            self.training_task.cancel()
            await asyncio.gather(self.training_task, return_exceptions=True)
        await self.tasks.stop()
        if self.journal is not None:
            await self.journal.aclose()
        if self.metrics_log is not None:
            self.metrics_log.close()
        if self.trackers is not None:
            await asyncio.to_thread(self.trackers.close, self.server.trackers.close_timeout_s)
