"""The learner's ranks as one process tree: rank 0 is the process the supervisor started, and it starts
the others itself.

Why not torchrun by default: the supervisor must see one process to start, watch and kill, and
`python -m learner` with one rank must stay what it was. So rank 0 starts ranks 1..N-1 as
`python -m learner --config PATH --rank R --parent-pid P` with torchrun's variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR; DeepSpeed reads them too), first thing, so that their imports (torch,
transformers, DeepSpeed: seconds each) overlap its own. Then it hosts the rendezvous store on a port the
OS picks (a port chosen first and bound later could be taken meanwhile) and writes that port (MASTER_PORT)
to each follower's stdin. All ranks run on this host, so a rank's local rank is its rank: on a GPU host
it takes the LOCAL_RANK-th visible device (`learner.devices`).

Several hosts: a launcher (`torchrun --nnodes N ... -m learner`, or the `deepspeed` launcher) starts every
rank itself, with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (`launcher_env`). Then
nobody here spawns or watches a process: the ranks meet at the launcher's store (`launcher_store`), rank 0
serves the verbs and drives the others exactly as below (`LaunchedFollowers`), and the launcher ends the
job when a rank fails (docs/multi-host.md).

No orphans and no half jobs:
  * a follower asks the kernel for SIGKILL when rank 0 dies (PR_SET_PDEATHSIG), then checks that rank 0
    is still its parent (it may have died before the request);
  * followers ignore SIGTERM / SIGINT: the supervisor signals the whole process group, and the shutdown
    checkpoint still needs every rank's optimizer shard; rank 0 tells them when to stop;
  * rank 0 watches its followers: one that dies takes the job down, so the supervisor restarts it whole.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MASTER_ADDR = "127.0.0.1"  # every rank runs on this host


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    master_port: int | None = None  # known once rank 0 hosts the store
    master_addr: str = MASTER_ADDR
    launched_local_rank: int | None = None  # set when a launcher started the ranks (`launched`)

    @property
    def launched(self) -> bool:
        """Started by torchrun / the deepspeed launcher, maybe over several hosts, not by rank 0."""
        return self.launched_local_rank is not None

    @property
    def local_rank(self) -> int:
        return self.rank if self.launched_local_rank is None else self.launched_local_rank

    def variables(self) -> dict[str, str]:
        """torchrun's names, which DeepSpeed and torch read."""
        names = {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                 "MASTER_ADDR": self.master_addr}
        if self.master_port is not None:
            names["MASTER_PORT"] = str(self.master_port)
        return names


