"""`GET /metrics` over real HTTP, read back with prometheus_client's own parser; and its renderer alone."""

from __future__ import annotations

from collections import Counter, deque
from types import SimpleNamespace

import aiohttp
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from grpo_server.api import prometheus
from grpo_server.api_models import ExperimentCounters
from grpo_server.runtime.loop_lag import LoopLag
from grpo_server.runtime.token_budget import TokenBudget
from grpo_server.trackers import TrackerSet
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


def fake_front_end(experiments, pending=None, workers=None):
    """An orchestrator as the renderer reads it: `experiments` (each with its `trackers`), `groups.pending_count(name)`,
    `workers.states()`, `loop_lag` and `budget` (a held-token count of 100 per experiment)."""
    lag = LoopLag(interval_s=1.0, window_s=100.0)
    for lag_s in (0.001, 0.002, 0.003, 0.25):
        lag.add(lag_s)
    names = [e.name for e in experiments]
    return SimpleNamespace(experiments={e.name: e for e in experiments},
                           groups=SimpleNamespace(pending_count=lambda name: (pending or {}).get(name, 0)),
                           workers=SimpleNamespace(states=lambda: workers or {}), loop_lag=lag,
                           budget=TokenBudget(1000, 1000, lambda name: 100 * (len(names) if name is None else 1)))


def fake_experiment(name: str, **changes):
    """An experiment as the renderer reads it (grpo_server/api/prometheus.py lists the attributes)."""
    counters = ExperimentCounters(groups_sampled=5, groups_received=4, groups_trained=3, groups_dropped_stale=1,
                                  completions_sampled=10, completions_external=2, tokens_sampled=123)
    fields = dict(name=name, counters=counters, serving_version=2, step=3, queue=[object(), object()],
                  recent_rewards=deque([0.5, 1.0]), last_metrics={"kl": 0.01, "clipped_fraction": 0.2, "seconds": 1.5},
                  last_push_seconds=0.7, staleness=Counter({0: 2, 1: 1, 5: 3}), trackers=None)
    return SimpleNamespace(**{**fields, **changes})


def test_render_without_a_server():
    """Names, types, labels and values, as Prometheus reads them; families without samples are left out."""
    http = prometheus.HttpCounter()
    http.add("POST", "/v1/experiments/{name}/feedback", 202)
    http.add("POST", "/v1/experiments/{name}/feedback", 202)
    # A tracker's counts as its sink keeps them (grpo_server/trackers/base.py), without a backend behind them.
    mlflow = SimpleNamespace(counts=SimpleNamespace(written=7, dropped=2, errors=1, last_error="write: boom"))
    orchestrator = fake_front_end([fake_experiment('odd"name\\', trackers=TrackerSet(sinks={"mlflow": mlflow})),
                                   fake_experiment("bare", recent_rewards=deque(), last_metrics=None,
                                                   last_push_seconds=None, staleness=Counter())],
                                  pending={'odd"name\\': 3}, workers={"learner": "ready", "sampler-0": "starting"})
    text = prometheus.render(prometheus.registry(http, lambda: orchestrator)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    types = {name: f.type for name, f in families.items()}
    assert types == {
        "grpo_worker_up": "gauge", "grpo_http_requests": "counter", "grpo_policy_version": "gauge",
        "grpo_learner_step": "gauge", "grpo_groups": "counter", "grpo_episodes": "counter",
        "grpo_completions": "counter",
        "grpo_sampled_tokens": "counter", "grpo_queued_groups": "gauge", "grpo_pending_groups": "gauge",
        "grpo_reward_mean": "gauge", "grpo_kl": "gauge", "grpo_clipped_fraction": "gauge",
        "grpo_learner_step_seconds": "gauge", "grpo_push_seconds": "gauge", "grpo_trained_staleness": "histogram",
        "grpo_event_loop_lag_seconds": "gauge", "grpo_held_tokens": "gauge", "grpo_tracker_records": "counter"}
    assert "# TYPE grpo_groups_total counter" in text  # the exposition's names end in _total, as before
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    odd = (("experiment", 'odd"name\\'),)
    assert samples[("grpo_groups_total", odd + (("outcome", "dropped_stale"),))] == 1
    assert samples[("grpo_completions_total", odd + (("source", "external"),))] == 2
    bare = (("experiment", "bare"),)
    assert samples[("grpo_pending_groups", odd)] == 3 and samples[("grpo_pending_groups", bare)] == 0
    assert samples[("grpo_reward_mean", odd)] == 0.75 and ("grpo_reward_mean", bare) not in samples
    assert samples[("grpo_event_loop_lag_seconds", (("quantile", "1.0"),))] == 0.25
    assert samples[("grpo_event_loop_lag_seconds", (("quantile", "0.5"),))] == 0.003
    assert samples[("grpo_held_tokens", (("experiment", ""),))] == 200 and samples[("grpo_held_tokens", bare)] == 100
    assert samples[("grpo_trained_staleness_bucket", odd + (("le", "0"),))] == 2
    assert samples[("grpo_trained_staleness_bucket", odd + (("le", "4"),))] == 3
    assert samples[("grpo_trained_staleness_bucket", odd + (("le", "+Inf"),))] == 6
    assert samples[("grpo_trained_staleness_sum", odd)] == 16 and samples[("grpo_trained_staleness_count", odd)] == 6
    assert samples[("grpo_worker_up", (("state", "starting"), ("worker", "sampler-0")))] == 0
    route = (("method", "POST"), ("route", "/v1/experiments/{name}/feedback"), ("status", "202"))
    assert samples[("grpo_http_requests_total", route)] == 2
    tracked = odd + (("tracker", "mlflow"),)
    assert [samples[("grpo_tracker_records_total", tracked[:1] + (("outcome", outcome),) + tracked[1:])]
            for outcome in ("written", "dropped", "errors")] == [7, 2, 1]
    assert not any(name == "grpo_tracker_records_total" and dict(labels)["experiment"] == "bare"
                   for name, labels in samples)
    assert not any(name.endswith("_created") for name, _ in samples)


def test_each_app_has_its_own_registry():
    """Several apps in one process (as in the tests) count apart, and nothing goes to the global registry."""
    first, second = prometheus.HttpCounter(), prometheus.HttpCounter()
    first.add("GET", "/metrics", 200)
    empty = fake_front_end([])
    one = prometheus.render(prometheus.registry(first, lambda: empty)).decode()
    other = prometheus.render(prometheus.registry(second, lambda: empty)).decode()
    assert "grpo_http_requests_total" in one and "grpo_http_requests" not in other
    assert "grpo_" not in generate_latest(REGISTRY).decode()
    assert prometheus.CONTENT_TYPE.startswith("text/plain; version=0.0.4")
