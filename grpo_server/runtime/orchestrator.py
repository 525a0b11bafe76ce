"""The server's experiments: create, look up, delete, re-sync after a worker restarts, and the upkeep loops
(group expiry, the metrics logs' sampling lines). A request for one experiment goes to its owner
(`runtime/experiment/`) once `get` found it; the experiment builds and holds its own parts (training loop, metrics
log, trackers).

Tenants stay apart across a name's lives: delete archives the experiment's files (the learner's and the
front end's, `grpo_server/protocol/archive.py`), so a new experiment of that name starts at version 0 and
the old versions are out of every key's reach; only the admin's `resume` brings them back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Literal

from grpo_server.api_models import ExperimentStatus, TokenizeRequest, TokenizeResponse
from grpo_server.config import MIN_KEY_LENGTH, ExperimentConfig, ServerConfig, keys_as_saved
from grpo_server.protocol import archive
from grpo_server.protocol.adapter_files import VersionPruned, fetch_version, holds
from grpo_server.protocol.errors import ApiError, Conflict, NotFound, Unavailable, Unprocessable, public_message
from grpo_server.protocol.wire import AdapterRef, AdapterVersion, GenerateRequest, GenerateResponse
from grpo_server.protocol.worker_config import resolve_rollout_correction
from grpo_server.runtime.episodes import EpisodeStore
from grpo_server.runtime.experiment import Experiment, sample_and_score
from grpo_server.runtime.groups import GroupStore
from grpo_server.runtime.journal import ExperimentRegistry, FeedbackJournal
from grpo_server.runtime.loop_lag import LoopLag
from grpo_server.runtime.metrics_log import SAMPLING_INTERVAL_S, metrics_log_path
from grpo_server.runtime.prompts import PromptBuilder
from grpo_server.runtime.status import experiment_status, is_sampling, unrestored_status
from grpo_server.runtime.tasks import OwnedTasks
from grpo_server.runtime.token_budget import TokenBudget
from grpo_server.runtime.training import TrainingLoop
from grpo_server.runtime.verification import nearest_version_needed
from grpo_server.trackers import default_trackers, missing_libraries
from grpo_server.workers.pool import WorkerPool

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 5.0
REGISTRY_RETRY_S = 5.0  # a create whose config could not be written (a full disk): Retry-After
RESIDENCY_INTERVAL_S = 5.0  # how often the status pages' learner residency is read (a snapshot the learner answers
# without its lock: learner/app.py)
# How `create` treats files an earlier experiment of the name left: "restart" (a server start) resumes them
# as they are; "fresh" (the API) archives them first; "resume" (the API, admin's choice) brings the newest
# archive back, or resumes files never archived.
Start = Literal["restart", "fresh", "resume"]


RESTORE_RETRY_S = 30.0  # how often a restore that failed for a passing reason (a 503) is tried again


@dataclass
class Unrestored:
    """A saved experiment that could not be created again at start (`start_saved`): held with the reason until an
    admin restores it (`retry`) or deletes it. Its key still authenticates, so its tenant is told why."""

    config: ExperimentConfig
    reason: str
    invalid: bool = False  # its saved config does not validate: `config` is a name only, and restoring it fails
    at: float = field(default_factory=time.time)


class Orchestrator:
    def __init__(self, config: ServerConfig, workers: WorkerPool, prompts: PromptBuilder):
        self.config = config
        self.workers = workers
        self.prompts = prompts
        self.groups = GroupStore(ttl_s=config.group_ttl_s)
        self.episodes = EpisodeStore(ttl_s=config.episode_ttl_s)
        self.experiments: dict[str, Experiment] = {}
        self.unrestored: dict[str, Unrestored] = {}  # saved experiments a start could not bring back
        # Called with a name once its experiment is deleted: what an API family keeps under that name goes with
        # it (the Tinker models, sessions and samplers: api/tinker/service.py), so a new life of the name, maybe
        # another tenant's, inherits none of it.
        self.on_delete: list[Callable[[str], Awaitable[None]]] = []
        # Which experiments the learner holds in memory (True) or has paged out (False: learner/paging.py), as it
        # said at its latest status read (`watch_residency_forever`); empty until then or while it does not answer.
        self.learner_residency: dict[str, bool] = {}
        self.learner_restarts = 0  # re-syncs after a learner restart: its in-memory state (gradients) is gone
        self.registry = ExperimentRegistry(config.run_dir)
        self._lock = asyncio.Lock()  # serialises experiment create/delete and worker re-syncs
        self._learner_synced = asyncio.Event()  # clear while a restarted learner is given its experiments again
        self._learner_synced.set()
        self.upkeep = OwnedTasks("orchestrator")
        self.budget = TokenBudget(config.max_held_tokens_per_experiment, config.max_held_tokens, self.tokens_held)
        self.loop_lag = LoopLag()
        # A server whose default trackers cannot run is misconfigured: said at start, not at the first experiment.
        if missing := missing_libraries(list(config.trackers.default or [])):
            raise ValueError(f"trackers.default: {_missing_text(missing)}")

    def tokens_held(self, experiment: str | None = None) -> int:
        """Tokens in one experiment's (None: every experiment's) pending groups and episodes and training queue."""
        queues = [e.queue for e in self.experiments.values()] if experiment is None else (
            [self.experiments[experiment].queue] if experiment in self.experiments else [])
        return (self.groups.tokens(experiment) + self.episodes.tokens(experiment)
                + sum(group.tokens for queue in queues for group in queue))

    # --- experiments ---------------------------------------------------------------------------

    def get(self, name: str) -> Experiment:
        experiment = self.experiments.get(name)
        if experiment is None:
            if name in self.unrestored:
                raise Unavailable(f"experiment {name!r} could not be restored when the server started "
                                  f"({public_message(self.unrestored[name].reason)}); an admin restores it (POST "
                                  f"/v1/experiments/{name}/restore) or deletes it", code="experiment_unrestored",
                                  retry_after=60.0)
            raise NotFound(f"experiment {name!r} does not exist", code="experiment_not_found")
        return experiment

    def configs(self) -> list[ExperimentConfig]:
        """Every experiment's config, the unrestored ones' too: whose keys authenticate, and are taken."""
        return [e.config for e in self.experiments.values()] + [u.config for u in self.unrestored.values()]

    def names(self) -> list[str]:
        """Every experiment's name, the unrestored ones' too, as an admin's list shows them."""
        return [*self.experiments, *self.unrestored]

    def status(self, name: str) -> ExperimentStatus:
        return self.statuses([name])[0]

    def statuses(self, names: list[str]) -> list[ExperimentStatus]:
        """Their statuses (404 for an unknown name). The experiments sampling now, counted once for all of them,
        set how many groups each had best keep in flight (runtime/status.py)."""
        now = time.monotonic()
        sampling = {e.name for e in self.experiments.values() if is_sampling(e, now)}
        return [unrestored_status(self.unrestored[name].config, self.unrestored[name].reason)
                if name in self.unrestored and name not in self.experiments else
                experiment_status(self.get(name), self.groups.pending_count(name), self.episodes.pending_count(name),
                                  experiments_sampling=len(sampling - {name}) + 1,
                                  learner_resident=self.learner_residency.get(name))
                for name in names]

    async def start_saved(self, configs: list[ExperimentConfig]) -> None:
        """The experiments a start brings back (or creates from the server's config), one by one. One that cannot
        be created (an unreadable checkpoint, a learner error) is held as `unrestored`, with its reason in its
        status and the log, and the others go on: the server starts whatever one experiment's files hold. One that
        failed for a reason that passes (a 503: the learner's disk full, a worker timing out) is tried again every
        `RESTORE_RETRY_S` until it is back, deleted, or fails for another reason (the chaos soak found a full disk
        at a restart leaving experiments held until an admin came)."""
        for config in configs:
            try:
                await self.create(config)
            except Exception as exc:
                self.unrestored[config.name] = Unrestored(config, _reason(exc))
                passing = isinstance(exc, Unavailable)
                log.error("experiment %s could not be restored, held as failed (%s): %s", config.name,
                          "tried again every %.0f s" % RESTORE_RETRY_S if passing else
                          f"an admin restores it with POST /v1/experiments/{config.name}/restore, or deletes it",
                          exc, exc_info=not isinstance(exc, ApiError))
                if passing:
                    self.upkeep.spawn(self._restore_when_possible(config.name), f"restore-{config.name}")

    async def _restore_when_possible(self, name: str) -> None:
        """`retry` every RESTORE_RETRY_S while the experiment is held for a reason that passes (a 503)."""
        while True:
            await asyncio.sleep(RESTORE_RETRY_S)
            held = self.unrestored.get(name)
            if held is None:  # restored by an admin, or deleted
                return
            try:
                await self.retry(name)
            except Unavailable:
                continue
            except Exception:  # held again for a reason that does not pass (retry logged it): an admin's now
                return
            log.info("experiment %s restored, after its start had failed for a reason that passed", name)
            return

    async def retry(self, name: str) -> ExperimentStatus:
        """An unrestored experiment created again from its saved config (409 if it is not one); held again, with
        the new reason, if that fails too."""
        held = self.unrestored.get(name)
        if held is None:
            self.get(name)  # 404 for an unknown name
            raise Conflict(f"experiment {name!r} is running: nothing to restore", code="experiment_running")
        if held.invalid:
            raise Conflict(f"experiment {name!r} cannot be restored: {held.reason}. Fix the file and restart the "
                           "server, or delete the experiment", code="experiment_invalid")
        async with self._lock:
            if self.unrestored.get(name) is not held:
                raise Conflict(f"experiment {name!r} was restored or deleted meanwhile", code="experiment_changed")
            del self.unrestored[name]
            try:
                return await self._create(held.config, "restart")
            except Exception as exc:
                self.unrestored[name] = Unrestored(held.config, _reason(exc))
                log.error("experiment %s could not be restored again: %s", name, exc)
                raise

    async def create(self, config: ExperimentConfig, start: Start = "restart") -> ExperimentStatus:
        async with self._lock:
            return await self._create(config, start)

    async def _create(self, config: ExperimentConfig, start: Start) -> ExperimentStatus:
        """`create`, under self._lock (which `retry` holds too)."""
        if config.name in self.experiments or config.name in self.unrestored:
            raise Conflict(f"experiment {config.name!r} already exists" + (
                " and could not be restored: restore or delete it" if config.name in self.unrestored else ""),
                code="experiment_exists")
        if len(self.experiments) + len(self.unrestored) >= self.config.max_experiments:
            raise Unprocessable(f"the server holds its limit of {self.config.max_experiments} experiments "
                                "(max_experiments); delete one first", code="over_limit")
        if config.lora.r > self.config.sampler.max_lora_rank:
            raise Unprocessable(f"lora.r {config.lora.r} is over the samplers' max_lora_rank "
                                f"{self.config.sampler.max_lora_rank}", code="over_limit")
        if config.sampling.n > self.config.max_n or config.sampling.max_tokens > self.config.max_tokens:
            raise Unprocessable(f"sampling defaults exceed the server's limits (max_n {self.config.max_n}, "
                                f"max_tokens {self.config.max_tokens})", code="over_limit")
        trackers = self.trackers_of(config)
        if missing := missing_libraries(trackers):
            raise Unprocessable(f"trackers: {_missing_text(missing)}", code="tracker_unavailable")
        if start == "fresh":  # leftovers: a delete whose learner was down, or one from before archiving
            await self._archive(config.name, archive.new_label(config.name))
        elif start == "resume":
            await self._restore(config.name)
        # The push check and the rollout correction follow the numerics of the workers (protocol/worker_config.py)
        dtypes, learner_autocast = await self.workers.numerics()
        nearest = nearest_version_needed(self.config, dtypes)
        config = config.model_copy(update={"algorithm": resolve_rollout_correction(
            config.algorithm, numerics_differ=nearest or learner_autocast)})
        # The learner writes version 0 (LoRA B = 0, the base model), or resumes the newest on disk.
        first = await self.workers.learner.add_experiment(config.name, config.lora, config.algorithm)
        exp = Experiment(config=config, workers=self.workers, server=self.config, prompts=self.prompts,
                         groups=self.groups, episodes=self.episodes, budget=self.budget,
                         journal=FeedbackJournal(self.config.run_dir / "journal" / f"{config.name}.jsonl"))
        try:
            await self.workers.load_everywhere(exp.adapter(first.version), first.path, first.fingerprint)
            exp.resume_from(first)
            exp.serve(first.version, first.path)
            await asyncio.to_thread(self.registry.save, config)  # fsyncs: off the event loop
        except (ApiError, OSError) as exc:
            # Nothing of it stays (the chaos soak's full disk left the learner holding an experiment that the front
            # end did not know, a 500): the workers let it go, and the client is told to try again.
            await self._undo_create(exp, first)
            if isinstance(exc, OSError):
                raise Unavailable(f"experiment {config.name!r} could not be recorded ({exc.strerror or exc}): "
                                  "nothing was created; retry", code="registry_write_failed",
                                  retry_after=REGISTRY_RETRY_S) from exc
            raise
        if start == "restart":  # an admin's pause outlasts a restart; a new or resumed experiment starts unpaused
            exp.set_paused(await asyncio.to_thread(self.registry.is_paused, config.name))
        exp.open(trackers)  # its metrics log and trackers
        exp.start_training(TrainingLoop(exp, self.workers, self.config.verify_tolerance, self.config.worker_timeout_s,
                                        self.config.max_loaded_versions, exp.metrics_log, nearest_version=nearest,
                                        idle_check_s=self.config.verify_idle_s))
        self.experiments[config.name] = exp
        log.info("experiment %s created, serving v%d at step %d, %d journalled groups to train; pushes checked "
                 "by %s, rollout correction %s (the workers compute in %s%s)", config.name, first.version,
                 first.step, len(exp.queue), "nearest_version" if nearest else "tolerance",
                 config.algorithm.rollout_correction, ", ".join(d or "?" for d in dtypes),
                 "; the learner's steps in bf16 autocast" if learner_autocast else "")
        return self.status(config.name)

    async def _undo_create(self, exp: Experiment, first: AdapterVersion) -> None:
        """What `_create` made before it failed, let go: its journal, its first version on the samplers, the
        learner's hold (best effort: a worker that fails here is down, and forgets it when it restarts)."""
        await exp.journal.aclose()
        await self.workers.unload_everywhere(exp.adapter(first.version))
        try:
            await self.workers.learner.remove_experiment(exp.name)
        except ApiError as exc:
            log.warning("experiment %s: its failed create left it on the learner: %s", exp.name, exc.message)

    async def set_paused(self, name: str, paused: bool) -> ExperimentStatus:
        """An admin's pause or unpause (`Experiment.paused`), written to the registry first so that a restart keeps
        it. Under the lock: a pause that raced a delete could leave its marker behind for a later life of the name."""
        async with self._lock:
            exp = self.get(name)
            try:
                await asyncio.to_thread(self.registry.set_paused, name, paused)
            except OSError as exc:  # a full disk: nothing changed, the admin retries
                raise Unavailable(f"the {'pause' if paused else 'unpause'} could not be recorded "
                                  f"({exc.strerror or type(exc).__name__}); nothing changed: retry",
                                  code="registry_write_failed") from exc
            exp.set_paused(paused)
        log.info("experiment %s %s by the admin", name, "paused" if paused else "unpaused")
        return self.status(name)

    async def delete(self, name: str) -> None:
        async with self._lock:
            if name in self.unrestored:
                await self._delete_unrestored(name)
                return
            exp = self.get(name)
            del self.experiments[name]
            await asyncio.to_thread(self.registry.remove, name)
            # Its metrics log's file stays, and its tracker runs in their stores (not archived: a store holds every
            # experiment's runs).
            await exp.stop()
            self.groups.drop_experiment(name)
            self.episodes.drop_experiment(name)
            self.workers.turns.forget(name)
            for version in list(exp.adapter_paths):
                await self.workers.unload_everywhere(exp.adapter(version))
            await self._archive_deleted(name)

    async def _delete_unrestored(self, name: str) -> None:
        """An experiment held as unrestored, deleted: out of the registry, its files archived as a delete's are
        (the learner is asked to remove it too, in case its failed start left it half added)."""
        del self.unrestored[name]
        await asyncio.to_thread(self.registry.remove, name)
        await self._archive_deleted(name)

    async def _archive_deleted(self, name: str) -> None:
        """The end of every delete: the learner lets the experiment go, its files and the front end's are
        archived, and what an API family kept under the name (`on_delete`) goes too."""
        try:
            await self.workers.learner.remove_experiment(name)
        except ApiError as exc:  # the learner may be restarting; it will not re-add a deleted one
            log.warning("remove_experiment %s: %s", name, exc.message)
        label = archive.new_label(name)
        keep = self.config.archives_kept  # each process removes the older ones from its run directory
        try:
            await self.workers.learner.archive_experiment(name, label, keep)
        except ApiError as exc:  # what stays is archived before a new experiment of this name starts
            log.warning("archive_experiment %s: %s", name, exc.message)
        # Renames and fsyncs: on a thread, as every disk write of a request.
        await asyncio.to_thread(archive.move_out, self.config.run_dir, label, self._own_files(name))
        pruned = await asyncio.to_thread(archive.prune, self.config.run_dir, keep)
        if pruned:
            log.info("archives removed beyond archives_kept (%d): %s", keep, ", ".join(pruned))
        for forget in self.on_delete:
            try:
                await forget(name)
            except Exception:  # one family's failure must not leave the delete half done for the others
                log.exception("experiment %s: forgetting what an API kept under its name failed", name)
        log.info("experiment %s deleted, its files archived as %s", name, label)

    def trackers_of(self, config: ExperimentConfig) -> list[str]:
        """The experiment's trackers: its own list, or the server's default (unset: trackio where installed)."""
        return list(config.trackers if config.trackers is not None else default_trackers(self.config.trackers))

    def saved_experiments(self) -> list[ExperimentConfig]:
        """The experiments an earlier run in this run directory left in its registry, keys as saved: one
        shorter than MIN_KEY_LENGTH (saved before keys had a minimum) still works, with a warning."""
        with keys_as_saved():
            saved = self.registry.load_each()
        configs = [c for c in saved.values() if isinstance(c, ExperimentConfig)]
        for name, reason in saved.items():
            if isinstance(reason, str):  # held as failed, as one whose checkpoint is unreadable; its key is not read
                self.unrestored[name] = Unrestored(ExperimentConfig.model_construct(name=name), reason, invalid=True)
                log.error("experiment %s held as failed: %s. Fix or delete the file and restart, or delete the "
                          "experiment (DELETE /v1/experiments/%s)", name, reason, name)
        for config in configs:
            if config.api_key is not None and len(config.api_key.get_secret_value()) < MIN_KEY_LENGTH:
                log.warning("experiment %s: its api_key is shorter than %d characters; delete it and create it "
                            "again with a longer key and `resume: true`", config.name, MIN_KEY_LENGTH)
        return configs

    # --- a name's earlier lives: grpo_server/protocol/archive.py -----------------------------------

    def _own_files(self, name: str) -> dict[str, Path]:
        """What the front end keeps under an experiment's name: its archive entry -> the live path."""
        return {"journal.jsonl": self.config.run_dir / "journal" / f"{name}.jsonl",
                "metrics.jsonl": metrics_log_path(self.config.run_dir, name)}

    async def _archive(self, name: str, label: str) -> None:
        try:
            await self.workers.learner.archive_experiment(name, label)
        except ApiError as exc:
            if exc.code != "experiment_live":
                raise
            # Still held by the learner, though deleted here (its remove failed): it is no experiment of ours.
            await self.workers.learner.remove_experiment(name)
            await self.workers.learner.archive_experiment(name, label)
        await asyncio.to_thread(archive.move_out, self.config.run_dir, label, self._own_files(name))

    async def _restore(self, name: str) -> None:
        """The newest archive of `name` back in place, each process its own part, or its files as they are
        if never archived (a learner that was down at the delete). 404 when the learner has neither: the
        weights are what a resume is for."""
        learner = await self.workers.learner.restore_experiment(name)
        if learner.label is None and not learner.live:
            raise NotFound(f"experiment {name!r} has nothing to resume: no archive and no files on disk",
                           code="nothing_to_resume")
        own = self._own_files(name)
        if not archive.live(own):
            # The learner's archive names the life; if it had none to restore, this side's newest is the same
            # life (a delete always archives the front end's part).
            label = learner.label or archive.newest(self.config.run_dir, name, own)
            if label is not None:
                await asyncio.to_thread(archive.move_back, self.config.run_dir, label, own)
        log.info("experiment %s: resuming %s", name, learner.label or "its files on disk")

    @contextlib.asynccontextmanager
    async def adapter_dir(self, name: str, version: int | None) -> AsyncIterator[Path]:
        """The version's folder: in this run directory (the learner's, on this host), else a temporary copy
        from the learner's HTTP (a learner on another host: grpo_server/protocol/adapter_files.py)."""
        exp = self.get(name)
        version = exp.serving_version if version is None else version
        folder = self.config.run_dir / "adapters" / name / f"v{version:06d}"
        # 410, not 404 or 500, for a version the learner deleted (learner.keep_versions): gone for good.
        pruned = VersionPruned(f"adapter version {version} of {name!r} was deleted: the learner keeps the newest "
                               "learner.keep_versions versions and those in use")
        if holds(folder, None):
            try:
                yield folder
            except FileNotFoundError as exc:  # pruned while being read (learner/retention.py renames it away)
                raise pruned from exc
            return
        with tempfile.TemporaryDirectory(prefix=".download-", dir=self.config.run_dir) as scratch:
            learner = self.workers.learner_connection  # its session sends the workers' secret, as the learner asks
            try:
                copy = await fetch_version(learner.session, learner.process.url, AdapterRef(name=name, version=version),
                                           Path(scratch) / folder.name, None, self.config.worker_timeout_s)
            except NotFound as exc:
                raise NotFound(f"experiment {name!r} has no adapter version {version}",
                               code="version_not_found") from exc
            except VersionPruned as exc:
                raise pruned from exc
            yield copy

    async def sample_base_model(self, request: GenerateRequest, score_prompt: bool,
                                ) -> tuple[GenerateResponse, list[float] | None]:
        """The admin's own samples of the base model, in no experiment's turn: the server's token budget still
        holds their worst case, under "admin" (a name no experiment takes: config.RESERVED_NAMES)."""
        return await sample_and_score(self.workers, self.budget, "admin", None, request, score_prompt)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        prompts = self.prompts
        if request.continue_from is not None:
            ids = await prompts.off_loop(prompts.continue_conversation, request.continue_from, request.messages,
                                         request.add_generation_prompt, tools=request.tools)
        elif request.messages is not None:
            ids = await prompts.off_loop(prompts.render_messages, request.messages,
                                         add_generation_prompt=request.add_generation_prompt, tools=request.tools)
        else:
            ids = await prompts.off_loop(prompts.token_ids, request)
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
                await self.workers.load_on(sampler_index, exp.adapter(version), path)
        log.info("%s re-loaded %d experiments' adapters", self.workers.replica(sampler_index).name,
                 len(self.experiments))

    async def resync_learner(self) -> None:
        """After a learner restart: add every experiment again; the learner resumes the newest version
        on disk (optimizer state starts fresh)."""
        self._learner_synced.clear()
        try:
            async with self._lock:
                await self._resync_learner()
        finally:
            self._learner_synced.set()

    async def learner_settled(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until a restarting learner is back and has every experiment again: a client's
        call made meanwhile (the Tinker API's) runs then, and learns what the restart rolled back
        (`learner_restarts`), instead of failing on a learner that is not there yet."""
        await self.workers.wait_learner_ready(timeout_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._learner_synced.wait(), timeout_s)

    async def _resync_learner(self) -> None:
        """`resync_learner`'s work, under self._lock."""
        self.learner_restarts += 1
        for exp in list(self.experiments.values()):
            resumed = await self.workers.learner.add_experiment(exp.name, exp.config.lora, exp.config.algorithm,
                                                                resync=True)
            exp.resume_from(resumed)
            exp.record_error(f"learner restarted; resumed at v{resumed.version} (step {resumed.step}), "
                             f"{len(exp.queue)} journalled groups queued to train")
            if resumed.version != exp.serving_version:
                await self.workers.load_everywhere(exp.adapter(resumed.version),
                                                   resumed.path, resumed.fingerprint)
                exp.serve(resumed.version, resumed.path)

    async def log_sampling_forever(self, interval_s: float = SAMPLING_INTERVAL_S) -> None:
        """Every interval, a `sampling` line in the metrics log of each experiment that sampled in it."""
        while True:
            await asyncio.sleep(interval_s)
            for exp in list(self.experiments.values()):
                exp.log_sampling()

    async def watch_residency_forever(self, interval_s: float = RESIDENCY_INTERVAL_S) -> None:
        """Every interval, which experiments the learner holds in memory, for their status pages."""
        while True:
            await asyncio.sleep(interval_s)
            learner = self.workers.learner
            try:
                answer = await learner.status() if learner is not None else None
            except Exception:  # restarting, or not answering: the pages say nothing rather than something stale
                answer = None
            self.learner_residency = {} if answer is None else {
                name: bool(held["resident"]) for name, held in answer.experiments.items() if "resident" in held}

    def start_upkeep(self) -> None:
        """Group expiry, the sampling lines of the metrics logs and the learner's residency, until `close`."""
        self.upkeep.spawn(self.expire_groups_forever(), "expire-groups")
        self.upkeep.spawn(self.watch_residency_forever(), "learner-residency")
        self.upkeep.spawn(self.log_sampling_forever(), "log-sampling")
        self.upkeep.spawn(self.loop_lag.watch_forever(), "loop-lag")

    async def close(self) -> None:
        await self.upkeep.stop()
        await asyncio.gather(*(exp.stop() for exp in self.experiments.values()))  # their logs and trackers too
        self.prompts.close()


def _reason(exc: BaseException) -> str:
    """Why an experiment could not be restored, as its status shows it (its type and text; the log has more)."""
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, ApiError) else f"{exc.code}: {exc.message}"


def _missing_text(missing: dict[str, list[str]]) -> str:
    libraries = "; ".join(f"{name} needs {', '.join(libs)}" for name, libs in missing.items())
    return f"{libraries}, not installed (pip extra `grpo-server[trackers]`)"
