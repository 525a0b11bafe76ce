"""The learner job's two lives: rank 0 (HTTP verbs for the front end, driving the other ranks) and a
follower (rank 1..N-1, running rank 0's commands). One rank is rank 0 alone, as the learner always was.

How the job ends: SIGTERM / SIGINT on rank 0 stops it cleanly (last requests answered, every experiment
checkpointed, followers told to stop, exit 0). A broken job (a rank died, or a verb failed so that the
ranks may be out of step) answers the request in flight with the cause, then exits 1 without a shutdown
checkpoint, and the supervisor restarts it from its last checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from typing import Any, Callable

from grpo_server.protocol.process_exit import exit_now
from grpo_server.protocol.worker_config import LearnerConfig
from learner.lockstep import CommandChannel, LockstepTrainer, follow
from learner.ranks import (Followers, LaunchedFollowers, RankEnv, host_store, init_process_group, join_store,
                           launcher_store, read_master_port)

log = logging.getLogger("learner")

# A broken job first lets the request in flight carry the cause back; past this it exits regardless (a
# request thread can be stuck in a collective with a dead rank for good).
BROKEN_EXIT_GRACE_S = 30.0
FOLLOWER_STOP_S = 30.0
# Rank 0 waits this much longer than the collective timeout for a follower's outcome, so that a follower
# stuck in a collective times out there and reports why, before rank 0 gives up on it.
OUTCOME_MARGIN_S = 30.0


class Lifetime:
    """When rank 0 stops serving, and whether the job broke."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        self._loop, self._stop = loop, stop

    def break_job(self, reason: str) -> None:
        """From any thread: the job cannot go on."""
        if self.broken is not None:
            return
        self.broken = reason
        if self._loop is None:  # still starting: no request to answer
            log.error("the learner job broke while starting: %s", reason)
            exit_now(1)
        log.error("the learner job broke: %s; exiting so that it restarts", reason)
        backstop = threading.Timer(BROKEN_EXIT_GRACE_S, exit_now, (1,))
        backstop.daemon = True
        backstop.start()
        self._loop.call_soon_threadsafe(self._stop.set)


async def _serve(app: Any, config: LearnerConfig, listening: socket.socket, lifetime: Lifetime,
                 on_stopped: Callable[[], None], on_broken: Callable[[], None] | None) -> None:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)  # the supervisor polls /health; verbs log themselves
    await runner.setup()
    await web.SockSite(runner, listening).start()  # bound in learner/__main__.py, before torch
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    lifetime.attach(loop, stop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("learner listening on http://%s:%d (%d rank%s)", config.host, config.port, config.ranks,
             "" if config.ranks == 1 else "s")
    await stop.wait()
    log.info("stopping: finishing the request in progress, if any")
    await runner.cleanup()
    if lifetime.broken is not None:
        if on_broken is not None:
            on_broken()
        exit_now(1)
    # After the last request: the lock-holding verbs are done, so the checkpoints are consistent.
    await asyncio.to_thread(on_stopped)


def run_rank0(config: LearnerConfig, secret: str, listening: socket.socket, followers: Followers | None,
              launched: RankEnv | None = None) -> int:
    """`secret`: the workers' secret, which every caller of the verbs must send (protocol/worker_auth.py).
    `listening`: the verbs' socket, bound at start (grpo_server/protocol/listen.py says why).
    `followers`: ranks 1..N-1, already started (learner/__main__.py), waiting for the rendezvous port;
    or `launched`: a launcher started every rank, and the store is at its MASTER_ADDR:MASTER_PORT."""
    import torch.distributed as dist

    from learner.app import create_app
    from learner.trainer import MultiAdapterTrainer

    lifetime = Lifetime()
    if launched is not None:
        followers = LaunchedFollowers(launched.world_size)
        store, env = launcher_store(launched, config.collective_timeout_s), launched
    else:
        if followers is not None:
            followers.watch(lambda rank, code: lifetime.break_job(f"rank {rank} exited with code {code}"))
        store = host_store(config.ranks, config.collective_timeout_s)
        env = RankEnv(0, config.ranks, store.port)
        os.environ.update(env.variables())
        if followers is not None:
            followers.send_master_port(store.port)
    init_process_group(env, store, config.collective_timeout_s)
    trainer = MultiAdapterTrainer(config)
    dist.barrier()  # healthy only once every rank holds the model

    if followers is None:  # one rank: the learner as it always was
        asyncio.run(_serve(create_app(trainer, config.run_dir, secret, config.keep_versions), config, listening,
                           lifetime, trainer.checkpoint_all, on_broken=None))
    else:
        lockstep = LockstepTrainer(trainer, CommandChannel(store), followers, lifetime.break_job,
                                   config.collective_timeout_s + OUTCOME_MARGIN_S)

        def stop_job() -> None:
            try:
                lockstep.checkpoint_all()
            finally:
                lockstep.stop_followers(FOLLOWER_STOP_S)

        asyncio.run(_serve(create_app(lockstep, config.run_dir, secret, config.keep_versions), config, listening,
                           lifetime, stop_job, on_broken=followers.kill))
    dist.destroy_process_group()
    return 0


def run_follower(config: LearnerConfig, rank: int, launched: RankEnv | None = None) -> int:
    import torch.distributed as dist

    from learner.trainer import MultiAdapterTrainer

    if launched is not None:
        env, store = launched, launcher_store(launched, config.collective_timeout_s)
    else:
        env = read_master_port(RankEnv(rank, int(os.environ["WORLD_SIZE"])))
        store = join_store(env, config.collective_timeout_s)
    init_process_group(env, store, config.collective_timeout_s)
    trainer = MultiAdapterTrainer(config)
    dist.barrier()
    log.info("rank %d of %d ready", rank, env.world_size)
    return follow(trainer, CommandChannel(store), rank)
