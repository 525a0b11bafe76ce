"""The orchestrator: experiments, completions and feedback. Handlers call this; it calls the workers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from grpo_server.runtime.advantages import group_advantages, is_zero_variance, scale_by_std_for
from grpo_server.api_models import (CompletionOut, CompletionsRequest, CompletionsResponse, ExperimentStatus,
                                    ExternalCompletion, FeedbackRequest, FeedbackResponse, TokenizeRequest,
                                    TokenizeResponse)
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol.errors import ApiError, Conflict, NotFound, TooManyRequests, Unprocessable
from grpo_server.runtime.experiment import Experiment
from grpo_server.runtime.groups import Group, GroupStore
from grpo_server.runtime.journal import ExperimentRegistry, FeedbackJournal
from grpo_server.runtime.metrics_log import SAMPLING_INTERVAL_S, MetricsLog, metrics_log_path
from grpo_server.runtime.prompts import PromptBuilder
from grpo_server.runtime.training import ExperimentTrainer
from grpo_server.protocol.wire import (AdapterRef, Completion, GenerateRequest, ScoreRequest)
from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 5.0


class Orchestrator:
    def __init__(self, config: ServerConfig, workers: WorkerPool, prompts: PromptBuilder):
        self.config = config
        self.workers = workers
        self.prompts = prompts
        self.groups = GroupStore(ttl_s=config.group_ttl_s)
        self.experiments: dict[str, Experiment] = {}
        self.metrics_logs: dict[str, MetricsLog] = {}  # by experiment name
        self.registry = ExperimentRegistry(config.run_dir)
        self._lock = asyncio.Lock()  # serialises experiment create/delete and worker re-syncs
        self._upkeep: list[asyncio.Task] = []

    # --- experiments ---------------------------------------------------------------------------

    def get(self, name: str) -> Experiment:
        experiment = self.experiments.get(name)
        if experiment is None:
            raise NotFound(f"experiment {name!r} does not exist", code="experiment_not_found")
        return experiment

    def status(self, name: str) -> ExperimentStatus:
        return self.get(name).status(self.groups.pending_count(name))

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
                await self.workers.load_everywhere(AdapterRef(name=config.name, version=first.version), first.path)
            except ApiError:
                await self.workers.learner.remove_experiment(config.name)
                raise
            exp = Experiment(config=config, workers=self.workers,
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
            for version in list(exp.adapter_paths):
                await self.workers.unload_everywhere(AdapterRef(name=name, version=version))
            try:
                await self.workers.learner.remove_experiment(name)
            except ApiError as exc:  # the learner may be restarting; it will not re-add a deleted one
                log.warning("remove_experiment %s: %s", name, exc.message)
            log.info("experiment %s deleted (its adapters stay on disk)", name)

    def adapter_dir(self, name: str, version: int | None) -> Path:
        exp = self.get(name)
        version = exp.serving_version if version is None else version
        folder = self.config.run_dir / "adapters" / name / f"v{version:06d}"
        if not (folder / "adapter_config.json").is_file():
            raise NotFound(f"experiment {name!r} has no adapter version {version}", code="version_not_found")
        return folder

    # --- sampling ------------------------------------------------------------------------------

    async def complete(self, name: str, request: CompletionsRequest) -> CompletionsResponse:
        exp = self.get(name)
        # Requests still sampling count too: their groups reach the queue later, and admitting them all
        # while the queue looks short only makes groups that go stale before the learner gets to them.
        backlog = self.config.max_queued_batches * exp.config.algorithm.batch_groups
        in_pipeline = len(exp.queue) + exp.sampling_requests
        if in_pipeline >= backlog:
            raise TooManyRequests(f"{in_pipeline} groups of {name!r} are being sampled or wait for the learner "
                                  f"(max_queued_batches x batch_groups = {backlog}); retry shortly",
                                  code="learner_behind", retry_after=2.0)
        if self.groups.pending_count(name) >= self.config.max_pending_groups:
            raise TooManyRequests(f"{self.config.max_pending_groups} groups of {name!r} await feedback "
                                  "(max_pending_groups); post feedback or let them expire",
                                  code="too_many_pending_groups", retry_after=5.0)
        defaults = exp.config.sampling
        n, max_tokens = request.n or defaults.n, request.max_tokens or defaults.max_tokens
        if n > self.config.max_n or max_tokens > self.config.max_tokens:
            raise Unprocessable(f"n {n} / max_tokens {max_tokens} exceed the server's limits (max_n "
                                f"{self.config.max_n}, max_tokens {self.config.max_tokens})", code="over_limit")
        prompt_ids = self.prompts.token_ids(request)
        self.prompts.check_fits(len(prompt_ids), max_tokens)
        temperature = defaults.temperature if request.temperature is None else request.temperature
        # The version is chosen once the sampling turn starts: a request that waited for a train step
        # samples the version that step pushed.
        with exp.sampling_request():
            async with self.workers.sampler() as sampler:
                with exp.pinned_serving_version() as version:
                    result = await sampler.generate(GenerateRequest(
                        prompt_token_ids=prompt_ids, n=n, temperature=temperature,
                        top_p=request.top_p or defaults.top_p, max_tokens=max_tokens, stop=request.stop,
                        seed=request.seed, adapter=AdapterRef(name=name, version=version),
                    ))
        group = Group(group_id=self.groups.new_id(), experiment=name, prompt_token_ids=prompt_ids,
                      completions=result.completions, policy_version=version, temperature=temperature,
                      max_tokens=max_tokens)
        self.groups.add(group)
        exp.sampled(len(result.completions), sum(len(c.token_ids) for c in result.completions), result.served_as)
        return CompletionsResponse(
            group_id=group.group_id, policy_version=version, prompt_token_ids=prompt_ids,
            completions=[CompletionOut(**c.model_dump()) for c in result.completions],
        )

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        if request.continue_from is not None:
            ids = self.prompts.continue_conversation(request.continue_from, request.messages,
                                                     request.add_generation_prompt)
        elif request.messages is not None:
            ids = self.prompts.render_messages(request.messages, request.add_generation_prompt)
        else:
            ids = self.prompts.token_ids(request)
        return TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=self.prompts.max_model_len)

    # --- feedback ------------------------------------------------------------------------------

    async def feedback(self, name: str, request: FeedbackRequest) -> FeedbackResponse:
        """Rewards for a sampled group, possibly with external completions added to it, or for a group of
        external completions only. Everything is checked before the group is taken, so a 4xx loses nothing."""
        exp = self.get(name)
        if request.group_id is None:
            prompt_ids = self.prompts.token_ids(request)
            group = Group(group_id=self.groups.new_id(), experiment=name, prompt_token_ids=prompt_ids,
                          completions=[], policy_version=exp.serving_version,
                          temperature=exp.config.sampling.temperature, max_tokens=exp.config.sampling.max_tokens)
            external = request.completions
        else:
            group = self.groups.peek(name, request.group_id)
            external = request.extra_completions or []
            if len(request.rewards) != len(group.completions) + len(external):
                raise Unprocessable(
                    f"group {group.group_id} has {len(group.completions)} completions"
                    + (f" + {len(external)} extra" if external else "")
                    + f" but {len(request.rewards)} rewards were sent", code="reward_count_mismatch")
        if group.temperature == 0:
            raise Unprocessable("a group sampled at temperature 0 (greedy) has no policy gradient to train on: "
                                "sample with temperature > 0 to give feedback", code="greedy_group")
        algorithm = exp.config.algorithm
        skipped = "zero_variance" if algorithm.skip_zero_variance and is_zero_variance(request.rewards) else None
        advantages = group_advantages(request.rewards, scale_by_std_for(algorithm.loss))
        external_ids = self._external_token_ids(group, external)  # 400s for bad ones, skipped or not
        scored_version, external_logprobs = None, None
        if external_ids and skipped is None:
            scored_version, added = await self._score_external(exp, group, external_ids)
            external_logprobs = [c.logprobs for c in added]
        # Nothing below can fail for the request's sake: the group is only taken now.
        if request.group_id is not None:
            self.groups.take(name, request.group_id)  # 404/409 if it expired or was rated meanwhile
        exp.rated(request.rewards, zero_variance=skipped is not None)
        response = FeedbackResponse(group_id=group.group_id, scored_version=scored_version,
                                    external_logprobs=external_logprobs, skipped=skipped)
        if skipped:
            return response
        if external:
            group.completions = group.completions + added
            group.max_tokens = max([group.max_tokens] + [len(c.token_ids) for c in added])
        group.rewards, group.advantages = list(request.rewards), advantages
        exp.enqueue(group, external_completions=len(external))  # durable before the 202
        return response

    def _external_token_ids(self, group: Group, external: list[ExternalCompletion]) -> list[list[int]]:
        token_ids = []
        for i, completion in enumerate(external):
            ids = self.prompts.external_completion_ids(completion, f"completions[{i}]")
            self.prompts.check_fits(len(group.prompt_token_ids), len(ids), f"completions[{i}]")
            token_ids.append(ids)
        return token_ids

    async def _score_external(self, exp: Experiment, group: Group,
                              token_ids: list[list[int]]) -> tuple[int, list[Completion]]:
        """Score completions the model did not sample under the serving version: those logprobs are
        their behaviour logprobs, so the first step's importance ratio is 1 (see README)."""
        with exp.sampling_request():
            async with self.workers.sampler() as sampler:
                with exp.pinned_serving_version() as version:
                    scored = await sampler.score(ScoreRequest(
                        prompt_token_ids=group.prompt_token_ids, completions_token_ids=token_ids,
                        temperature=group.temperature, adapter=AdapterRef(name=exp.name, version=version),
                    ))
        return version, [Completion(text=self.prompts.decode(ids), token_ids=ids, logprobs=logprobs,
                                    finish_reason="external")
                         for ids, logprobs in zip(token_ids, scored.logprobs)]

    # --- background upkeep ---------------------------------------------------------------------

    async def expire_groups_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            for name, count in self.groups.expire().items():
                if name in self.experiments:
                    self.experiments[name].expired(count)

    async def resync_sampler(self, sampler_index: int) -> None:
        """After a sampler restart: load every live version again."""
        sampler = self.workers.replica(sampler_index)
        for exp in list(self.experiments.values()):
            for version, path in list(exp.adapter_paths.items()):
                await sampler.load_adapter(AdapterRef(name=exp.name, version=version), path, syncing_ok=True)
        log.info("%s re-loaded %d experiments' adapters", sampler.name, len(self.experiments))

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
                                                       resumed.path)
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
        self._upkeep = [asyncio.create_task(self.expire_groups_forever(), name="expire-groups"),
                        asyncio.create_task(self.log_sampling_forever(), name="log-sampling")]

    async def close(self) -> None:
        for task in self._upkeep:
            task.cancel()
        await asyncio.gather(*self._upkeep, return_exceptions=True)
        await asyncio.gather(*(exp.stop() for exp in self.experiments.values()))
        for metrics_log in self.metrics_logs.values():
            metrics_log.close()
