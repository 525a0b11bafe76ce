"""The docs site's generated pages, built from the code so that they cannot drift from it.

An MkDocs hook (mkdocs.yml `hooks:`): `mkdocs build` / `mkdocs serve` add these pages to the site on every
build, and nothing generated is committed.

- reference/configuration.md: every field of the server config (grpo_server/config.py) and of an experiment's
  config (with grpo_server/protocol/worker_config.py): name, type, default, bounds, description;
- reference/http-api.md: every operation of the server's own OpenAPI document (grpo_server/api/openapi.py,
  from the route table `ENDPOINTS` of grpo_server/api/app.py; no worker is started), and the request bodies'
  fields;
- reference/cli.md: `grpo-server --help` and every subcommand's (grpo_server/cli.py);
- reference/losses.md: the learner's loss table (grpo_server/protocol/loss_table.py);
- reference/metrics.md: every family of `GET /metrics` (grpo_server/api/prometheus.py) and the fields of a train
  step's record (grpo_server/protocol/wire.py TrainMetrics);
- benchmarks/summary.md: the summary table of BENCHMARKS.md (written by scripts/bench, scripts/benchmarks/table.py);
- contributing.md and changelog.md: CONTRIBUTING.md and CHANGELOG.md, as they are.

`python -m scripts.docs_reference PAGE` prints one page (PAGE: configuration, http-api, losses, metrics, ...).
"""

from __future__ import annotations

import enum
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parent.parent


# --- configuration ---------------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a) if not isinstance(a, str) else a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple, set):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        if issubclass(annotation, SecretStr):
            return "secret string"
        if issubclass(annotation, BaseModel):
            return "section"
        if issubclass(annotation, enum.Enum):
            return " \\| ".join(f"`{m.value}`" for m in annotation)
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                "PosixPath": "path", "Path": "path"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int) and abs(value) >= 2**20:
        for base in (2, 10):
            exponent = round(__import__("math").log(abs(value), base))
            if base**exponent == abs(value):
                return f"{'-' if value < 0 else ''}{base}^{exponent}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounds(info: FieldInfo) -> str:
    low = high = ""
    lengths = []
    for item in info.metadata:
        if isinstance(item, annotated_types.Ge):
            low = f"[{_number(item.ge)}"
        elif isinstance(item, annotated_types.Gt):
            low = f"({_number(item.gt)}"
        elif isinstance(item, annotated_types.Le):
            high = f"{_number(item.le)}]"
        elif isinstance(item, annotated_types.Lt):
            high = f"{_number(item.lt)})"
        elif isinstance(item, annotated_types.MinLen):
            lengths.append(f"at least {item.min_length} long")
        elif isinstance(item, annotated_types.MaxLen):
            lengths.append(f"at most {item.max_length} long")
        elif isinstance(item, annotated_types.MultipleOf):
            lengths.append(f"a multiple of {_number(item.multiple_of)}")
        elif hasattr(item, "pattern") and item.pattern:
            lengths.append(f"matches `{item.pattern}`")
    text = ""
    if low or high:
        text = f"{low or '(-inf'}, {high or 'inf)'}"
    return "; ".join([t for t in [text, *lengths] if t])


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Path):
        return f"`{value}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (int, float)):
        return f"`{_number(value)}`"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{json.dumps(value)}`"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _section_model(info: FieldInfo) -> type[BaseModel] | None:
    annotation = info.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def config_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo, type[BaseModel]]]:
    """Every leaf field of `model`, nested sections flattened as `section.field`, in declaration order."""
    rows: list[tuple[str, FieldInfo, type[BaseModel]]] = []
    for name, info in model.model_fields.items():
        section = _section_model(info)
        if section is not None:
            rows.extend(config_fields(section, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", info, model))
    return rows


def _field_table(model: type[BaseModel], env_prefix: str | None, prefix: str = "") -> list[str]:
    lines = ["| field | type | default | range | description |", "|---|---|---|---|---|"]
    for dotted, info, _ in config_fields(model, prefix):
        description = _cell(info.description)
        if env_prefix is not None:
            env = env_prefix + dotted.upper().replace(".", "__")
            description = f"{description} Environment: `{env}`." if description else f"Environment: `{env}`."
        lines.append(f"| `{dotted}` | {_type_name(info.annotation)} | {_default(info)} | {_bounds(info)} | "
                     f"{description} |")
    return lines


def configuration_md() -> str:
    from grpo_server.config import ExperimentConfig, ServerConfig

    lines = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models (`grpo_server/config.py`, `grpo_server/protocol/worker_config.py`) "
        "on every docs build: the bounds and defaults below are the ones the server enforces. Ranges: `[` `]` "
        "inclusive, `(` `)` exclusive; every float must also be finite. A value outside its range, or an unknown "
        "key, is an error naming the field (`grpo-server serve` refuses the config; `POST /v1/experiments` answers "
        "422). [Configuration](../guides/configuration.md) says where values come from.",
        "",
        "## Server config",
        "",
        "`grpo-server serve --config FILE.yaml` (e.g. `configs/server.yaml`). Each field can also come from the "
        "environment variable named in its row (a whole section as JSON in `GRPO_SERVER_<SECTION>`).",
        "",
    ]
    server_top = [(n, i) for n, i in ServerConfig.model_fields.items() if _section_model(i) is None]
    sections = [(n, i) for n, i in ServerConfig.model_fields.items() if _section_model(i) is not None]

    lines += ["| field | type | default | range | description |", "|---|---|---|---|---|"]
    for name, info in server_top:
        lines.append(f"| `{name}` | {_type_name(info.annotation)} | {_default(info)} | {_bounds(info)} | "
                     f"{_cell(info.description)} Environment: `GRPO_SERVER_{name.upper()}`. |")
    for name, info in sections:
        section = _section_model(info)
        assert section is not None
        lines += ["", f"### `{name}`", "", _cell(section.__doc__ or "").strip(), ""]
        lines += _field_table(section, env_prefix="GRPO_SERVER_", prefix=f"{name}.")
    lines += [
        "",
        "## Experiment config",
        "",
        "The body of `POST /v1/experiments`, a file under `configs/`, or an item of the server config's "
        "`experiments`. Only `name` is required; `{\"name\": \"x\"}` is a whole experiment.",
        "",
    ]
    lines += _field_table(ExperimentConfig, env_prefix=None)
    return "\n".join(lines) + "\n"


