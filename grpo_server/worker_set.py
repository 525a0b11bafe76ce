"""Starting the workers of one machine: resolve the model, hand each worker its config (written into the
run directory), start sampler replicas and the learner side by side, and stop them all."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp

from grpo_server.config import LearnerConfig, SamplerConfig, ServerConfig, write_resolved
from grpo_server.model_prep import resolve_model
from grpo_server.supervisor import WorkerProcess
from grpo_server.worker_client import WorkerClient
from grpo_server.workers import WorkerPool

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class WorkerSet:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.model_dir: Path = resolve_model(config.model)
        self.processes: list[WorkerProcess] = []

    def _sampler_process(self, replica: int, on_restart: Callable[[], Awaitable[None]]) -> WorkerProcess:
        c, s = self.config, self.config.sampler
        port = s.base_port + replica if s.base_port else free_port()
        worker = SamplerConfig(
            model_path=self.model_dir, run_dir=c.run_dir.resolve(), port=port, replica=replica, engine=s.engine,
            dtype=c.dtype, max_model_len=c.max_model_len, seed=c.seed, max_loras=s.max_loras,
            max_cpu_loras=s.max_cpu_loras, max_lora_rank=s.max_lora_rank,
            gpu_memory_utilization=s.gpu_memory_utilization, kv_cache_gib=s.kv_cache_gib,
            max_num_seqs=s.max_num_seqs,
        )
        path = c.run_dir / "config" / f"sampler-{replica}.yaml"
        write_resolved(worker, path)
        env = {"CUDA_VISIBLE_DEVICES": s.devices[replica]} if replica < len(s.devices) else None
        return WorkerProcess(
            f"sampler-{replica}", [sys.executable, "-m", "sampler", "--config", str(path)],
            f"http://127.0.0.1:{port}", c.run_dir / "logs" / f"sampler-{replica}.log", env=env,
            startup_timeout_s=c.startup_timeout_s, on_restart=on_restart,
        )

    def _learner_process(self, on_restart: Callable[[], Awaitable[None]]) -> WorkerProcess:
        c = self.config
        port = c.learner.port or free_port()
        worker = LearnerConfig(
            model_path=self.model_dir, run_dir=c.run_dir.resolve(), port=port, dtype=c.dtype,
            max_model_len=c.max_model_len, seed=c.seed, zero_stage=c.learner.zero_stage,
            gradient_checkpointing=c.learner.gradient_checkpointing,
        )
        path = c.run_dir / "config" / "learner.yaml"
        write_resolved(worker, path)
        env = {"CUDA_VISIBLE_DEVICES": c.learner.devices} if c.learner.devices else None
        return WorkerProcess(
            "learner", [sys.executable, "-m", "learner", "--config", str(path)], f"http://127.0.0.1:{port}",
            c.run_dir / "logs" / "learner.log", env=env, startup_timeout_s=c.startup_timeout_s,
            on_restart=on_restart,
        )

    async def start(self, session: aiohttp.ClientSession,
                    on_sampler_restart: Callable[[int], Awaitable[None]],
                    on_learner_restart: Callable[[], Awaitable[None]]) -> WorkerPool:
        write_resolved(self.config, self.config.run_dir / "config" / "server.resolved.yaml")
        samplers = [
            self._sampler_process(i, (lambda i=i: on_sampler_restart(i)))
            for i in range(self.config.sampler.replicas)
        ]
        learner = self._learner_process(on_learner_restart)
        self.processes = [*samplers, learner]
        log.info("starting %d sampler(s) and the learner on %s (logs in %s)", len(samplers),
                 self.model_dir, self.config.run_dir / "logs")
        results = await asyncio.gather(*(p.start() for p in self.processes), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise RuntimeError(f"a worker failed to start: {failures[0]}") from failures[0]
        timeout = self.config.worker_timeout_s
        return WorkerPool([WorkerClient(p, session, timeout) for p in samplers],
                          WorkerClient(learner, session, timeout))

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.processes), return_exceptions=True)
