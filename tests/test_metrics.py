"""`GET /metrics` over real HTTP, read back with prometheus_client's own parser."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.serving import complete_when_admitted, headers, wait_for


async def scrape(server) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/metrics", headers=headers()) as response:
            assert response.status == 200 and response.content_type == "text/plain"
            text = await response.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_follow_training(server, client):
    name = "metrics-exp"
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1},
                                    "sampling": {"n": 2, "max_tokens": 3}})
    for _ in range(2):
        group = await complete_when_admitted(client, name, prompt="Pick a number")
        await client.feedback(name, group.group_id, [1.0, 0.0])

    async def trained():
        status = await client.status(name)
        return status if status.counters.groups_trained == 2 and status.policy_version == 2 else None

    status = await wait_for(trained, timeout_s=300)
    samples = await scrape(server)
    exp = (("experiment", name),)
    assert samples[("grpo_policy_version", exp)] == status.policy_version == 2
    assert samples[("grpo_groups_total", (("experiment", name), ("outcome", "sampled")))] == 2
    assert samples[("grpo_groups_total", (("experiment", name), ("outcome", "trained")))] == 2
    assert samples[("grpo_sampled_tokens_total", exp)] == status.counters.tokens_sampled > 0
    assert samples[("grpo_reward_mean", exp)] == 0.5
    assert samples[("grpo_trained_staleness_count", exp)] == 2  # one observation per trained group
    assert samples[("grpo_trained_staleness_bucket", (("experiment", name), ("le", "+Inf")))] == 2
    assert samples[("grpo_push_seconds", exp)] > 0
    assert samples[("grpo_worker_up", (("state", "ready"), ("worker", "learner")))] == 1
    route = (("method", "POST"), ("route", "/v1/experiments/{name}/feedback"), ("status", "202"))
    assert samples[("grpo_http_requests_total", route)] >= 2
    await client.delete_experiment(name)