# --- HTTP API ----------------------------------------------------------------------------------------


def _schema_name(schema: dict[str, Any] | None) -> str:
    if not schema:
        return ""
    ref = schema.get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else ""


def _anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _json_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = _schema_name(schema)
        return f"[{name}](#{_anchor(name)})"
    if "anyOf" in schema:
        return " or ".join(_json_type(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_json_type(schema.get('items', {}))}"
    return kind


def _schema_bounds(schema: dict[str, Any]) -> str:
    parts = []
    for key, text in (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"),
                      ("exclusiveMaximum", "< {}"), ("minLength", "length >= {}"), ("maxLength", "length <= {}"),
                      ("minItems", "items >= {}"), ("maxItems", "items <= {}")):
        if key in schema:
            parts.append(text.format(_number(schema[key])))
    for option in schema.get("anyOf", []):
        bounds = _schema_bounds(option)
        if bounds:
            parts.append(bounds)
    return ", ".join(parts)


def http_api_md() -> str:
    from grpo_server.api.app import ENDPOINTS
    from grpo_server.api.openapi import openapi_document

    document = openapi_document(ENDPOINTS)
    schemas = document["components"]["schemas"]
    lines = [
        "# HTTP API reference",
        "",
        "Generated from the server's own OpenAPI document (`GET /openapi.json`, built by "
        "`grpo_server/api/openapi.py` from the route table) on every docs build. Auth: `public` needs no key, "
        "`key` any valid key, `experiment` the admin key or that experiment's own, `admin` the admin key "
        "(`Authorization: Bearer <key>`). Bodies are JSON, or msgpack with `Content-Type: application/msgpack`; "
        "errors are `{\"error\": {\"code\", \"message\"}}`.",
        "",
        "| method | path | auth | what | request | answer | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    requested: list[str] = []
    answered: list[str] = []
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            request = ""
            body = op.get("requestBody", {}).get("content", {})
            if "application/json" in body:
                name = _schema_name(body["application/json"]["schema"])
                request = f"[{name}](#{_anchor(name)})"
                requested.append(name)
            elif body:  # a body of its own codec (forward_backward's protobuf)
                request = f"`{next(iter(body))}`"
            statuses = sorted(op["responses"], key=int)
            ok = [s for s in statuses if int(s) < 400]
            answer = ""
            for status in ok:
                content = op["responses"][status].get("content", {})
                if "application/json" in content:
                    name = _schema_name(content["application/json"]["schema"])
                    answer = f"{status} [{name}](#{_anchor(name)})" if name else f"{status} JSON"
                    answered += [name] if name else []
                elif content:
                    answer = f"{status} `{next(iter(content))}`"
                else:
                    answer = status
                if "text/event-stream" in content:
                    answer += ", or events with `stream: true`"
            errors = ", ".join(s for s in statuses if int(s) >= 400)
            lines.append(f"| {method.upper()} | `{path}` | {op['x-auth']} | {_cell(op.get('summary'))} | {request} "
                         f"| {answer} | {errors} |")
    lines += ["", "## Schemas", "",
              "Every field of each request body, as the server validates it, and of each answer, then the schemas "
              "they hold.", ""]
    seen: set[str] = set()
    queue = list(dict.fromkeys(requested + answered))
    while queue:
        name = queue.pop(0)
        if name in seen or name not in schemas:
            continue
        seen.add(name)
        schema = schemas[name]
        lines += [f"### {name} {{#{_anchor(name)}}}", ""]
        if schema.get("description"):
            lines += [_cell(schema["description"]), ""]
        properties = schema.get("properties", {})
        if not properties:
            lines += [f"Type: {_json_type(schema)}.", ""]
            continue
        required = set(schema.get("required", []))
        lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
        for field_name, prop in properties.items():
            default = "required" if field_name in required else (
                f"`{json.dumps(prop['default'])}`" if "default" in prop else "")
            lines.append(f"| `{field_name}` | {_json_type(prop)} | {default} | {_schema_bounds(prop)} | "
                         f"{_cell(prop.get('description'))} |")
            for ref in re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(prop)):
                if ref not in seen:
                    queue.append(ref)
        lines.append("")
    return "\n".join(lines) + "\n"


# --- losses ------------------------------------------------------------------------------------------


def losses_md() -> str:
    from grpo_server.protocol.loss_table import LOSSES, markdown_table

    lines = [
        "# Loss reference",
        "",
        "Generated from the learner's loss table (`grpo_server/protocol/loss_table.py`) on every docs build. The "
        "`grpo` family is what an experiment's `algorithm.loss` takes; every loss is a Tinker `forward_backward` "
        "`loss_fn` too. [Losses and their defaults](../training/losses.md) explains them.",
        "",
        markdown_table(),
        "",
        "## Config keys and their bounds",
        "",
        "A Tinker call's `loss_fn_config` (inclusive bounds; a value outside is a 400 naming the key).",
        "",
        "| loss | key | default | range |",
        "|---|---|---|---|",
    ]
    for name, spec in LOSSES.items():
        for key, config in spec.config.items():
            lines.append(f"| `{name}` | `{key}` | {_number(config.default)} | [{_number(config.low)}, "
                         f"{_number(config.high)}]{' (integer)' if config.integer else ''} |")
    return "\n".join(lines) + "\n"


# --- metrics -----------------------------------------------------------------------------------------


class _Budget:
    def in_use(self, name: str | None) -> int:
        return 0


class _LoopLag:
    def quantile(self, q: float) -> float:
        return 0.0

    def recent_max(self) -> float:
        return 0.0


class _Orchestrator:  # what prometheus.server_families reads
    experiments: dict = {}
    budget = _Budget()
    loop_lag = _LoopLag()


def metric_families() -> list[tuple[str, str, list[str], str]]:
    """(exposed name, type, labels, help) of every family `GET /metrics` can show."""
    from grpo_server.api import prometheus

    families = prometheus.families_of([], {}, {}, prometheus.HttpCounter(), {})
    families += prometheus.server_families(_Orchestrator())  # type: ignore[arg-type]
    rows = []
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = list(getattr(family, "_labelnames", ()))
        rows.append((name, family.type, labels, family.documentation))
    return rows


def metrics_md() -> str:
    from grpo_server.protocol.wire import TrainMetrics

    lines = [
        "# Metrics reference",
        "",
        "Generated on every docs build from the Prometheus collector (`grpo_server/api/prometheus.py`) and the "
        "learner's step record (`grpo_server/protocol/wire.py` `TrainMetrics`). [Observe a run]"
        "(../guides/observe.md) says where each appears.",
        "",
        "## `GET /metrics` (Prometheus, admin key)",
        "",
        "| metric | type | labels | what |",
        "|---|---|---|---|",
    ]
    for name, kind, labels, help_text in metric_families():
        lines.append(f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels)} | {_cell(help_text)} |")
    lines += [
        "",
        "## A train step's fields",
        "",
        "Each `train` record of the metrics log (`RUN_DIR/metrics/<name>.jsonl`, `GET /v1/experiments/{name}/metrics`), "
        "the status's `last_metrics` and the trackers (as `train/<field>`) carry these, with `time`, `kind`, "
        "`policy_version` and `groups` added by the front end (the learner's `seconds` is the log's `step_seconds`).",
        "",
        "| field | type |",
        "|---|---|",
    ]
    for name, info in TrainMetrics.model_fields.items():
        lines.append(f"| `{name}` | {_type_name(info.annotation)} |")
    return "\n".join(lines) + "\n"


