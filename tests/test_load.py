"""A bounded load test against the session's real server: 50 concurrent clients for 10 s, each looping
completions then feedback (scripts/benchmarks/load.py's `run_load`); and the mixed round, 20 clients for 10 s
split into plain, streaming, episode and tool-call clients (scripts/benchmarks/load_mixed.py's `run_mixed`).
Correctness under concurrency only: no answer other than 2xx or 429 (no 5xx, no stream failed after its
headers), none past its timeout, every kind answered, the server healthy afterwards. Timing figures belong
to the benchmark (BENCHMARKS.md), not here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchmarks" / "load.py"
CLIENTS = 50
MIXED_CLIENTS = 20
MIXED_DURATION_S = 10.0
DURATION_S = 10.0
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def bench_load():
    spec = importlib.util.spec_from_file_location("bench_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def load_experiment(client, bench_load):
    name = "load-test"
    await client.create_experiment(bench_load.experiment_config(name, n=2, max_tokens=2, batch_groups=4))
    yield name
    await client.delete_experiment(name)


@pytest.mark.timeout(180)
async def test_concurrent_clients_get_only_2xx_or_429(server, client, bench_load, load_experiment):
    # Warm-up (not counted): the sampler's first request under an adapter is slow.
    await client.complete(load_experiment, prompt="Warm up", n=2, max_tokens=2)

    result = await bench_load.run_load(server.url, server.api_key, load_experiment, clients=CLIENTS,
                                       duration_s=DURATION_S, n=2, max_tokens=2, timeout_s=TIMEOUT_S,
                                       abandon=0.1, pid=server.process.pid)
    summary = result.summary()
    print({k: (v["by_class"], v["max_latency_s"]) for k, v in summary.items() if k in ("completions", "feedback")})
    completions, feedback = summary["completions"], summary["feedback"]
    assert result.errors == 0, summary
    assert completions["timeouts"] == feedback["timeouts"] == 0, summary
    assert completions["max_latency_s"] < TIMEOUT_S and feedback["max_latency_s"] < TIMEOUT_S, summary
    assert set(completions["by_status"]) <= {"200", "429"}, summary
    assert set(feedback["by_status"]) <= {"202"}, summary  # feedback is never throttled
    assert result.completions.ok > 0 and result.feedback.ok > 0, summary

    status = await client.status(load_experiment)
    assert status.state == "active" and not status.errors, status  # no failed step, push or verification
    assert status.counters.groups_received == result.feedback.ok, status
    assert (await client.health()).status == "ok"


@pytest.mark.timeout(180)
async def test_mixed_round_streams_episodes_and_tool_calls_get_no_5xx(server, client):
    from scripts.benchmarks import load_mixed

    name = "load-mixed-test"
    # batch_groups 8: 16 groups may be in the pipeline (max_queued_batches 2), so every kind gets turns in 10 s
    await client.create_experiment(load_mixed.experiment_config(name, n=2, max_tokens=2, batch_groups=8))
    try:
        await client.complete(name, prompt="Warm up", n=2, max_tokens=2)
        result = await load_mixed.run_mixed(server.url, server.api_key, name, clients=MIXED_CLIENTS,
                                            duration_s=MIXED_DURATION_S, n=2, max_tokens=2, timeout_s=TIMEOUT_S,
                                            pid=server.process.pid)
        summary = result.summary()
        print({kind: {e: s["by_class"] for e, s in endpoints.items()} for kind, endpoints in summary["kinds"].items()},
              summary["tool_calls"], summary["loop_lag"])
        assert summary["server_errors"] == 0 and summary["errors"] == 0, summary
        assert summary["clients_by_kind"] == {"plain": 8, "stream": 4, "episode": 4, "tools": 4}, summary
        for kind, endpoints in summary["kinds"].items():
            first = next(iter(endpoints.values()))  # completions, stream, turn, call
            assert first["by_class"]["2xx"] > 0, (kind, summary)
            assert set(first["by_status"]) <= {"200", "429"}, (kind, summary)
        # Feedback of each kind needs its whole unit first (a pair of 3-turn episodes): not every kind within 10 s.
        assert summary["kinds"]["plain"]["feedback"]["by_class"]["2xx"] > 0, summary
        assert summary["stream_first_chunk_s"] and summary["loop_lag"]["samples"] > 0, summary
        status = await client.status(name)
        assert status.state == "active" and not status.errors, status
        assert (await client.health()).status == "ok"
    finally:
        await client.delete_experiment(name)
