"""scripts/benchmarks/fleet.py's bookkeeping: the fleet's time per arrangement and the comparison on the same seeds.
No timing here: the race itself is the benchmark's."""

from __future__ import annotations

import json

from scripts.benchmarks import fleet


def _exp(seed: int, seconds: float | None) -> dict:
    return {"seed": seed, "reached": seconds is not None, "reached_s": seconds}


def test_seeds_and_fleet_seconds():
    assert fleet.parse_seeds("0-3") == [0, 1, 2, 3] and fleet.parse_seeds("0,2,5") == [0, 2, 5]
    rows = [_exp(0, 100.0), _exp(1, 250.0)]
    assert fleet.fleet_seconds({"arrangement": "at_once", "experiments": rows}) == 250.0  # the last one's target
    assert fleet.fleet_seconds({"arrangement": "one_by_one", "experiments": rows}) == 350.0  # the sum of clocks
    assert fleet.fleet_seconds({"arrangement": "at_once", "experiments": rows + [_exp(2, None)]}) is None


def test_summarize_compares_on_the_same_seeds(tmp_path):
    def write(name: str, arrangement: str, rows: list[dict], bf16: bool = False) -> None:
        (tmp_path / name).write_text(json.dumps({"arrangement": arrangement, "seeds": [r["seed"] for r in rows],
                                                 "experiments": rows, "load_start": 1.0, "load_end": 2.0,
                                                 "bf16": bf16}))

    write("a.json", "at_once", [_exp(s, 100.0 + s) for s in range(4)])  # 103
    write("b.json", "at_once", [_exp(s, 200.0) for s in range(4, 8)])  # 200
    write("c.json", "at_once", [_exp(s, 300.0) for s in range(8)])  # 300
    write("d.json", "one_by_one", [_exp(s, 60.0) for s in range(4)])
    write("e.json", "one_by_one", [_exp(s, 100.0) for s in range(4, 8)])
    write("f.json", "trl_one_by_one", [_exp(s, 50.0) for s in range(4)])
    write("g.json", "trl_one_by_one", [_exp(s, 40.0) for s in range(4)], bf16=True)  # a side of its own
    table = fleet.summarize(sorted(tmp_path.glob("*.json")))
    k4, k8 = table["k=4"], table["k=8"]
    assert [r["one_by_one"] for r in k4["runs"]] == [240.0, 400.0]
    assert k4["medians_s"] == {"at_once": 151.5, "one_by_one": 320.0, "trl_one_by_one": 200.0,
                               "trl_one_by_one_bf16": 160.0}
    assert k4["speedup_of_at_once"]["one_by_one"] == {"ratio": round(320.0 / 151.5, 3), "runs": 2}
    # TRL has seeds 0-3 only: its ratio is taken on that run alone, against at once on the same seeds
    assert k4["speedup_of_at_once"]["trl_one_by_one"] == {"ratio": round(200.0 / 103.0, 3), "runs": 1}
    assert k8["runs"][0]["one_by_one"] == 640.0
    assert k8["speedup_of_at_once"]["one_by_one"] == {"ratio": round(640 / 300, 3), "runs": 1}