# --- pages copied from the repository root -----------------------------------------------------------


def _relinked(text: str) -> str:
    """A root file's links into docs/ made relative to the site's root."""
    return re.sub(r"\]\(docs/", "](", text)


def cli_md() -> str:
    """`grpo-server --help` and every subcommand's, as argparse prints them (grpo_server/cli.py build_parser)."""
    import argparse
    import os
    from unittest import mock

    from grpo_server.cli import build_parser

    def commands(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(path, parser)]
        for action in parser._actions:  # argparse keeps its subcommands only there
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += commands(sub, f"{path} {name}")
        return found

    lines = ["# Command line", "", "Generated from `grpo_server/cli.py` (`build_parser`): each command's `--help`, as "
             "it prints it.", ""]
    with mock.patch.dict(os.environ, {"COLUMNS": "110"}):  # argparse wraps at the terminal's width
        for path, parser in commands(build_parser(), "grpo-server"):
            lines += [f"## `{path}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def contributing_md() -> str:
    return _relinked((REPO / "CONTRIBUTING.md").read_text())


def changelog_md() -> str:
    return _relinked((REPO / "CHANGELOG.md").read_text())


# The extra figures' blocks (scripts/benchmarks/table.py).
EXTRA_TITLES = {"rollouts": "Agent rollouts against `vllm serve`", "hostile": "The hostile tenant",
                "fairness": "Fairness between experiments", "tenants": "Many tenants on one server",
                "chaos": "The chaos soak"}


def benchmarks_summary_md() -> str:
    from scripts.benchmarks.table import EXTRA, markers

    text = (REPO / "BENCHMARKS.md").read_text()

    def block(name: str | None) -> str:
        start, end = markers(name)
        return text.split(start, 1)[1].split(end, 1)[0].strip() if start in text and end in text else ""

    extra = "".join(f"\n## {EXTRA_TITLES[name]}\n\n{block(name)}\n" for name in EXTRA if block(name))
    return ("# Benchmark summary\n\nThe tables `scripts/bench` writes into `BENCHMARKS.md`, as they are there "
            "(generated from the benchmark's JSON results by `scripts/benchmarks/table.py`). "
            "[Benchmarks](index.md) says how to read them and how to run each figure.\n\n"
            + (block(None) or "(no summary table yet)") + "\n" + extra)


PAGES: dict[str, Callable[[], str]] = {
    "reference/configuration.md": configuration_md,
    "reference/http-api.md": http_api_md,
    "reference/losses.md": losses_md,
    "reference/metrics.md": metrics_md,
    "reference/cli.md": cli_md,
    "benchmarks/summary.md": benchmarks_summary_md,
    "contributing.md": contributing_md,
    "changelog.md": changelog_md,
}


# --- the MkDocs hook ---------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Add every generated page to the build (never to docs/ on disk)."""
    from mkdocs.structure.files import File

    if str(REPO) not in sys.path:  # mkdocs loads this file by path; the pages import the project's packages
        sys.path.insert(0, str(REPO))
    for path, render in PAGES.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=render()))
    return files


def write_pages(docs_dir: Path) -> list[Path]:
    """Every generated page into `docs_dir`, for a site generator without MkDocs' hooks."""
    written = []
    for path, render in PAGES.items():
        target = docs_dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render())
        written.append(target)
    return written


def main(argv: list[str]) -> int:
    names = {Path(path).stem: render for path, render in PAGES.items()}
    if len(argv) == 2 and argv[0] == "--write":
        for path in write_pages(Path(argv[1])):
            print(path)
        return 0
    if len(argv) != 1 or argv[0] not in names:
        print(f"usage: python -m scripts.docs_reference {{{','.join(names)}}} | --write DOCS_DIR", file=sys.stderr)
        return 2
    sys.stdout.write(names[argv[0]]())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
