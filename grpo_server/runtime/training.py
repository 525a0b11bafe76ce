"""The learning side of one experiment: batches of rated groups to the learner, versioned pushes to the
samplers, and (grpo_server/runtime/verification.py) the check that the samplers serve what the learner trained.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_server.protocol import log_context
from grpo_server.protocol.errors import ApiError, Unavailable
from grpo_server.protocol.wire import (Completion, TrainMetrics, TrainRequest, TrainSample,
                                       VersionProbe)
from grpo_server.runtime.groups import Group
from grpo_server.runtime.metrics_log import MetricsLog
from grpo_server.runtime.verification import VersionChecks, probe_of
from grpo_server.workers.pool import WorkerPool

if TYPE_CHECKING:  # the experiment holds its training loop (runtime/experiment/owner.py)
    from grpo_server.runtime.experiment import Experiment

log = logging.getLogger(__name__)

# After a failed step whose batch went back to the queue, the next try waits this long: a failure that lasts
# (a learner that answers errors) is tried a few times a minute, not in a loop.
FAILED_STEP_PAUSE_S = 2.0
# A batch whose step the learner failed on (or refused) this many times in a row is dropped, not retried forever:
# counted in counters.groups_dropped_failed, with the reason in the experiment's errors and the log. A learner
# that is down, restarting or timing out (503) counts no try: that is no fault of the batch.
MAX_BATCH_FAILURES = 5
# A push owed because the served version is too old to sample fresh groups from (`_catch_up`), tried again after
# this long when it fails (a full disk: every try writes a version's files).
CATCH_UP_RETRY_S = 5.0


@dataclass(frozen=True)
class Pushing:
    """A version just served, whose check's learner side is still to be scored (`score_for_check`)."""
    version: int
    probe: VersionProbe | None


def truncated(completion: Completion) -> bool:
    """Cut at its max_tokens (finish_reason 'length'). A group of episodes' sequence carries the finish reason
    of its last turn when that turn was cut (runtime/episodes.py), so it counts as truncated then."""
    return completion.finish_reason == "length"


def train_samples(groups: list[Group], mask_truncated: bool = False) -> list[TrainSample]:
    """The sequences of `groups` the loss sees: every non-empty one, less the truncated ones under
    `mask_truncated` (DAPO's overlong filtering: their group's advantages stay as the rewards made them)."""
    return [
        TrainSample(
            prompt_token_ids=prompt_ids,
            completion_token_ids=completion.token_ids,
            sampler_logprobs=completion.logprobs,
            advantage=advantage,
            reward=reward,
            policy_version=group.policy_version,
            temperature=group.temperature,
            # A completion the model did not sample was scored over the whole vocabulary (runtime/external.py).
            top_p=1.0 if completion.finish_reason == "external" else group.top_p,
            loss_mask=mask,
            constrained=completion.constrained,
        )
        for group in groups
        for prompt_ids, completion, advantage, reward, mask in group.training_sequences()
        if completion.token_ids  # an empty completion carries no gradient
        and not (mask_truncated and truncated(completion))
    ]


def truncated_left_out(groups: list[Group], mask_truncated: bool) -> int:
    """How many sequences `train_samples` leaves out of `groups` for being truncated."""
    if not mask_truncated:
        return 0
    return sum(bool(c.token_ids) and truncated(c) for g in groups for _, c, *_ in g.training_sequences())