def launcher_env(environ: dict[str, str]) -> RankEnv | None:
    """The rank a launcher (torchrun, `deepspeed`) gave this process, from its variables; None when there are
    none, or one rank alone (then the learner starts its own ranks, as without a launcher)."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(environ.get(name) for name in names) or int(environ["WORLD_SIZE"]) < 2:
        return None
    return RankEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["MASTER_PORT"]),
                   environ["MASTER_ADDR"], int(environ.get("LOCAL_RANK", "0")))


def launcher_store(env: RankEnv, timeout_s: float) -> Any:
    """The launcher's rendezvous store at MASTER_ADDR:MASTER_PORT. torchrun's agent on node 0 hosts it
    (TORCHELASTIC_USE_AGENT_STORE, as torch's own env:// rendezvous reads it); otherwise rank 0 does."""
    from torch.distributed import TCPStore

    host = env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return TCPStore(env.master_addr, env.master_port, env.world_size, host, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def read_master_port(env: RankEnv) -> RankEnv:
    """In a follower: the store's port, which rank 0 writes to our stdin once it hosts the store."""
    line = sys.stdin.readline()
    if not line.strip():
        raise RuntimeError("rank 0 closed our stdin without the rendezvous port (it failed to start)")
    port = int(line)
    os.environ["MASTER_PORT"] = str(port)
    return RankEnv(env.rank, env.world_size, port)


def host_store(world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on a free port (read back as `.port`)."""
    from torch.distributed import TCPStore

    return TCPStore(MASTER_ADDR, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(env: RankEnv, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(MASTER_ADDR, env.master_port, env.world_size, False, timeout=timedelta(seconds=timeout_s))


def init_process_group(env: RankEnv, store: Any, timeout_s: float) -> None:
    """The default group over `store`: NCCL on GPUs, gloo on CPU. The timeout bounds every collective, so
    a peer stuck inside a step fails the step instead of hanging it."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        if env.launched and torch.cuda.device_count() <= env.local_rank:
            raise RuntimeError(f"learner rank {env.rank} is local rank {env.local_rank} on its host, but only "
                               f"{torch.cuda.device_count()} GPUs are visible there (CUDA_VISIBLE_DEVICES)")
        if not env.launched and torch.cuda.device_count() < env.world_size:
            raise RuntimeError(f"{env.world_size} learner ranks need as many GPUs; {torch.cuda.device_count()} "
                               "visible (learner.devices / CUDA_VISIBLE_DEVICES)")
        torch.cuda.set_device(env.local_rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s))


def ignore_stop_signals() -> None:
    """In a follower: rank 0 decides when the job stops (see the module docstring)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class LaunchedFollowers:
    """Ranks 1..N-1 that a launcher started (maybe on other hosts): not rank 0's to watch, wait for or kill.
    The launcher ends the job when a rank dies or rank 0 exits 1; meanwhile a dead follower shows as one that
    does not answer (LockstepTrainer's outcome timeout)."""

    def __init__(self, world_size: int):
        self.ranks = list(range(1, world_size))

    def exit_code(self, rank: int) -> int | None:
        return None

    def expect_exit(self) -> None:
        pass

    def wait_or_kill(self, timeout_s: float) -> None:
        pass  # they acknowledged the stop (LockstepTrainer.stop_followers); the launcher reaps them

    def kill(self) -> None:
        pass


class Followers:
    """Ranks 1..N-1 as child processes of rank 0."""

    def __init__(self, processes: dict[int, subprocess.Popen]):
        self.processes = processes
        self._exit_expected = threading.Event()

    @classmethod
    def spawn(cls, config_path: Path, world_size: int) -> "Followers":
        processes = {}
        for rank in range(1, world_size):
            env = {**os.environ, **RankEnv(rank, world_size).variables()}
            env.pop("MASTER_PORT", None)  # theirs comes on stdin (send_master_port)
            processes[rank] = subprocess.Popen(
                [sys.executable, "-m", "learner", "--config", str(config_path), "--rank", str(rank),
                 "--parent-pid", str(os.getpid())],
                env=env, stdin=subprocess.PIPE, text=True,  # stdout / stderr: rank 0's, i.e. the learner log
            )
            log.info("rank %d started, pid %d", rank, processes[rank].pid)
        return cls(processes)

    def send_master_port(self, port: int) -> None:
        for rank, process in self.processes.items():
            try:
                process.stdin.write(f"{port}\n")
                process.stdin.close()
            except OSError:  # it died already: its watcher reports that
                log.warning("rank %d is gone before the rendezvous", rank)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.processes)

    def exit_code(self, rank: int) -> int | None:
        return self.processes[rank].poll()

    def watch(self, on_unexpected_exit: Callable[[int, int], None]) -> None:
        """Call `on_unexpected_exit(rank, code)` from a watcher thread when a follower exits before
        `expect_exit()`."""
        for rank, process in self.processes.items():
            threading.Thread(target=self._watch_one, args=(rank, process, on_unexpected_exit),
                             name=f"watch-rank{rank}", daemon=True).start()

    def _watch_one(self, rank: int, process: subprocess.Popen, callback: Callable[[int, int], None]) -> None:
        code = process.wait()
        if not self._exit_expected.is_set():
            callback(rank, code)

    def expect_exit(self) -> None:
        self._exit_expected.set()

    def wait_or_kill(self, timeout_s: float) -> None:
        self.expect_exit()
        for rank, process in self.processes.items():
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("rank %d did not stop within %.0f s; killing it", rank, timeout_s)
                process.kill()
                process.wait()

    def kill(self) -> None:
        self.expect_exit()
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait()
