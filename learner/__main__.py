"""`python -m learner --config PATH`: the learner process.

The config is validated before torch or DeepSpeed is imported, so a bad file fails in a second with a
message naming the key, not after a minute of imports. Then: the single-process distributed environment
DeepSpeed needs (without it, init_distributed falls into MPI discovery and dies on a missing mpi4py),
the model, and the HTTP server until SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from grpo_server.config import LearnerConfig, load_yaml, write_resolved

log = logging.getLogger("learner")


def _set_distributed_env() -> None:
    """One rank of one. setdefault: a launcher (torchrun, deepspeed) that set these wins."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # Port 0: the rendezvous store binds a port the OS picks. A port chosen here and bound later could
    # be taken meanwhile (another worker's, another server's) and fail the start with EADDRINUSE; with
    # one rank nobody else has to know the port.
    os.environ.setdefault("MASTER_PORT", "0")


async def _serve(app, host: str, port: int, on_stopped) -> None:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)  # the supervisor polls /health; verbs log themselves
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("learner listening on http://%s:%d", host, port)
    await stop.wait()
    log.info("stopping: finishing the request in progress, if any")
    await runner.cleanup()
    # After the last request: the lock-holding verbs are done, so the checkpoints are consistent.
    await asyncio.to_thread(on_stopped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner", description="The grpo_server learner.")
    parser.add_argument("--config", type=Path, required=True, help="LearnerConfig YAML")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = LearnerConfig.model_validate(load_yaml(args.config))
    except (OSError, ValueError, ValidationError) as exc:  # ValidationError is a ValueError; named for the reader
        print(f"learner: bad config {args.config}: {exc}", file=sys.stderr)
        return 2
    write_resolved(config, config.run_dir / "config" / "learner.resolved.yaml")

    os.environ["HF_HUB_OFFLINE"] = "1"
    _set_distributed_env()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)  # initialize() logs its whole config at INFO, per experiment

    from learner.app import create_app
    from learner.trainer import MultiAdapterTrainer

    trainer = MultiAdapterTrainer(config)
    asyncio.run(_serve(create_app(trainer), config.host, config.port, on_stopped=trainer.checkpoint_all))
    return 0


if __name__ == "__main__":
    sys.exit(main())
