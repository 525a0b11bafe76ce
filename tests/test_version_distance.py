"""The nearest_version push check (grpo_server/runtime/version_distance.py) on synthetic logprobs with bf16-sized
noise, and its plumbing in VersionChecks (grpo_server/runtime/verification.py) with the recording workers of
tests/test_training.py. The real bf16 sampler and learner run it in tests/test_version_check_bf16.py."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from grpo_server.protocol.wire import ScoredVersion, ScoreResponse
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.metrics_log import MetricsLog
from grpo_server.runtime.status import experiment_status
from grpo_server.runtime.training import TrainingLoop
from grpo_server.runtime.version_distance import (ALARM_STANDARD_ERRORS, MAX_STEP_FRACTION_SE, MIN_STEP_FRACTION,
                                                   nearest_version)
from tests.test_training import LOGPROBS, FakeWorkers, queue, rated_group, training_for, wait_until

NOISE = 0.12  # a bf16 sampler's gap to a float32 learner, nats a token (0.07-0.13 measured)
TOLERANCE = 0.05


def _scorings(step_size: float, tokens: int = 60, seed: int = 3) -> tuple[list[list[float]], ...]:
    """(previous, learner, noise): the learner's N-1 and N logprobs, 2 completions, and a sampler's bf16 noise."""
    rng = random.Random(seed)
    previous = [[-rng.uniform(0.1, 6.0) for _ in range(tokens // 2)] for _ in range(2)]
    learner = [[x + rng.choice((-1, 1)) * step_size * rng.uniform(0.5, 1.5) for x in row] for row in previous]
    noise = [[rng.gauss(0.0, NOISE) for _ in row] for row in previous]
    return previous, learner, noise


def _plus(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def test_a_sampler_serving_the_pushed_version_passes_though_its_gap_is_above_the_tolerance():
    previous, learner, noise = _scorings(step_size=0.3)
    found = nearest_version(_plus(learner, noise), learner, previous, noise_floor=0.1, tolerance=TOLERANCE)
    assert found.mean_abs_diff > TOLERANCE  # the tolerance check would fail this right push
    assert found.ok is True and abs(found.step_fraction - 1.0) < 0.2, found
    assert found.previous_mean_abs_diff > found.mean_abs_diff


def test_a_sampler_still_serving_the_previous_version_fails():
    previous, learner, noise = _scorings(step_size=0.3)
    found = nearest_version(_plus(previous, noise), learner, previous, noise_floor=0.1, tolerance=TOLERANCE)
    # Within the noise band (a tolerance wide enough for bf16 would pass it): only the step fraction tells.
    assert found.mean_abs_diff < found.band
    assert found.ok is False and abs(found.step_fraction) < 0.2, found


def test_other_weights_altogether_fail_on_the_noise_band():
    previous, learner, noise = _scorings(step_size=0.3)
    rng = random.Random(11)
    other = [[x + rng.gauss(0.0, 1.2) for x in row] for row in learner]  # a random adapter: ~1 nat a token
    found = nearest_version(other, learner, previous, noise_floor=0.1, tolerance=TOLERANCE)
    assert found.ok is False and found.mean_abs_diff > found.band and "noise band" in found.reason


def test_versions_too_close_for_the_noise_are_inconclusive_and_a_tiny_lr_shows_it():
    previous, learner, noise = _scorings(step_size=0.002)  # a tiny learning rate: 500x under the noise
    for sampler in (_plus(learner, noise), _plus(previous, noise)):  # right or missing: it cannot say
        found = nearest_version(sampler, learner, previous, noise_floor=0.1, tolerance=TOLERANCE)
        assert found.ok is None and found.step_fraction_se > MAX_STEP_FRACTION_SE, found
    identical = nearest_version(_plus(learner, noise), learner, learner, noise_floor=0.1, tolerance=TOLERANCE)
    assert identical.ok is None and identical.step_fraction is None  # no step at all
    no_floor = nearest_version(_plus(learner, noise), learner, learner, None, TOLERANCE)
    assert no_floor.ok is None and no_floor.noise_floor is None and "noise floor" in no_floor.reason


def test_without_a_measured_floor_the_probe_fit_gives_one_and_still_tells_right_missing_and_wrong():
    # A learner under bf16 autocast has no free check, so no floor is measured: the fit's residual is the floor.
    previous, learner, noise = _scorings(step_size=0.3)
    right = nearest_version(_plus(learner, noise), learner, previous, None, TOLERANCE)
    assert right.ok is True, right
    assert 0.5 * NOISE < right.noise_floor < NOISE  # mean |gauss(0, sigma)| = 0.8 sigma
    missing = nearest_version(_plus(previous, noise), learner, previous, None, TOLERANCE)
    assert missing.ok is False and abs(missing.step_fraction) < 0.2, missing
    rng = random.Random(11)
    other = [[x + rng.gauss(0.0, 1.2) for x in row] for row in learner]
    wrong = nearest_version(other, learner, previous, None, TOLERANCE)
    assert wrong.ok is False and "other weights" in wrong.reason, wrong


def test_with_float32_noise_the_band_is_the_tolerance_so_it_fails_what_the_tolerance_fails():
    previous, learner, _ = _scorings(step_size=0.3)
    off = [[x + 0.06 for x in row] for row in learner]  # 0.06 off: the tolerance check fails it
    found = nearest_version(off, learner, previous, noise_floor=1e-5, tolerance=TOLERANCE)
    assert found.band == TOLERANCE and found.ok is False


def test_a_gap_within_the_tolerance_passes_whatever_the_fraction_says():
    # Late in a run: near-certain tokens, a step of thousandths of a nat, a sampler 0.004 nats from the pushed
    # version whose fit reads 1.57 of the step (seen in a bf16 race): the tolerance check would pass it too.
    previous, learner, _ = _scorings(step_size=0.008)
    sampler = [[p + 1.57 * (n - p) for p, n in zip(rp, rn)] for rp, rn in zip(previous, learner)]
    found = nearest_version(sampler, learner, previous, noise_floor=0.05, tolerance=TOLERANCE)
    assert found.step_fraction > 1.5 and found.mean_abs_diff < TOLERANCE
    assert found.ok is True and "within the tolerance" in found.reason


@pytest.mark.parametrize("fraction, ok", [(0.44, True), (0.2, False), (1.4, True), (1.7, False)])
@pytest.mark.parametrize("step_size", [0.3, 1.0])  # 1.0: the gap to N, 0.56 nats, is above the band
def test_a_partial_answer_to_the_step_passes_and_none_or_a_double_one_fails(fraction, ok, step_size):
    # bf16 serving answers a small update only in part (0.44 at a demo's v1 through vLLM's LoRA path).
    previous, learner, noise = _scorings(step_size=step_size)
    small = [[x * 0.05 for x in row] for row in noise]  # little noise: the fit reads the fraction given
    sampler = [[p + fraction * (n - p) + e for p, n, e in zip(rp, rn, re)]
               for rp, rn, re in zip(previous, learner, small)]
    found = nearest_version(sampler, learner, previous, noise_floor=0.1, tolerance=TOLERANCE)
    assert abs(found.step_fraction - fraction) < 0.05 and found.ok is ok, found


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError):
        nearest_version([[-1.0]], [[-1.0, -2.0]], [[-1.0]], 0.1, TOLERANCE)


class DistanceWorkers(FakeWorkers):
    """The learner answers with the previous version's logprobs too (one nat of step per token: clear), and the
    sampler scores as `serves` says: the pushed version plus bf16-sized noise, or the previous one."""

    def __init__(self, serves: str):
        super().__init__()
        self.previous = [[x - 1.0 for x in row] for row in LOGPROBS]
        sampler_rows = LOGPROBS if serves == "pushed" else self.previous
        noisy = [[x + (0.1 if i % 2 else -0.1) for i, x in enumerate(row)] for row in sampler_rows]
        self.the_sampler.score = self._score(noisy)
        score_version = self.learner.score_version

        async def score_with_previous(name, version, probe, previous=False):
            scored: ScoredVersion = await score_version(name, version, probe, previous)
            assert previous  # the nearest_version check asks for it
            scored.previous_version, scored.previous_logprobs = version - 1, self.previous
            return scored
        self.learner.score_version = score_with_previous

    def _score(self, rows):
        async def score(request):
            self.calls.append(f"score v{request.adapter.version}")
            return ScoreResponse(logprobs=rows)
        return score


def _nearest_training(tmp_path, workers) -> tuple[Experiment, TrainingLoop]:
    exp, training = training_for(tmp_path, workers)
    return exp, TrainingLoop(exp, workers, verify_tolerance=TOLERANCE, train_timeout_s=5.0, max_loaded_versions=8,
                             metrics_log=MetricsLog(tmp_path / "metrics-nearest.jsonl"), nearest_version=True)


@pytest.mark.parametrize("serves,ok", [("pushed", True), ("previous", False)])
async def test_version_checks_take_the_floor_from_the_first_step_and_probe_each_push(tmp_path, serves, ok):
    workers = DistanceWorkers(serves)
    workers.learner.call = _with_gap(workers.learner.call, gap=0.1)  # every free check: bf16-sized, within the band
    exp, training = _nearest_training(tmp_path, workers)
    task = asyncio.create_task(training.run())
    try:
        queue(exp, rated_group(1))  # v0's batch: its free check is the noise floor
        await wait_until(lambda: exp.serving_version == 1)
        assert training.checks.noise_floor == pytest.approx(0.1) and exp.last_verification is None
        queue(exp, rated_group(2, policy_version=1))  # v1's own batch: within the band, so the probe decides
        await wait_until(lambda: exp.last_verification is not None and exp.last_verification.version == 1)
        result = exp.last_verification
        assert "score v1" in workers.calls and result.checked_on == "probe" and result.method == "nearest_version"
        assert result.ok is ok and result.previous_version == 0 and result.noise_floor == pytest.approx(0.1)
        assert result.mean_abs_diff > TOLERANCE  # 0.1 or more: the tolerance check would have failed both
        assert (experiment_status(exp, 0, 0).state == "active") is ok
        push = [r for r in training.metrics_log.records("push") if r["version"] == 1]
        assert push[0]["verdict"] == ("ok" if ok else "failed")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_free_check_above_the_noise_band_fails_without_a_probe(tmp_path):
    workers = DistanceWorkers("pushed")
    gaps = iter([0.1, 2.0])  # v0's floor, then v1's batch a wrong adapter's distance away
    workers.learner.call = _with_gap(workers.learner.call, gap=lambda: next(gaps))
    exp, training = _nearest_training(tmp_path, workers)
    task = asyncio.create_task(training.run())
    try:
        queue(exp, rated_group(1))
        await wait_until(lambda: exp.serving_version == 1)
        queue(exp, rated_group(2, policy_version=1))
        await wait_until(lambda: exp.last_verification is not None)
        assert exp.last_verification.ok is False and exp.last_verification.checked_on == "trained_batch"
        assert "noise band" in exp.errors[-1] and "score v1" not in workers.calls
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _with_gap(call, gap):
    async def wrapped(verb, request):
        answer = await call(verb, request)
        if verb == "train" and answer.sampler_gap_tokens:
            answer.sampler_gap_mean = answer.sampler_gap_max = gap() if callable(gap) else gap
        return answer
    return wrapped


# --- which check an experiment gets (verify_method auto) ---------------------------------------------------


@pytest.mark.parametrize("settings, worker_dtypes, expected", [
    ({}, ["float32", "float32"], False),  # the CPU defaults: both exact, the tolerance check
    ({}, ["bfloat16", "bfloat16"], True),  # dtype auto on a GPU: bf16 both, 0.05-0.08 nats apart on an H200
    ({}, ["float32", "bfloat16"], True),  # a bf16 learner beside a float32 sampler (another host)
    ({}, [None, None], False),  # workers that do not say: the configuration alone decides
    ({"sampler": {"dtype": "bfloat16"}}, [None, "float32"], True),
    ({"verify_method": "tolerance"}, ["bfloat16", "bfloat16"], False),  # said outright: as said
    ({"verify_method": "nearest_version"}, ["float32", "float32"], True)])
def test_the_check_follows_what_the_workers_compute_in(settings, worker_dtypes, expected):
    from grpo_server.config import ServerConfig
    from grpo_server.runtime.verification import nearest_version_needed

    assert nearest_version_needed(ServerConfig(**settings), worker_dtypes) is expected


def test_one_token_carrying_the_fit_leaves_it_inconclusive():
    """bf16's error is largest on unlikely tokens, where a step moves the logprob most too: one such token whose
    error happens to lie along the step pulls a right push's fraction past 1.5. Least squares alone called that a
    failure (its error comes from the other tokens' small misfit); the jackknife's error leaves it inconclusive."""
    rng = random.Random(5)
    before = [-rng.uniform(0.5, 4.0) for _ in range(31)] + [-14.9]  # a probe of 32 tokens, the last unlikely
    step = [rng.choice((-1, 1)) * rng.uniform(0.02, 0.06) for _ in range(31)] + [0.3]
    error = [rng.gauss(0.0, 0.01) for _ in range(31)] + [0.45]  # bf16's error on the unlikely token, along the step
    now = [b + d for b, d in zip(before, step)]
    sampler = [n + e for n, e in zip(now, error)]
    found = nearest_version([sampler], [now], [before], noise_floor=0.05, tolerance=0.01)
    least_squares = math.sqrt(sum((s - b - found.step_fraction * d) ** 2 for s, b, d in zip(sampler, before, step))
                              / 32) / math.sqrt(sum(d * d for d in step))
    assert found.step_fraction > 1.5 and least_squares < MAX_STEP_FRACTION_SE  # decisive by least squares alone
    assert found.step_fraction_se > MAX_STEP_FRACTION_SE and found.ok is None, found  # the jackknife's error
    # (Its step is small against that one token's error, too: "too close to tell apart", the next test's rule.)


def test_noise_that_lines_up_with_a_small_step_leaves_it_inconclusive():
    """The sampler's rounded weights are one perturbation, and its effect on the probe can line up with the step's.
    A right push then reads far from 1 with a small error (0.33 +- 0.09 on the quick bench); with a step under
    STEP_OVER_NOISE times the noise the fit leaves, that is no failure. A sampler that far from the pushed version
    on a step 5x larger, well above the noise, still fails."""
    rng = random.Random(7)
    before = [[-rng.uniform(0.5, 6.0) for _ in range(40)] for _ in range(2)]
    step = [[rng.choice((-1, 1)) * rng.uniform(0.02, 0.06) for _ in row] for row in before]
    noise = [[-0.85 * d + rng.gauss(0.0, 0.04) for d in row] for row in step]  # mostly against the step
    now = _plus(before, step)
    found = nearest_version(_plus(now, noise), now, before, noise_floor=0.05, tolerance=0.01)
    assert found.step_fraction < MIN_STEP_FRACTION and found.step_fraction_se < MAX_STEP_FRACTION_SE, found
    assert abs(found.step_fraction - 1.0) > ALARM_STANDARD_ERRORS * found.step_fraction_se  # decisive by its errors
    assert found.ok is None and "too close to tell apart" in found.reason, found
    big = [[5 * d for d in row] for row in step]  # the same noise, a step 5x larger: a missing push fails
    missing = nearest_version(_plus(before, [[n + d for n, d in zip(rn, rd)] for rn, rd in zip(noise, step)]),
                              _plus(before, big), before, noise_floor=0.05, tolerance=0.01)
    assert missing.ok is False and missing.step_fraction < MIN_STEP_FRACTION, missing
