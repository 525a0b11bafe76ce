"""Which version does a sampler serve? The push check for a sampler whose numerics differ from the learner's.

A bf16 sampler beside a float32 learner scores every token 0.07-0.13 nats away from the learner (bf16 rounding),
more than a fixed tolerance meant for float32 round-off (0.05; float32 gaps are ~1e-5), so that check fails
right pushes; a tolerance wide enough for bf16 passes a sampler that still serves the previous version. This
check asks the question the push needs answered instead: is the sampler's scoring nearer the learner's version
N than the learner's N-1?

On the probe's tokens, with s the sampler's logprobs under N and l_N, l_prev the learner's under N and N-1:

- the step d = l_N - l_prev, exact (the learner scores both in float32) and r = s - l_prev. A sampler serving N
  gives r = d + e, one still serving N-1 gives r = e, e being its numeric noise;
- `step_fraction` a = <r, d> / <d, d>, the least-squares fit of r = a d + noise: ~1 when it serves N, ~0 when it
  serves N-1, and its standard error rms(r - a d) / |d|. The fit is first order in d: comparing the mean gaps
  |s - l_N| and |s - l_prev| instead would separate the two only at second order when d is small against e.

The verdict, in this order:

1. failed when what neither version explains, the mean |r - a d| the fit leaves (the mean gap to N when there is
   no step to fit), is above the band, `NOISE_BAND` times the noise floor (the start version's gap, measured for
   free by the first train step: runtime/verification.py), and never below the tolerance: other weights
   altogether (a wrong adapter gives ~1 nat a token, 8-20x a bf16 floor). With float32's floor (1e-5) the band
   is the tolerance, so this alone fails a sampler the tolerance check fails by a constant offset. The fit's
   residual, not the gap to N, so that a partial answer to a large step (below) is judged by its fraction.
   Without a measured floor (a learner training under bf16 autocast has no free check: its forward is not the
   samplers'; or the probe came before the first step) the floor is the probe's own: the mean |r - a d| the fit
   leaves, which is the noise e whether the sampler serves N or N-1. Above `MAX_NOISE_FLOOR` it is no dtype's
   noise, and the check fails: other weights.
2. ok when the mean gap to N is within the tolerance: what the tolerance check passes passes here too. Late in a
   run the probe's tokens are near certain and a step moves them by thousandths of a nat, which the fit's
   fraction over-reads (1.57 +- 0.01 at a gap of 0.004 nats to N in a bf16 race: docs/benchmarks/findings.md
   "bf16 sampling and the push check").
3. inconclusive when the step is too small against the noise for the fit to tell N from N-1 (standard error
   above `MAX_STEP_FRACTION_SE`: a tiny learning rate, a probe of few tokens), or when there is no step at all
   and no floor: neither passed nor an error.
4. failed when a is below `MIN_STEP_FRACTION` (a missing push: 0 +- its standard error) or above
   `MAX_STEP_FRACTION` (past N: an update applied twice), ok otherwise. The window is not centred on 1: bf16
   serving answers a small update only in part where the served weights or activations sit on the bf16 grid and
   round to nearest returns them to it (SmolLM2 is stored in bf16): first versions read 0.44-0.82 through vLLM's
   LoRA path and round-to-nearest merges (merges now round stochastically: sampler/merged_weights.py). At the
   largest standard error allowed, a missing push passes at 1.7 standard errors, a right one fails at 3.3.
   A failure is an error on the experiment, so its fraction must also lie `ALARM_STANDARD_ERRORS` jackknife
   standard errors (a refitted leaving out each token in turn) from 1, the pushed version; else inconclusive.
   bf16's error is largest on unlikely tokens, where a step moves the logprob most too, so one token of a probe's
   ~30 can carry the fit, and the least-squares error then reads a chance alignment as decisive: right pushes
   read 2.19 +- 0.11 and 1.73 +- 0.11 at the quick bench's third version (docs/benchmarks/findings.md
   "bf16 sampling and the push check"). On 18 probes of that bench dumped since, the jackknife's error was
   0.7-4.7x the least-squares one, 1.6x in the median.
   Nor can either error see noise that moves every token alike: the sampler's rounded weights are one
   perturbation, whose effect on the probe's logprobs lines up with the step's (both are largest on unlikely
   tokens). On those 18 probes of right pushes the step, mean |d|, was 0.2-1.9x the noise the fit leaves, and
   the fractions read -0.11 to 1.65 at least-squares errors of 0.08-0.73 (0.33 +- 0.09 among them); the bench
   failed right pushes at 1.85, 1.60 and 0.15 of the step since. So a failure also needs a step of at least
   `STEP_OVER_NOISE` times that noise; below it the versions are too close to tell, and the verdict is
   inconclusive. The 18 probes' fractions outside the window all had steps of 0.25-1.06 times their noise. The
   real bf16 test's missing push (tests/test_version_check_bf16.py: gaps of 0.26-0.31 nats to the pushed version,
   0.08-0.15 to the previous) failed, as it must, in 3 runs of 3 at 1.5; at 2.0 it was inconclusive once in 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A start version's free-check gap above this is no dtype's noise (bf16 on SmolLM2: 0.05-0.13; a wrong adapter ~1):
# it fails that version rather than setting the floor.
MAX_NOISE_FLOOR = 0.5
NOISE_BAND = 4.0  # a probe of two completions is noisy: SmolLM2's bf16 push gaps reached 2.6x the free check's mean
MAX_STEP_FRACTION_SE = 0.15
MIN_STEP_FRACTION = 0.25  # a quarter of the way from N-1 (0) to N (1); bf16's partial answer reads 0.44 and up
MAX_STEP_FRACTION = 1.5
ALARM_STANDARD_ERRORS = 3.0  # a failure's fraction is this many jackknife standard errors from the pushed version
STEP_OVER_NOISE = 1.5  # and its step, mean |d|, is this many times the noise the fit leaves (mean |r - a d|)


@dataclass(frozen=True)
class VersionDistance:
    ok: bool | None  # None: inconclusive
    mean_abs_diff: float  # |s - l_N|, mean over tokens
    max_abs_diff: float
    previous_mean_abs_diff: float  # |s - l_prev|
    step_fraction: float | None  # None when the step is exactly 0
    step_fraction_se: float | None
    band: float | None  # None without a noise floor
    noise_floor: float | None  # the one used: the measured floor given, or the probe fit's own (None: neither)
    tokens: int
    reason: str  # what decided the verdict, in words


def nearest_version(sampler: list[list[float]], learner: list[list[float]], previous: list[list[float]],
                    noise_floor: float | None, tolerance: float) -> VersionDistance:
    """The verdict above; the three arguments are the probe's per-token logprobs, one list per completion."""
    s, now, before = _flat(sampler), _flat(learner), _flat(previous)
    if not (len(s) == len(now) == len(before)) or not s:
        raise ValueError(f"the three scorings differ in shape or are empty: {len(s)}, {len(now)}, {len(before)} tokens")
    gaps = [abs(a - b) for a, b in zip(s, now)]
    mean_gap, max_gap = sum(gaps) / len(gaps), max(gaps)
    previous_gap = sum(abs(a - b) for a, b in zip(s, before)) / len(s)
    step = [a - b for a, b in zip(now, before)]
    residual = [a - b for a, b in zip(s, before)]
    step_sq = sum(x * x for x in step)
    fraction = se = alarm_se = None
    floor_source, unexplained = "the noise floor", mean_gap
    if step_sq > 0:
        fit = sum(r * d for r, d in zip(residual, step))
        fraction = fit / step_sq
        misfit = [r - fraction * d for r, d in zip(residual, step)]
        se = math.sqrt(sum(x * x for x in misfit) / len(misfit)) / math.sqrt(step_sq)
        alarm_se = max(se, _jackknife_se(residual, step, fit, step_sq))
        unexplained = sum(abs(x) for x in misfit) / len(misfit)
        if noise_floor is None:
            noise_floor, floor_source = unexplained, "the probe fit's noise floor"
    band = None if noise_floor is None else max(NOISE_BAND * noise_floor, tolerance)

    def verdict(ok: bool | None, reason: str, fraction_se: float | None = se) -> VersionDistance:
        return VersionDistance(ok, mean_gap, max_gap, previous_gap, fraction, fraction_se, band, noise_floor, len(s),
                               reason)

    if noise_floor is not None and noise_floor > MAX_NOISE_FLOOR:
        return verdict(False, f"the probe's noise after the fit, {noise_floor:.4f} nats a token, is above any "
                              f"dtype's noise ({MAX_NOISE_FLOOR}): other weights")
    if band is not None and unexplained > band:
        return verdict(False, f"what neither version explains, {unexplained:.4f} nats a token (mean gap to the "
                              f"pushed version {mean_gap:.4f}), is above the noise band {band:.4f} ({NOISE_BAND:g}x "
                              f"{floor_source} {noise_floor:.4f}, at least the tolerance)")
    if mean_gap <= tolerance:
        return verdict(True, f"mean gap to the pushed version {mean_gap:.4f} nats is within the tolerance {tolerance}")
    if band is None:
        return verdict(None, "no noise floor measured, and no step between the versions to fit one on")
    if fraction is None or se is None or se > MAX_STEP_FRACTION_SE:
        return verdict(None, f"the versions are too close to tell apart: step fraction {_fmt(fraction)} +- {_fmt(se)} "
                             f"(at most +- {MAX_STEP_FRACTION_SE} decides)")
    if not MIN_STEP_FRACTION <= fraction <= MAX_STEP_FRACTION:
        step_size = sum(abs(d) for d in step) / len(step)
        if step_size < STEP_OVER_NOISE * unexplained:
            return verdict(None, f"the step between the versions, {step_size:.4f} nats a token, is within "
                                 f"{STEP_OVER_NOISE:g}x the noise the fit leaves ({unexplained:.4f}): too close to "
                                 f"tell apart (step fraction {fraction:.2f} +- {alarm_se:.2f})", alarm_se)
        if abs(fraction - 1.0) < ALARM_STANDARD_ERRORS * alarm_se:
            return verdict(None, f"the step fraction {fraction:.2f} rests on a few tokens: within "
                                 f"{ALARM_STANDARD_ERRORS:g} standard errors of the pushed version (+- {alarm_se:.2f} "
                                 f"by the jackknife, {se:.2f} by least squares)", alarm_se)
        return verdict(False, f"the sampler sits at {fraction:.2f} of the step from the previous version to the "
                              f"pushed one (+- {alarm_se:.2f}; 1 = the pushed version, 0 = the previous one)", alarm_se)
    return verdict(True, f"step fraction {fraction:.2f} +- {se:.2f}")


def _jackknife_se(residual: list[float], step: list[float], fit: float, step_sq: float) -> float:
    """The fraction's standard error by the jackknife: its spread when refitted without each token in turn
    (inf when some token is the whole step: without it there is nothing to fit)."""
    left_out = []
    for r, d in zip(residual, step):
        rest = step_sq - d * d
        if rest <= 1e-12 * step_sq:
            return math.inf
        left_out.append((fit - r * d) / rest)
    n = len(left_out)
    mean = sum(left_out) / n
    return math.sqrt((n - 1) / n * sum((x - mean) ** 2 for x in left_out))


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def _fmt(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.2f}"
