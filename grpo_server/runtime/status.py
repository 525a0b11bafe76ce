"""An experiment's status, as `GET /v1/experiments/{name}` shows it (read from its owner, never written)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from grpo_server.api_models import ExperimentCounters, ExperimentStatus, TrackerStatus
from grpo_server.config import ExperimentConfig
from grpo_server.protocol.errors import public_message
from grpo_server.runtime.experiment import Experiment

if TYPE_CHECKING:
    from grpo_server.trackers import TrackerSet


SAMPLING_WINDOW_S = 30.0  # an experiment whose latest sampler request is this recent counts as sampling


def experiment_status(exp: Experiment, pending_groups: int, pending_episodes: int,
                      experiments_sampling: int = 1, learner_resident: bool | None = None) -> ExperimentStatus:
    verification_failed = exp.last_verification is not None and exp.last_verification.ok is False  # None: inconclusive
    training_stopped = exp.training_task is not None and exp.training_task.done() and not exp.training_task.cancelled()
    return ExperimentStatus(
        name=exp.name,
        state="error" if verification_failed or training_stopped else "active",
        policy_version=exp.serving_version,
        learner_version=exp.learner_version,
        step=exp.step,
        counters=exp.counters,
        queued_groups=len(exp.queue),
        pending_groups=pending_groups,
        pending_episodes=pending_episodes,
        recent_reward_mean=statistics.fmean(exp.recent_rewards) if exp.recent_rewards else None,
        kl=exp.last_metrics.get("kl") if exp.last_metrics else None,
        last_metrics=exp.last_metrics,
        last_push_at=exp.last_push_at,
        last_push_seconds=exp.last_push_seconds,
        last_verification=exp.last_verification,
        served_as=exp.last_served_as,
        learner_memory=None if learner_resident is None else "resident" if learner_resident else "paged_out",
        suggested_groups_in_flight=suggested_groups_in_flight(exp, experiments_sampling),
        # Descriptive (an exception's type and text may be there: runtime/tasks.py), but an experiment key is a
        # tenant's: no server path, worker URL or traceback (the log has the full text).
        errors=[public_message(error) for error in exp.errors],
        config=exp.config.public_dict(),
        trackers=tracker_status(exp.trackers),
        paused=exp.paused,
    )


def unrestored_status(config: ExperimentConfig, reason: str) -> ExperimentStatus:
    """An experiment the server could not restore at start (runtime/orchestrator.py `Unrestored`): state
    "failed", the reason in `errors`, nothing else known until it is restored."""
    return ExperimentStatus(
        name=config.name, state="failed", policy_version=0, learner_version=0, step=0, counters=ExperimentCounters(),
        queued_groups=0, pending_groups=0, recent_reward_mean=None, kl=None, last_metrics=None, last_push_at=None,
        last_push_seconds=None, last_verification=None,
        errors=[f"could not be restored when the server started: {public_message(reason)}; an admin restores it "
                f"(POST /v1/experiments/{config.name}/restore) or deletes it"],
        config=config.public_dict())


def is_sampling(exp: Experiment, now: float) -> bool:
    """`now`: time.monotonic(), read once for every experiment a status compares."""
    return exp.sampling_requests > 0 or now - exp.last_sampling_at < SAMPLING_WINDOW_S


def suggested_groups_in_flight(exp: Experiment, experiments_sampling: int) -> int:
    """One batch in flight while `exp` samples alone; with others sampling, one batch per experiment, up to the
    max_queued_batches the front end admits (Experiment.complete's 429 gate).

    Measured (docs/benchmarks/findings.md "The race to 0.6"): alone, alphabetize (batch_groups 2) reached 0.6 1.62x
    sooner with 2 groups in flight than with 4: its groups were sampled fewer steps behind the learner, so it needed
    fewer (27 against 36 in median), and the sampler left the learner more of the CPU. In the two-task demo,
    2 each made versions and groups more slowly than 4 each (probably: the learner trains the experiments in
    turn, and with one batch in flight an experiment often has no batch ready when its turn comes)."""
    batches = min(max(experiments_sampling, 1), exp.server.max_queued_batches if exp.server else 1)
    return exp.config.algorithm.batch_groups * batches


def tracker_status(trackers: "TrackerSet | None") -> dict[str, TrackerStatus]:
    if trackers is None:
        return {}
    pending = trackers.pending()
    # A backend's error text may hold a path or a URL (a store's address): filtered as the errors are.
    return {name: TrackerStatus(written=c.written, dropped=c.dropped, errors=c.errors, pending=pending[name],
                                last_error=None if c.last_error is None else public_message(c.last_error))
            for name, c in trackers.counts().items()}
