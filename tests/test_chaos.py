"""The CI chaos soak (issue 60; scripts/benchmarks/chaos.py): a seeded soak of about two minutes on the tiny model,
a fault of every kind this machine allows while clients of every API family load the real server, then the
invariant checker: nothing acknowledged lost, nothing trained twice, no unexplained 5xx, versions only rising,
every experiment still training. The long soak (30 minutes) is a benchmark: `scripts/bench --only chaos`."""

from __future__ import annotations

import json

from scripts.benchmarks.chaos import TINY_DISK_MIB, soak
from scripts.benchmarks.chaos_faults import KINDS

SEED = 20261207


async def test_a_seeded_soak_of_every_fault_loses_nothing_and_trains_nothing_twice(tiny_model_dir, tmp_path):
    # Pauses just past a worker timeout of 12 s (the long soak's: 25 past 20), so that six kinds fit in two minutes.
    result = await soak(tiny_model_dir, SEED, minutes=2.5, gap_s=(3.0, 6.0), work_dir=tmp_path, worker_timeout_s=12,
                        pause_s=14, disk_mib=TINY_DISK_MIB)
    shown = json.dumps({k: result[k] for k in ("checks", "invariants", "faults", "requests")}, indent=1)[:6000]
    assert result["met"], shown
    expected = set(KINDS) - set(result["faults"]["not_injected"])  # what this machine allows (said in the result)
    assert set(result["faults"]["by_kind"]) == expected, shown  # one of every kind at least
    feedback = result["invariants"]["feedback"]
    assert feedback["acknowledged"] > 50 and feedback["trained"] > 50, shown  # the checker had work to check
    assert result["invariants"]["tinker_steps"]["models"] == 1, shown
    assert all(result["every_experiment_trains_after"].values()), shown
