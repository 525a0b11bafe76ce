"""The learning side of one experiment: batches of rated groups to the learner, versioned pushes to the
samplers, and the check after each push that the samplers serve what the learner trained.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from grpo_server.api_models import VerificationResult
from grpo_server.errors import ApiError
from grpo_server.experiments import Experiment
from grpo_server.groups import Group
from grpo_server.metrics_log import MetricsLog
from grpo_server.wire import (AdapterRef, AdapterVersion, LogprobsRequest, LogprobsResponse, SaveAdapterRequest, ScoreRequest,
                              ScoreResponse, TrainMetrics, TrainRequest, TrainSample)
from grpo_server.workers import WorkerPool

log = logging.getLogger(__name__)

PROBE_COMPLETIONS = 2  # completions of the probe group scored after each push


def train_samples(groups: list[Group]) -> list[TrainSample]:
    return [
        TrainSample(
            prompt_token_ids=group.prompt_token_ids,
            completion_token_ids=completion.token_ids,
            sampler_logprobs=completion.logprobs,
            advantage=advantage,
            reward=reward,
            policy_version=group.policy_version,
            temperature=group.temperature,
        )
        for group in groups
        for completion, advantage, reward in zip(group.completions, group.advantages, group.rewards)
        if completion.token_ids  # an empty completion carries no gradient
    ]


class ExperimentTrainer:
    """Runs as one task per experiment; the front end's other requests never wait on it."""

    def __init__(self, experiment: Experiment, workers: WorkerPool, verify_tolerance: float,
                 train_timeout_s: float, max_loaded_versions: int, metrics_log: MetricsLog):
        self.exp = experiment
        self.metrics_log = metrics_log
        self.workers = workers
        self.verify_tolerance = verify_tolerance
        self.train_timeout_s = train_timeout_s
        self.max_loaded_versions = max_loaded_versions

    async def run(self) -> None:
        exp = self.exp
        batch_groups = exp.config.algorithm.batch_groups
        while True:
            # Stale groups leave the queue before a batch is formed, so every batch is full of fresh ones.
            while self._drop_stale() < batch_groups:
                exp.queue_changed.clear()
                await exp.queue_changed.wait()
            batch, exp.queue[:batch_groups] = exp.queue[:batch_groups], []
            await self.train(batch, exp.queue_generation)

    def _drop_stale(self) -> int:
        """Drop queued groups sampled more than max_staleness versions ago; return how many remain."""
        exp, limit = self.exp, self.exp.config.algorithm.max_staleness
        fresh = [g for g in exp.queue if exp.learner_version - g.policy_version <= limit]
        exp.counters.groups_dropped_stale += len(exp.queue) - len(fresh)
        exp.queue[:] = fresh
        return len(fresh)

    async def train(self, groups: list[Group], generation: int) -> None:
        exp = self.exp
        samples = train_samples(groups)
        if not samples:
            return
        # Groups queued in journal order, stale ones dropped first: every entry up to the batch's newest
        # is in this batch or was dropped, so the learner can record that one number.
        request = TrainRequest(
            name=exp.name, samples=samples, max_tokens=max(g.max_tokens for g in groups), num_groups=len(groups),
            journal_seq=max(g.journal_seq for g in groups),
        )
        try:
            await self.workers.wait_learner_ready(self.train_timeout_s)
            if exp.queue_generation != generation:
                return  # the learner restarted meanwhile and these groups were queued again from the journal
            metrics: TrainMetrics = await self.workers.learner.call(
                "train", request, TrainMetrics, timeout_s=self.train_timeout_s)
        except ApiError as exc:
            # Not trained, visibly (status and log carry the error). If the learner crashed, its restart
            # queues these groups again from the journal.
            exp.record_error(f"train step failed, {len(groups)} groups not trained: {exc.message}")
            log.error("%s: train step failed: %s", exp.name, exc.message)
            return
        exp.step = metrics.step
        exp.counters.groups_trained += len(groups)
        exp.staleness.update(exp.learner_version - g.policy_version for g in groups)
        if metrics.checkpointed_journal_seq is not None:
            exp.journal.compact(through_seq=metrics.checkpointed_journal_seq)
        # JSON has no inf/NaN: a non-finite metric (say, an empty ratio range) is shown as null.
        exp.last_metrics = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                            for k, v in metrics.model_dump().items()}
        exp.probe = groups[-1]
        self.metrics_log.train(metrics, policy_version=exp.serving_version, groups=len(groups))
        log.info("%s: step %d loss %.4f reward %.3f kl %.4f clipped %.3f", exp.name, metrics.step,
                 metrics.loss, metrics.reward_mean, metrics.kl, metrics.clipped_fraction)
        if exp.step % exp.config.algorithm.push_every == 0:
            await self.push()

    async def push(self) -> None:
        """Write a new version, load it on every sampler under a new LoRA id, check it, serve it."""
        exp = self.exp
        started = time.monotonic()
        if not await self._version_slot():
            exp.record_error(f"push skipped: {len(exp.adapter_paths)} versions still in use by requests "
                             f"(max_loaded_versions {self.max_loaded_versions}) after {self.train_timeout_s:.0f} s")
            return
        try:
            saved: AdapterVersion = await self.workers.learner.call(
                "save_adapter", SaveAdapterRequest(name=exp.name), AdapterVersion)
            exp.learner_version = saved.version
            await self.workers.load_everywhere(AdapterRef(name=exp.name, version=saved.version), saved.path)
        except ApiError as exc:
            exp.record_error(f"push failed: {exc.message}")
            log.error("%s: push failed: %s", exp.name, exc.message)
            return
        exp.adapter_paths[saved.version] = saved.path
        exp.serving_version = saved.version
        exp.last_push_at = time.time()
        exp.last_push_seconds = time.monotonic() - started
        retire_unused_versions(exp, self.workers)
        verification = await self.verify(saved.version)
        self.metrics_log.push(saved.version, exp.step, exp.last_push_seconds, verification)

    async def _version_slot(self) -> bool:
        """Wait until fewer than max_loaded_versions versions are loaded: slow requests pin old ones."""
        deadline = time.monotonic() + self.train_timeout_s
        while len(self.exp.adapter_paths) >= self.max_loaded_versions:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def verify(self, version: int) -> VerificationResult | None:
        """Sampler logprobs of a stored completion under `version` must match the learner's (None: no
        check could run)."""
        exp, probe = self.exp, self.exp.probe
        if probe is None:
            return None
        completions = [c.token_ids for c in probe.completions if c.token_ids][:PROBE_COMPLETIONS]
        try:
            async with self.workers.sampler() as sampler:
                scored: ScoreResponse = await sampler.call("score", ScoreRequest(
                    prompt_token_ids=probe.prompt_token_ids, completions_token_ids=completions,
                    temperature=probe.temperature, adapter=AdapterRef(name=exp.name, version=version),
                ), ScoreResponse)
            learner: LogprobsResponse = await self.workers.learner.call("logprobs", LogprobsRequest(
                name=exp.name, prompt_token_ids=probe.prompt_token_ids,
                completions_token_ids=completions, temperature=probe.temperature), LogprobsResponse)
        except ApiError as exc:
            exp.record_error(f"verification of v{version} could not run: {exc.message}")
            return None
        diffs = [abs(a - b) for s_row, l_row in zip(scored.logprobs, learner.logprobs)
                 for a, b in zip(s_row, l_row)]
        mean = sum(diffs) / max(len(diffs), 1)
        result = VerificationResult(version=version, mean_abs_diff=mean, max_abs_diff=max(diffs, default=0.0),
                                    tokens=len(diffs), ok=mean <= self.verify_tolerance)
        exp.last_verification = result
        if not result.ok:
            message = (f"v{version}: sampler and learner logprobs differ by {mean:.4f} nats on average "
                       f"(tolerance {self.verify_tolerance})")
            exp.record_error(message)
            log.error("%s: verification failed: %s", exp.name, message)
        return result


def retire_unused_versions(exp: Experiment, workers: WorkerPool) -> None:
    """Unload versions that are neither served nor used by an in-flight request."""
    for version in [v for v in exp.adapter_paths if v != exp.serving_version and exp.inflight[v] == 0]:
        del exp.adapter_paths[version]
        exp.inflight.pop(version, None)
        asyncio.create_task(workers.unload_everywhere(AdapterRef(name=exp.name, version=version)))