class TrainingLoop:
    """Runs as one task per experiment; the front end's other requests never wait on it."""

    def __init__(self, experiment: Experiment, workers: WorkerPool, verify_tolerance: float,
                 train_timeout_s: float, max_loaded_versions: int, metrics_log: MetricsLog,
                 nearest_version: bool = False, idle_check_s: float = 5.0):
        """`idle_check_s`: ServerConfig.verify_idle_s, how long training is idle before the newest version is
        probed."""
        self.exp = experiment
        self.idle_check_s = idle_check_s
        self.metrics_log = metrics_log
        self.workers = workers
        self.train_timeout_s = train_timeout_s
        self.max_loaded_versions = max_loaded_versions
        self.checks = VersionChecks(experiment, workers, verify_tolerance, metrics_log, nearest_version)
        self._failing: tuple[tuple[str, ...], int] = ((), 0)  # the batch whose steps failed, and how many times
        self._catching_up = False  # a push owed (`_catch_up`) failed, and is tried again

    async def run(self) -> None:
        exp = self.exp
        batch_groups = exp.config.algorithm.batch_groups
        try:
            with log_context.bound(experiment=exp.name):  # every line of this task, and the verbs it calls
                await self._train_forever(batch_groups)
        finally:  # the experiment was deleted or the server stops
            self.checks.close()

    async def _train_forever(self, batch_groups: int) -> None:
        exp = self.exp
        while True:
            # Stale groups leave the queue before a batch is formed, so every batch is full of fresh ones.
            stale_before = exp.counters.groups_dropped_stale
            while not exp.batch_ready(batch_groups):
                # Owed once groups went stale for it (not for a Tinker model's steps, which push on request), and
                # until it is pushed.
                if self._served_too_old() and (exp.counters.groups_dropped_stale > stale_before or self._catching_up):
                    self._catching_up = not await self._catch_up()
                    continue
                self._catching_up = False
                if not await exp.queue_grew(self.idle_check_s):  # no step soon to check the newest version
                    if not self.workers.turns.sampling_calls:  # a probe amid generations drains them
                        self.checks.probe_unchecked()
            # One id for the step, its push and its check: the same in the learner's and samplers' lines; the
            # version the step trains from.
            with log_context.bound(request_id=log_context.new_request_id("step"), version=exp.learner_version):
                await self.train(*exp.take_batch(batch_groups))

    def _served_too_old(self) -> bool:
        """Whether every group sampled now is stale before it can be trained: the served version is more than
        max_staleness steps behind the learner. Pushes that failed (a full disk) leave it so, and then no step
        comes to push again: the chaos soak saw both experiments drop every group as stale for good. So does a
        push_every over max_staleness + 1."""
        exp = self.exp
        return exp.step - exp.version_steps.get(exp.serving_version, 0) > exp.config.algorithm.max_staleness

    async def _catch_up(self) -> bool:
        """Push the learner's weights as they are, so that what is sampled next can be trained: a push owed, in
        the training turn and checked as after a step. Whether it was pushed: a failure is shown (push failed),
        and the caller tries again after CATCH_UP_RETRY_S, while groups keep going stale."""
        exp = self.exp
        if not self._catching_up:  # once, not at every try
            log.warning("%s: the served v%d is more than max_staleness (%d) steps behind step %d, so every group "
                        "sampled from it is stale: pushing the weights as they are", exp.name, exp.serving_version,
                        exp.config.algorithm.max_staleness, exp.step)
        slot = await self._version_slot()
        async with self.workers.turns.training(exp.name):
            pushed = await self.push(slot)
        if pushed is None:
            await asyncio.sleep(CATCH_UP_RETRY_S)
            return False
        await self.score_for_check(pushed)
        await self.prune_versions()
        return True

    async def train(self, groups: list[Group], generation: int) -> None:
        exp = self.exp
        mask_truncated = exp.config.algorithm.mask_truncated
        samples = train_samples(groups, mask_truncated)
        left_out = truncated_left_out(groups, mask_truncated)
        if not samples:
            exp.trained(groups, None, left_out)  # nothing left to train: counted, not sent
            return
        # Groups queued in journal order, stale ones dropped first: every entry up to the batch's newest
        # is in this batch or was dropped, so the learner can record that one number. Dr. GRPO's normaliser
        # is the experiment's sampling.max_tokens, one constant for its whole life (not the batch's longest
        # budget, which a request's own max_tokens, an external completion or an episode would move).
        request = TrainRequest(
            name=exp.name, samples=samples, max_tokens=exp.config.sampling.max_tokens, num_groups=len(groups),
            journal_seq=max(g.journal_seq for g in groups),
            group_ids=[g.group_id for g in groups], passed_over=dict(exp.passed_over),
        )
        await self.workers.wait_learner_ready(self.train_timeout_s)
        # A free slot for the version this step will push, waited for before the turn: inside it no
        # request runs that could free one (a probe keeps a version loaded, and needs a sampling turn).
        pushing = (exp.step + 1) % exp.config.algorithm.push_every == 0
        slot = await self._version_slot() if pushing else False
        # The step and the push that follows it, in one turn (grpo_server/workers/pool.py): when sampling takes
        # turns with training, what it samples next comes from the new version.
        async with self.workers.turns.training(exp.name):
            if exp.queue_generation != generation:
                return  # the learner restarted meanwhile and these groups were queued again from the journal
            if exp.gradients_pending:  # a Tinker forward_backward took the turn first: after its optim_step
                exp.put_back(groups, generation)
                return
            try:
                metrics = await self.workers.learner.train(request, timeout_s=self.train_timeout_s)
            except ApiError as exc:
                # Not trained yet, visibly (status and log carry the error): the batch goes back to the head of
                # the queue and is tried again after a pause. If the learner crashed, its restart has queued these
                # groups again from the journal instead. After MAX_BATCH_FAILURES failures in a row, dropped (not
                # if the queue was rebuilt meanwhile: it holds them again).
                if self._failed(groups, exc) >= MAX_BATCH_FAILURES and generation == exp.queue_generation:
                    self._drop_failed(groups, exc)
                else:
                    again = exp.put_back(groups, generation)
                    exp.record_error(f"train step failed, {len(groups)} groups not trained"
                                     f"{', tried again shortly' if again else ''}: {exc.message}")
                    log.error("%s: train step failed%s: %s", exp.name, ", batch put back" if again else "",
                              exc.message)
                metrics = None
            if metrics is not None:
                self._failing = ((), 0)
                self._trained(groups, metrics, left_out, request.passed_over)
                pushed = await self.push(slot) if pushing else None
        if metrics is None:  # outside the turn, so that what made the step fail can finish meanwhile
            await asyncio.sleep(FAILED_STEP_PAUSE_S)
            return
        if pushed is not None:  # outside the turn: the new version's first completions need not wait for these
            await self.score_for_check(pushed)
        if pushing:
            await self.prune_versions()

    def _failed(self, groups: list[Group], exc: ApiError) -> int:
        """Count a failed step of `groups`: how many times in a row this batch failed (a 503, the learner
        unavailable, counts none)."""
        batch = tuple(g.group_id for g in groups)
        failing, tries = self._failing
        if batch != failing:
            tries = 0
        if not isinstance(exc, Unavailable):
            tries += 1
        self._failing = (batch, tries)
        return tries

    def _drop_failed(self, groups: list[Group], exc: ApiError) -> None:
        """Drop a batch the learner failed on MAX_BATCH_FAILURES times in a row: counted and reported, never lost
        silently. Not put back, so the next step's journal position passes it (and its checkpoint compacts it
        away); a learner restart before that step queues it again from the journal, for as many tries."""
        exp = self.exp
        self._failing = ((), 0)
        exp.dropped_failed(groups, f"train step failed {MAX_BATCH_FAILURES} times in a row on the same batch: its "
                                   f"{len(groups)} groups dropped (counters.groups_dropped_failed): {exc.message}")
        log.error("%s: train step failed %d times on the same batch, %d groups dropped (journal seq %d-%d): %s",
                  exp.name, MAX_BATCH_FAILURES, len(groups), min(g.journal_seq for g in groups),
                  max(g.journal_seq for g in groups), exc.message)

    def _trained(self, groups: list[Group], metrics: TrainMetrics, left_out: int = 0,
                 passed_over: dict[str, str] | None = None) -> None:
        exp = self.exp
        exp.trained(groups, metrics, left_out, passed_over)  # left_out: truncated completions mask_truncated kept out
        self.metrics_log.train(metrics, policy_version=exp.serving_version, groups=len(groups))
        self.checks.trained(metrics)
        kl = "off" if metrics.kl is None else f"{metrics.kl:.4f}"  # None: beta = 0, no reference forward
        # The mismatch over the current version's tokens (numerics) apart from stale tokens' KL (policy change).
        fresh, stale = ("-" if kl_part is None else f"{kl_part:.2e}"
                        for kl_part in (metrics.mismatch_kl_fresh, metrics.offpolicy_kl_stale))
        log.info("%s: step %d loss %.4f reward %.3f kl %s clipped %.3f mismatch kl %s (%d fresh tokens), "
                 "off-policy kl %s (%d stale)", exp.name, metrics.step, metrics.loss, metrics.reward_mean, kl,
                 metrics.clipped_fraction, fresh, metrics.mismatch_fresh_tokens, stale, metrics.offpolicy_stale_tokens)

    async def push(self, slot: bool, probe: VersionProbe | None = None) -> Pushing | None:
        """Write a new version, load it on every sampler under a new LoRA id, serve it; None if it was not.
        `slot`: whether a version slot was free (`_version_slot`). `probe`: what the version's check scores
        (default: the newest trained group's first completions), by `score_for_check` once this returns."""
        exp = self.exp
        started = time.monotonic()
        if not slot:
            exp.record_error(f"push skipped: {len(exp.adapter_paths)} versions still in use by requests "
                             f"(max_loaded_versions {self.max_loaded_versions}) after {self.train_timeout_s:.0f} s")
            return None
        try:
            saved = await self.workers.learner.save_adapter(exp.name)
            exp.learned(saved.version, saved.step)
            await self.workers.load_everywhere(exp.adapter(saved.version), saved.path,
                                               saved.fingerprint)
        except ApiError as exc:
            exp.record_error(f"push failed: {exc.message}")
            log.error("%s: push failed: %s", exp.name, exc.message)
            return None
        exp.pushed(seconds=time.monotonic() - started, at=time.time())
        exp.serve(saved.version, saved.path)
        return Pushing(saved.version, probe or probe_of(exp.probe))

    async def score_for_check(self, pushed: Pushing) -> None:
        """The learner's side of the pushed version's check: its probe under that version (and, for nearest_version,
        under the one before), scored before this experiment's next step can move the weights; then the check
        waits for its chance (grpo_server/runtime/verification.py). This was part of the push, and took 0.6-0.7 of
        its 0.8-0.9 s on the bench's SmolLM2 (two float32 forwards); now the version serves meanwhile."""
        exp = self.exp
        learner_side = None
        if pushed.probe is not None:
            try:
                learner_side = await self.workers.learner.score_version(exp.name, pushed.version, pushed.probe,
                                                                        previous=self.checks.nearest_version)
            except ApiError as exc:  # the version serves; it goes unchecked, visibly
                exp.record_error(f"v{pushed.version} not checked: the learner could not score its probe: "
                                 f"{exc.message}")
                log.warning("%s: score_version v%d failed: %s", exp.name, pushed.version, exc.message)
        if learner_side is None:
            self.checks.pushed(pushed.version, exp.last_push_seconds, None, None)
        else:
            self.checks.pushed(pushed.version, exp.last_push_seconds, pushed.probe, learner_side.logprobs,
                               learner_side.previous_logprobs, learner_side.previous_version)

    async def prune_versions(self) -> None:
        """Let the learner delete the versions nobody needs (learner.keep_versions, learner/retention.py): one rule
        for every API, which keeps what is loaded, checked, served, or named by a client (a Tinker sampler or its
        saved sampler weights). Every push is followed by this, the native ones' and the Tinker ones' (`push_now`),
        so no version missing from `in_use` can come into use before the learner acts on it. A failure costs disk,
        not training: shown, and the next push prunes again."""
        exp = self.exp
        in_use = sorted(set(exp.adapter_paths) | exp.versions_in_check | {exp.serving_version}
                        | set(exp.named_versions))
        try:
            await self.workers.learner.prune_versions(exp.name, in_use)
        except ApiError as exc:
            exp.record_error(f"old adapter versions not pruned: {exc.message}")
            log.warning("%s: prune_versions failed: %s", exp.name, exc.message)

    async def _version_slot(self) -> bool:
        """Wait until fewer than max_loaded_versions versions are loaded: slow requests pin old ones."""
        deadline = time.monotonic() + self.train_timeout_s
        while len(self.exp.adapter_paths) >= self.max_loaded_versions:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def push_now(self, probe: VersionProbe | None = None) -> int:
        """A push a client asked for (the Tinker API's save_weights_for_sampler), as after a train step: in the
        experiment's training turn, checked like every push (on `probe`: a Tinker model has no sampled group).
        The version pushed; a 503 when it was not."""
        slot = await self._version_slot()
        before = self.exp.serving_version
        async with self.workers.turns.training(self.exp.name):
            pushed = await self.push(slot, probe)
        if pushed is not None:
            await self.score_for_check(pushed)
            await self.prune_versions()
        if self.exp.serving_version == before:
            reason = self.exp.errors[-1] if self.exp.errors else "push failed"
            raise Unavailable(f"{self.exp.name}: no new version was pushed ({reason})", code="push_failed")
        return self.exp.serving_version

