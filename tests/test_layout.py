"""The architecture as the code must keep it (README, "Map").

- Three processes, one package each: the front end (`grpo_server`), `sampler` and `learner`. The client and
  the front end import no ML package at import time; the workers never import each other and take only
  `grpo_server.protocol` from the front end's side.
- Inside the front end, each room imports only the rooms below it: `protocol` <- `workers` <- `runtime` <-
  `api`, with the top-level leaf modules (`config`, `api_models`) open to all of them.
- No import circles between modules, and no module over 600 lines: past that a file almost always holds two
  concerns. Split a file where its meaning splits, well before that; never squeeze code to fit the number.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("grpo_server", "sampler", "learner")
CODE_DIRS = (*PACKAGES, "scripts", "examples")
MAX_LINES = 600

# What each part may import from this repository (by dotted prefix). Top-level grpo_server modules not
# named here (client, cli, plot) may import anything of the front end's.
ALLOWED = {
    "grpo_server.protocol": ("grpo_server.protocol",),
    "grpo_server.config": ("grpo_server.config", "grpo_server.protocol"),
    "grpo_server.api_models": ("grpo_server.api_models", "grpo_server.config", "grpo_server.protocol"),
    "grpo_server.workers": ("grpo_server.workers", "grpo_server.protocol", "grpo_server.config",
                            "grpo_server.api_models"),
    # Experiment trackers: fed records by the runtime, they know nothing of it (their settings: config).
    "grpo_server.trackers": ("grpo_server.trackers", "grpo_server.config"),
    "grpo_server.runtime": ("grpo_server.runtime", "grpo_server.workers", "grpo_server.protocol",
                            "grpo_server.config", "grpo_server.api_models", "grpo_server.trackers"),
    "grpo_server.api": ("grpo_server.api", "grpo_server.runtime", "grpo_server.workers", "grpo_server.protocol",
                        "grpo_server.config", "grpo_server.api_models", "grpo_server.trackers"),
    # The operators' MCP server is a client of a running server's HTTP API, never a part of its runtime.
    "grpo_server.mcp": ("grpo_server.mcp", "grpo_server.client", "grpo_server.api_models", "grpo_server.config"),
    "sampler": ("sampler", "grpo_server.protocol"),
    "learner": ("learner", "grpo_server.protocol"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def local_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def runtime_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Repository modules `path` imports, at any depth of its code but outside `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from a.b import c`: c is a module, or a name in a.b
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] in PACKAGES:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = local_modules()
    return {name: runtime_imports(path, modules) - {name} for name, path in modules.items()}


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", ["grpo_server.client", "grpo_server.cli", "grpo_server.api.app",
                                    "grpo_server.mcp.server"])
def test_client_and_front_end_import_no_ml_package(module):
    assert not imported_after(module) & {"torch", "vllm", "deepspeed", "transformers", "peft", "sampler", "learner"}


def test_protocol_imports_no_ml_package():
    assert not imported_after("grpo_server.protocol.verbs") & {"torch", "vllm", "deepspeed", "transformers", "peft"}


def test_workers_do_not_import_each_other():
    assert "learner" not in imported_after("sampler.app")
    assert "sampler" not in imported_after("learner.app")


def test_each_part_imports_only_what_it_may():
    wrong = []
    for module, imports in import_graph().items():
        rule = max((part for part in ALLOWED if module == part or module.startswith(part + ".")), key=len,
                   default=None)
        if rule is None:
            continue
        wrong += [f"{module} -> {target}" for target in sorted(imports)
                  if not any(target == ok or target.startswith(ok + ".") for ok in ALLOWED[rule])]
    assert wrong == []


def test_no_import_circles():
    graph = import_graph()
    circles, done, path = [], set(), []

    def visit(module: str) -> None:
        if module in path:
            circles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        path.append(module)
        for target in sorted(graph.get(module, ())):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert circles == []


def test_no_module_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
