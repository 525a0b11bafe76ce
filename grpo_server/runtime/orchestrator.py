"""The server's experiments: create, look up, delete, re-sync after a worker restarts, and the upkeep loops
(group expiry, the metrics logs' sampling lines). A request for one experiment goes to its owner
(`runtime/experiment.py`) once `get` found it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from pathlib import Path
from typing import AsyncIterator

import aiohttp

from grpo_server.api_models import ExperimentStatus, TokenizeRequest, TokenizeResponse
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol.adapter_files import fetch_version, holds
from grpo_server.protocol.errors import ApiError, Conflict, NotFound, Unprocessable
from grpo_server.protocol.wire import AdapterRef
from grpo_server.runtime.episodes import EpisodeStore
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.groups import GroupStore
from grpo_server.runtime.journal import ExperimentRegistry, FeedbackJournal
from grpo_server.runtime.metrics_log import SAMPLING_INTERVAL_S, MetricsLog, metrics_log_path
from grpo_server.runtime.prompts import PromptBuilder
from grpo_server.runtime.status import experiment_status
from grpo_server.runtime.tasks import OwnedTasks
from grpo_server.runtime.training import ExperimentTrainer
from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 5.0


class Orchestrator:
    def __init__(self, config: ServerConfig, workers: WorkerPool, prompts: PromptBuilder):
        self.config = config
        self.workers = workers
        self.prompts = prompts
        self.groups = GroupStore(ttl_s=config.group_ttl_s)
        self.episodes = EpisodeStore(ttl_s=config.episode_ttl_s)
        self.experiments: dict[str, Experiment] = {}
        self.metrics_logs: dict[str, MetricsLog] = {}  # by experiment name
        self.registry = ExperimentRegistry(config.run_dir)
        self._lock = asyncio.Lock()  # serialises experiment create/delete and worker re-syncs
        self.upkeep = OwnedTasks("orchestrator")

    # --- experiments ---------------------------------------------------------------------------

    def get(self, name: str) -> Experiment:
        experiment = self.experiments.get(name)
        if experiment is None:
            raise NotFound(f"experiment {name!r} does not exist", code="experiment_not_found")
        return experiment

    def status(self, name: str) -> ExperimentStatus:
        return experiment_status(self.get(name), self.groups.pending_count(name), self.episodes.pending_count(name))

    async def create(self, config: ExperimentConfig) -> ExperimentStatus:
        async with self._lock:
            if config.name in self.experiments:
                raise Conflict(f"experiment {config.name!r} already exists", code="experiment_exists")
            if len(self.experiments) >= self.config.max_experiments:
                raise Unprocessable(f"the server holds its limit of {self.config.max_experiments} experiments "
                                    "(max_experiments); delete one first", code="over_limit")
            if config.lora.r > self.config.sampler.max_lora_rank:
                raise Unprocessable(f"lora.r {config.lora.r} is over the samplers' max_lora_rank "
                                    f"{self.config.sampler.max_lora_rank}", code="over_limit")
            if config.sampling.n > self.config.max_n or config.sampling.max_tokens > self.config.max_tokens:
                raise Unprocessable(f"sampling defaults exceed the server's limits (max_n {self.config.max_n}, "
                                    f"max_tokens {self.config.max_tokens})", code="over_limit")
            # The learner writes version 0 (LoRA B = 0, the base model), or resumes the newest on disk.
            first = await self.workers.learner.add_experiment(config.name, config.lora, config.algorithm)
            try:
                await self.workers.load_everywhere(AdapterRef(name=config.name, version=first.version), first.path,
                                                   first.fingerprint)
            except ApiError:
                await self.workers.learner.remove_experiment(config.name)
                raise
            exp = Experiment(config=config, workers=self.workers, server=self.config, prompts=self.prompts,
                             groups=self.groups, episodes=self.episodes,
                             journal=FeedbackJournal(self.config.run_dir / "journal" / f"{config.name}.jsonl"))
            exp.resume_from(first)
            exp.serve(first.version, first.path)
            self.registry.save(config)
            metrics_log = MetricsLog(metrics_log_path(self.config.run_dir, config.name))
            self.metrics_logs[config.name] = metrics_log
            trainer = ExperimentTrainer(exp, self.workers, self.config.verify_tolerance,
                                        self.config.worker_timeout_s, self.config.max_loaded_versions, metrics_log)
            exp.start_training(trainer.run())
            self.experiments[config.name] = exp
            log.info("experiment %s created, serving v%d at step %d, %d journalled groups to train",
                     config.name, first.version, first.step, len(exp.queue))
            return self.status(config.name)

    async def delete(self, name: str) -> None:
        async with self._lock:
            exp = self.get(name)
            del self.experiments[name]
            self.registry.remove(name)
            await exp.stop()
            self.metrics_logs.pop(name).close()  # the file stays
            self.groups.drop_experiment(name)
            self.episodes.drop_experiment(name)
            for version in list(exp.adapter_paths):
                await self.workers.unload_everywhere(AdapterRef(name=name, version=version))
            try:
                await self.workers.learner.remove_experiment(name)
            except ApiError as exc:  # the learner may be restarting; it will not re-add a deleted one
                log.warning("remove_experiment %s: %s", name, exc.message)
            log.info("experiment %s deleted (its adapters stay on disk)", name)

    @contextlib.asynccontextmanager
    async def adapter_dir(self, name: str, version: int | None) -> AsyncIterator[Path]:
        """The version's folder: in this run directory (the learner's, on this host), else a temporary copy
        from the learner's HTTP (a learner on another host: grpo_server/protocol/adapter_files.py)."""
        exp = self.get(name)
        version = exp.serving_version if version is None else version
        folder = self.config.run_dir / "adapters" / name / f"v{version:06d}"
        if holds(folder, None):
            yield folder
            return
        with tempfile.TemporaryDirectory(prefix=".download-", dir=self.config.run_dir) as scratch:
            async with aiohttp.ClientSession() as session:
                try:
                    copy = await fetch_version(session, self.workers.learner_connection.process.url,
                                               AdapterRef(name=name, version=version), Path(scratch) / folder.name,
                                               None, self.config.worker_timeout_s)
                except NotFound as exc:
                    raise NotFound(f"experiment {name!r} has no adapter version {version}",
                                   code="version_not_found") from exc
            yield copy

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        if request.continue_from is not None:
            ids = self.prompts.continue_conversation(request.continue_from, request.messages,
                                                     request.add_generation_prompt, tools=request.tools)
        elif request.messages is not None:
            ids = self.prompts.render_messages(request.messages, add_generation_prompt=request.add_generation_prompt,
                                               tools=request.tools)
        else:
            ids = self.prompts.token_ids(request)
        return TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=self.prompts.max_model_len)

    # --- background upkeep ---------------------------------------------------------------------

    async def expire_groups_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            for name, count in self.groups.expire().items():
                if name in self.experiments:
                    self.experiments[name].expired(groups=count)
            for name, count in self.episodes.expire().items():
                if name in self.experiments:
                    self.experiments[name].expired(episodes=count)

    async def resync_sampler(self, sampler_index: int) -> None:
        """After a sampler restart: load every live version again."""
        for exp in list(self.experiments.values()):
            for version, path in list(exp.adapter_paths.items()):
                await self.workers.load_on(sampler_index, AdapterRef(name=exp.name, version=version), path)
        log.info("%s re-loaded %d experiments' adapters", self.workers.replica(sampler_index).name,
                 len(self.experiments))

    async def resync_learner(self) -> None:
        """After a learner restart: add every experiment again; the learner resumes the newest version
        on disk (optimizer state starts fresh)."""
        async with self._lock:
            for exp in list(self.experiments.values()):
                resumed = await self.workers.learner.add_experiment(exp.name, exp.config.lora, exp.config.algorithm,
                                                                    syncing_ok=True)
                exp.resume_from(resumed)
                exp.record_error(f"learner restarted; resumed at v{resumed.version} (step {resumed.step}), "
                                 f"{len(exp.queue)} journalled groups queued to train")
                if resumed.version != exp.serving_version:
                    await self.workers.load_everywhere(AdapterRef(name=exp.name, version=resumed.version),
                                                       resumed.path, resumed.fingerprint)
                    exp.serve(resumed.version, resumed.path)

    async def log_sampling_forever(self, interval_s: float = SAMPLING_INTERVAL_S) -> None:
        """Every interval, a `sampling` line in the metrics log of each experiment that sampled in it."""
        while True:
            await asyncio.sleep(interval_s)
            for name, exp in list(self.experiments.items()):
                metrics_log = self.metrics_logs.get(name)
                if metrics_log is not None:
                    metrics_log.sampling(exp.counters)

    def start_upkeep(self) -> None:
        """Group expiry and the sampling lines of the metrics logs, until `close`."""
        self.upkeep.spawn(self.expire_groups_forever(), "expire-groups")
        self.upkeep.spawn(self.log_sampling_forever(), "log-sampling")

    async def close(self) -> None:
        await self.upkeep.stop()
        await asyncio.gather(*(exp.stop() for exp in self.experiments.values()))
        for metrics_log in self.metrics_logs.values():
            metrics_log.close()
