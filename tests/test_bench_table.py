"""scripts/bench: the module imports, and its table writer replaces only the marked block of BENCHMARKS.md.
No timing here: the figures belong to the benchmark."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))  # bench.py imports its sibling modules by name
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _results(**figures) -> dict:
    meta = {"mode": "quick", "date": "2026-01-01 00:00 UTC", "host": "box", "command": "scripts/bench --quick",
            "runtime_s": 300.0, "cpus": 2, "mem_gib": 24.0, "model": "smollm2-135m-instruct", "versions": "torch x",
            "load_note": "front_end 1.0 / 2.0", "others": "", "out": "runs/bench.json"}
    return {"meta": meta, "figures": figures}


def test_bench_imports_and_modes():
    bench = _load("bench")
    assert bench.QUICK.name == "quick" and bench.FULL.name == "full"
    assert 8 in bench.FULL.levels and 8 not in bench.QUICK.levels
    assert set(bench.FIGURES) == {"front_end", "adapter", "push", "learner", "experiments", "memory"}


def test_table_replaces_only_the_marked_block():
    table = _load("bench_table")
    doc = "# Benchmarks\n\nMachine: a box.\nMore of it.\n\n## Old section\n\nkept\n"
    first = table.replace_block(doc, table.render(_results(front_end={"error": "boom"})))
    assert first.startswith("# Benchmarks\n\nMachine: a box.\nMore of it.\n\n" + table.START)
    assert first.count(table.START) == 1 and "## Old section\n\nkept\n" in first
    assert "failed: boom" in first and "| adapter sampling |" in first

    fe = {"requests": 4, "n": 4, "max_tokens": 16, "concurrency": 4, "rounds": 2, "server_tok_s": 10.0,
          "direct_tok_s": 11.0, "ratio": 0.909, "round_ratios": [0.9, 0.92]}
    second = table.replace_block(first, table.render(_results(front_end=fe)))
    assert second.count(table.START) == 1 and second.count(table.END) == 1
    assert "failed: boom" not in second and "**0.909**" in second and "missed" in second
    assert second.split(table.START)[0] == first.split(table.START)[0]
    assert second.split(table.END)[1] == first.split(table.END)[1]
