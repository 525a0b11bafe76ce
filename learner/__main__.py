"""`python -m learner --config PATH`: the learner job (rank 0, and through it ranks 1..N-1).

The config is validated before torch or DeepSpeed is imported, so a bad file fails in a second with a
message naming the key, not after a minute of imports. Then the distributed environment DeepSpeed needs
(learner/ranks.py: rank 0 hosts the rendezvous and starts the other ranks as
`python -m learner --config PATH --rank R --parent-pid P`; or, under torchrun / the deepspeed launcher,
every rank takes RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the launcher), the model, and
learner/job.py: rank 0 serves HTTP until SIGTERM / SIGINT, the others follow it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from grpo_server.protocol.durable import restrict_umask
from grpo_server.protocol.listen import bind_early
from grpo_server.protocol.log_context import configure_logging
from grpo_server.protocol.process_exit import die_with_parent, die_with_supervisor, exit_now
from grpo_server.protocol.worker_auth import MissingSecret, take_secret
from grpo_server.protocol.worker_config import LearnerConfig, load_yaml, write_resolved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner", description="The grpo_server learner.")
    parser.add_argument("--config", type=Path, required=True, help="LearnerConfig YAML")
    # Set by rank 0 when it starts the other ranks; not for people.
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    die_with_supervisor()  # rank 0 under the front end (grpo_server/protocol/process_exit.py)
    restrict_umask()  # checkpoints and adapter versions 0640, their folders 0750 (under the front end: inherited)
    from learner.ranks import ignore_stop_signals, launcher_env

    # Started by torchrun / the deepspeed launcher (several hosts): the rank is theirs, not our --rank.
    launched = launcher_env(dict(os.environ)) if args.parent_pid is None else None
    rank = launched.rank if launched is not None else args.rank
    follower = rank > 0
    if follower:
        if launched is None:
            # first: no window in which rank 0 could die unnoticed
            die_with_parent(args.parent_pid, signal.SIGKILL, "rank 0")
        ignore_stop_signals()
    configure_logging(f"learner-rank{rank}")  # the front end's format, inherited (GRPO_SERVER_LOG_FORMAT)
    try:
        config = LearnerConfig.model_validate(load_yaml(args.config))
    except (OSError, ValueError, ValidationError) as exc:  # ValidationError is a ValueError; named for the reader
        print(f"learner: bad config {args.config}: {exc}", file=sys.stderr)
        return 2
    if launched is not None and config.ranks != launched.world_size:
        logging.getLogger("learner").info("learner.ranks %d: the launcher's WORLD_SIZE %d rules", config.ranks,
                                          launched.world_size)
        config = config.model_copy(update={"ranks": launched.world_size})
    followers, secret, listening = None, None, None
    if not follower:  # rank 0 alone serves the verbs
        try:
            secret = take_secret()  # before it starts the other ranks, which must not inherit it
        except MissingSecret as exc:
            print(f"learner: {exc}", file=sys.stderr)
            return 2
        write_resolved(config, config.run_dir / "config" / "learner.resolved.yaml")
        try:
            listening = bind_early(config.host, config.port)  # before torch's store binds ports of its own
        except OSError as exc:
            print(f"learner: cannot bind {config.host}:{config.port}: {exc}", file=sys.stderr)
            return 2
        if config.ranks > 1 and launched is None:
            from learner.ranks import Followers

            # Before our own heavy imports, so that theirs overlap them.
            followers = Followers.spawn(args.config.resolve(), config.ranks)

    os.environ["HF_HUB_OFFLINE"] = "1"
    from grpo_server.protocol.cpu_features import limit_kernels

    features = limit_kernels()  # before torch's first matmul
    if not follower:
        logging.getLogger("learner").info("%s", features.describe())
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)  # initialize() logs its whole config at INFO, per experiment

    from learner.job import run_follower, run_rank0

    if follower:
        return run_follower(config, rank, launched)
    return run_rank0(config, secret, listening, followers, launched)


if __name__ == "__main__":
    exit_now(main())  # not a normal interpreter exit: grpo_server/protocol/process_exit.py says why
