"""One door per experiment (issues 46 and 57): no module outside its owner, the package grpo_server/runtime/experiment/,
writes an Experiment's fields. The other modules call its verbs (`complete`, `feedback`, `put_back`, `version_loaded`,
`forward_backward`, `optim_step`, ...), so admission, counters, pinning and pruning are the owner's alone. And the
API families never reach past the owner to the workers, training loops, metrics logs or trackers (read-only health
and /metrics aside): every call they make on an experiment's behalf is one of its verbs.

Read from the source: an assignment, augmented assignment, `del`, or a mutating call (`append`, `pop`, ...) whose
target is `<expr>.<field>` (or an item of it), where `<field>` is one of Experiment's dataclass fields and `<expr>`
names an experiment (`exp`, `experiment`, `....exp`, an `orchestrator.get(...)` or `experiments[...]`)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from grpo_server.runtime.experiment import Experiment

ROOT = Path(__file__).resolve().parent.parent
OWNER = ROOT / "grpo_server" / "runtime" / "experiment"
MUTATORS = {"append", "extend", "pop", "popleft", "clear", "update", "add", "discard", "remove", "setdefault",
            "appendleft", "insert", "sort", "__setitem__", "__delitem__"}
EXPERIMENT = re.compile(r"(^|\.)(exp|experiment)$|\.get\(.*\)$|experiments\[.*\]$|experiments\.values\(\)")


def writes(paths: list[Path], fields: set[str]) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func.value]
            else:
                continue
            for target in targets:
                # Down the chain: `exp.counters.groups_trained += 1` writes the field `counters` too.
                while isinstance(target, ast.Subscript | ast.Attribute):
                    if (isinstance(target, ast.Attribute) and target.attr in fields
                            and EXPERIMENT.search(ast.unparse(target.value))):
                        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
                        break
                    target = target.value
    return found


def test_no_module_outside_the_owner_writes_an_experiments_fields():
    fields = {f.name for f in dataclasses.fields(Experiment)}
    others = [p for p in sorted((ROOT / "grpo_server").rglob("*.py")) if not p.is_relative_to(OWNER)]
    assert writes(others, fields) == []


# What the API families may not reach: the owner's parts. Health (/v1/health: the workers' states) and /metrics
# (the trackers' counts, the workers' states) read them, and write nothing.
BEHIND_THE_OWNER = {"workers", "training_loops", "metrics_logs", "trackers", "training", "metrics_log", "learner"}
READ_ONLY_READERS = {("native/routes.py", "workers"), ("prometheus.py", "workers"), ("prometheus.py", "trackers")}


def reaches(paths: list[Path], root: Path) -> list[str]:
    found = []
    for path in paths:
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in BEHIND_THE_OWNER \
                    and (where, node.attr) not in READ_ONLY_READERS:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_api_families_call_the_owner_not_its_workers():
    api = ROOT / "grpo_server" / "api"
    assert reaches(sorted(api.rglob("*.py")), api) == []


def test_the_reach_check_sees_a_reach(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("async def f(orchestrator, exp):\n    await orchestrator.workers.learner.optim_step('x')\n"
                     "    orchestrator.training_loops['x'].push_now()\n    exp.metrics_log.records()\n"
                     "    exp.feedback(1)\n")
    assert len(reaches([probe], tmp_path)) == 4  # workers, learner, training_loops, metrics_log; not feedback


def test_the_check_sees_a_write(tmp_path):
    """The check itself: each shape of write it looks for is found, and a write to another object is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f(exp, orchestrator, series):\n    exp.step = 1\n    exp.inflight[2] += 1\n"
                     "    orchestrator.get('x').queue.append(3)\n    del exp.adapter_paths[1]\n"
                     "    series.step.append(4)\n    exp.counters.groups_trained += 1\n")
    assert len(writes([probe], {"step", "inflight", "queue", "adapter_paths", "counters"})) == 5
