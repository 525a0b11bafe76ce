"""`python -m sampler --config PATH`: one sampler replica.

The config is validated before torch / vLLM are imported, so a bad file fails in a second with a
message that names the key. SIGTERM / SIGINT stop the server and shut the engine down (aiohttp runs
the app's cleanup context). The `__main__` guard matters: vLLM spawns its engine processes, which
re-import this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from grpo_server.protocol.cpu_features import limit_kernels
from grpo_server.protocol.durable import restrict_umask
from grpo_server.protocol.listen import bind_early
from grpo_server.protocol.log_context import configure_logging
from grpo_server.protocol.process_exit import die_with_supervisor, exit_now
from grpo_server.protocol.worker_auth import MissingSecret, take_secret
from grpo_server.protocol.worker_config import SamplerConfig, load_yaml, write_resolved

log = logging.getLogger("sampler")
# At import, not in main(): vLLM's engine core is a child process that re-imports this module (spawn) or
# inherits it (fork), and must load the same kernel library as this one.
CPU = limit_kernels()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sampler", description="grpo_server sampler replica")
    parser.add_argument("--config", type=Path, required=True, help="SamplerConfig YAML")
    args = parser.parse_args(argv)
    die_with_supervisor()  # under the front end: ends with it (grpo_server/protocol/process_exit.py)
    restrict_umask()  # adapter copies and resolved configs 0640, folders 0750 (under the front end: inherited)
    configure_logging("sampler")  # the front end's format, inherited (GRPO_SERVER_LOG_FORMAT)
    try:
        config = SamplerConfig.model_validate(load_yaml(args.config))
    except (OSError, ValueError, ValidationError) as exc:
        print(f"sampler: invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        secret = take_secret()  # before vLLM spawns its engine core, which must not inherit it
    except MissingSecret as exc:
        print(f"sampler: {exc}", file=sys.stderr)
        return 2
    write_resolved(config, config.run_dir / "config" / f"sampler-{config.replica}.resolved.yaml")
    try:
        listening = bind_early(config.host, config.port)  # before vLLM's engine binds ports of its own
    except OSError as exc:
        print(f"sampler: cannot bind {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 2
    # vLLM's engine core is forked from here (sampler/vllm_start.py): it must not hold this port, or a sampler
    # killed alone would leave a listener that never answers.
    os.register_at_fork(after_in_child=listening.close)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here

    from aiohttp import web

    from sampler.app import create_app
    from sampler.engine_choice import create_engine

    engine = create_engine(config)
    log.info("sampler replica %d: %s engine on %s:%d; %s", config.replica, engine.name, config.host, config.port,
             CPU.describe())
    web.run_app(create_app(engine, secret), sock=listening, print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    exit_now(main())  # without the interpreter's teardown: grpo_server/protocol/process_exit.py says why
