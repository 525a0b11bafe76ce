"""The front end's workers: resolve the model, hand each worker its config (written into the run
directory), start sampler replicas and the learner side by side, and stop them all; or, when the config
names remote workers (`--role frontend`), connect to them instead (`remote.RemoteWorker`).

`worker_spec` is the same command for a worker run on its own (`--role sampler` / `--role learner`), so a
docker-compose service starts exactly what the one-machine front end would.

Each worker gets the workers' secret (protocol/worker_auth.py) in its environment, never in its command line
or config file; the samplers also get the learner's URL, the one place they may copy adapter versions from."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp

from grpo_server.config import ServerConfig
from grpo_server.protocol.cpu_features import CpuFeatures, read_cpu_features
from grpo_server.protocol.listen import free_port
from grpo_server.protocol.verbs import LearnerClient, SamplerClient
from grpo_server.protocol.wire import AdapterRef
from grpo_server.protocol.worker_auth import SECRET_ENV
from grpo_server.protocol.worker_config import (DTypeName, LearnerConfig, SamplerConfig, fill, pick_engine_name,
                                                write_resolved)
from grpo_server.workers.allocator import allocator_env, describe
from grpo_server.workers.model_prep import resolve_model
from grpo_server.workers.pool import ComputeTurns, Worker, WorkerConnection, WorkerPool, resolve_schedule
from grpo_server.workers.processes import WorkerProcess
from grpo_server.workers.remote import RemoteWorker

log = logging.getLogger(__name__)


def sampler_dtype(config: ServerConfig, cpu: CpuFeatures) -> DTypeName:
    """The samplers' dtype: `sampler.dtype` when set, else the server's `dtype`, except that `auto` means bfloat16
    for a vLLM sampler on a CPU that computes bf16 natively (avx512_bf16 or AMX; this host's: the sampler runs
    where this is called). That is the fast default: sooner to 0.6 than float32 on such a CPU
    (docs/benchmarks/findings.md "The race to 0.6"), with the learner's weights staying float32 (its steps under bf16
    autocast, learner.autocast auto), pushes checked by nearest_version and rollout_correction auto making token_tis. On
    a GPU auto is bfloat16 anyway (sampler/engine_interface.py); an explicit float32 keeps sampler and learner exact."""
    s = config.sampler
    if s.dtype is not None:
        return s.dtype
    if config.dtype == "auto" and cpu.bf16_native and pick_engine_name(s.engine) == "vllm":
        return "bfloat16"
    return config.dtype


class WorkerSet:
    def __init__(self, config: ServerConfig, worker_host: str = "127.0.0.1"):
        """`worker_host`: the address the workers listen on (loopback when the front end starts them;
        the container's address for a worker run on its own)."""
        self.config = config
        self.worker_host = worker_host
        self.model_dir: Path = resolve_model(config.model)
        self.processes: list[Worker] = []
        self.schedule = resolve_schedule(config.schedule, config.remote_workers)
        # grpo_server/serve.py fills it in (configured, or made for this start); a front end built without
        # serve (tests) gets one of its own.
        given = config.worker_secret
        self.secret = given.get_secret_value() if given is not None else secrets.token_urlsafe(32)
        self._learner_port: int | None = None
        self.allocator = allocator_env(os.environ)  # LD_PRELOAD of tcmalloc, where the system has it

    def _process_fields(self, port: int) -> dict:
        """What every worker process's config takes from the server config, beside its own options."""
        c = self.config
        return dict(model_path=self.model_dir, run_dir=c.run_dir.resolve(), host=self.worker_host, port=port,
                    dtype=c.dtype, max_model_len=c.max_model_len, seed=c.seed)

    def _env(self, devices: str | None) -> dict[str, str]:
        return {SECRET_ENV: self.secret, **self.allocator, **({"CUDA_VISIBLE_DEVICES": devices} if devices else {})}

    def learner_port(self) -> int:
        """The learner's port, picked once: the samplers are told it before the learner starts."""
        if self._learner_port is None:
            self._learner_port = self.config.learner.port or free_port()
        return self._learner_port

    def learner_url(self) -> str:
        """The learner as the samplers (and the front end) reach it: the configured URL, or the local one."""
        return self.config.learner.url or f"http://127.0.0.1:{self.learner_port()}"

    def _sampler_port(self, replica: int) -> int:
        s = self.config.sampler
        if s.urls:  # a replica run on its own listens where the front end will look for it
            return urlsplit(s.urls[replica]).port
        return s.base_port + replica if s.base_port else free_port()

    def _sampler_process(self, replica: int, on_restart: Callable[[], Awaitable[None]] | None) -> WorkerProcess:
        c, s = self.config, self.config.sampler
        port = self._sampler_port(replica)
        process = {**self._process_fields(port), "dtype": sampler_dtype(c, read_cpu_features())}
        worker = fill(SamplerConfig, s, **process, replica=replica, learner_url=self.learner_url())
        path = c.run_dir / "config" / f"sampler-{replica}.yaml"
        write_resolved(worker, path)
        env = self._env(s.devices[replica] if replica < len(s.devices) else None)
        return WorkerProcess(
            f"sampler-{replica}", [sys.executable, "-m", "sampler", "--config", str(path)],
            f"http://127.0.0.1:{port}", c.run_dir / "logs" / f"sampler-{replica}.log", env=env,
            startup_timeout_s=c.startup_timeout_s, on_restart=on_restart,
        )

    def _learner_process(self, on_restart: Callable[[], Awaitable[None]]) -> WorkerProcess:
        c = self.config
        port = self.learner_port()
        worker = fill(LearnerConfig, c.learner, **self._process_fields(port))
        path = c.run_dir / "config" / "learner.yaml"
        write_resolved(worker, path)
        env = self._env(c.learner.devices)
        return WorkerProcess(
            "learner", [sys.executable, "-m", "learner", "--config", str(path)], f"http://127.0.0.1:{port}",
            c.run_dir / "logs" / "learner.log", env=env, startup_timeout_s=c.startup_timeout_s,
            on_restart=on_restart,
        )

    def worker_spec(self, role: str, replica: int = 0) -> WorkerProcess:
        """The command (and environment) of one worker, its config written into the run directory as the
        front end would write it; for a worker run on its own."""
        if role == "sampler":
            return self._sampler_process(replica, on_restart=None)
        if role == "learner":
            return self._learner_process(on_restart=None)
        raise ValueError(f"no worker role {role!r} (sampler or learner)")

    async def start(self, session: aiohttp.ClientSession,
                    on_sampler_restart: Callable[[int], Awaitable[None]],
                    on_learner_restart: Callable[[], Awaitable[None]]) -> WorkerPool:
        write_resolved(self.config, self.config.run_dir / "config" / "server.resolved.yaml")
        timeout = self.config.worker_timeout_s
        if self.config.remote_workers:
            samplers, learner = self._remote_workers(session, on_sampler_restart, on_learner_restart)
            log.info("connecting to %d sampler(s) and the learner: %s", len(samplers),
                     ", ".join(c.process.url for c in [*samplers, learner]))
        else:
            samplers = [WorkerConnection(self._sampler_process(i, (lambda i=i: on_sampler_restart(i))), session, timeout)
                        for i in range(self.config.sampler.replicas)]
            learner = WorkerConnection(self._learner_process(on_learner_restart), session, timeout)
            log.info("starting %d sampler(s) and the learner on %s (logs in %s); %s", len(samplers),
                     self.model_dir, self.config.run_dir / "logs", describe(self.allocator, os.environ))
        self.processes = [c.process for c in [*samplers, learner]]
        results = await asyncio.gather(*(p.start() for p in self.processes), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise RuntimeError(f"a worker failed to start: {failures[0]}") from failures[0]
        log.info("schedule: %s (sampling and training %s)", self.schedule, {
            "alternate": "take turns by experiment", "alternate_all": "take turns, every experiment's sampling "
            "waiting for each train step"}.get(self.schedule, "run at the same time"))
        return WorkerPool(samplers, learner, ComputeTurns(alternate=self.schedule != "overlap",
                                                          by_experiment=self.schedule == "alternate"))

    def _remote_workers(self, session: aiohttp.ClientSession,
                        on_sampler_restart: Callable[[int], Awaitable[None]],
                        on_learner_restart: Callable[[], Awaitable[None]]) -> tuple[list[WorkerConnection], WorkerConnection]:
        c = self.config

        def connect(name: str, url: str, reset: Callable[[WorkerConnection], Awaitable[None]],
                    on_restart: Callable[[], Awaitable[None]]) -> WorkerConnection:
            worker = RemoteWorker(name, url, session, startup_timeout_s=c.startup_timeout_s, on_restart=on_restart)
            client = WorkerConnection(worker, session, c.worker_timeout_s)
            worker.reset = lambda: reset(client)  # runs on each (re)connect, through the client's verbs
            return client

        samplers = [connect(f"sampler-{i}", url, unload_all_adapters, (lambda i=i: on_sampler_restart(i)))
                    for i, url in enumerate(c.sampler.urls)]
        learner = connect("learner", c.learner.url, forget_learner_experiments, on_learner_restart)
        return samplers, learner

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.processes), return_exceptions=True)


# --- resetting a remote worker ----------------------------------------------------------------------
# A remote worker may hold state from before the front end (re)connected: an earlier front end's
# experiments and adapters. The front end owns that state (journal, registry, versions on disk) and loads
# it again, so the worker first forgets what it holds. The learner resumes from its last checkpoint and
# the journal replays the groups since, exactly as after a learner restart.


async def unload_all_adapters(connection: WorkerConnection) -> None:
    sampler = SamplerClient(connection)
    health = await sampler.health(syncing_ok=True)
    for key in health.adapters:
        await sampler.unload_adapter(AdapterRef.from_key(key), syncing_ok=True)
    if health.adapters:
        log.info("%s: unloaded %d adapters left from before", sampler.name, len(health.adapters))


async def forget_learner_experiments(connection: WorkerConnection) -> None:
    learner = LearnerClient(connection)
    status = await learner.status(syncing_ok=True)
    for name in status.experiments:
        await learner.remove_experiment(name, syncing_ok=True)
    if status.experiments:
        log.info("learner: released %d experiments left from before (they resume from their checkpoints)",
                 len(status.experiments))
