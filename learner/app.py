"""The learner's HTTP face: its verbs (`grpo_server/protocol/verbs.py`'s `LearnerVerbs`) on
`grpo_server/protocol/dispatch.py`, which parses the msgpack bodies and maps every error to its answer.

All torch work runs in a worker thread under ONE lock (the model and its adapters are shared state), so
the event loop stays free: /health and /status answer while a train step runs, and so does
GET /adapters/{name}/{version}/{file} (adapter versions for samplers on other hosts).

The learner's files of a deleted experiment are archived by the learner itself (`archive_experiment`, and
`restore_experiment` to resume one): only this process knows its run directory, which may be on another host.
For the same reason it deletes the versions nobody needs any more itself (`prune_versions`, learner/retention.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from grpo_server.protocol import archive
from grpo_server.protocol.adapter_files import FILES, ROUTE, VersionPruned
from grpo_server.protocol.deadline import check_deadline
from grpo_server.protocol.dispatch import worker_app
from grpo_server.protocol.errors import BadRequest, Conflict, NotFound
from grpo_server.protocol import wire
from grpo_server.protocol.verbs import Archived, ArchiveRequest, Healthy, LearnerVerbs, Removed
from grpo_server.protocol.wire import (
    AdapterVersion, AddExperimentRequest, DeleteStateRequest, ForwardBackwardOutput, ForwardBackwardRequest,
    LearnerStatus, LoadStateRequest, LogprobsRequest, LogprobsResponse, OptimStepRequest, OptimStepResponse,
    PrunedVersions, PruneVersionsRequest, RemoveExperimentRequest, SaveAdapterRequest, SavedState, SavedStates,
    SaveStateRequest, ScoredVersion, ScoreVersionRequest, StatesRequest, TrainMetrics, TrainRequest,
)
from learner import adapter_io, checkpoint, retention

MAX_BODY_BYTES = 512 * 1024 * 1024  # a train batch carries token ids and logprobs of every sample
EXPERIMENT_NAME = re.compile(wire.EXPERIMENT_NAME)  # an experiment name (grpo_server/config.py): no path in it
IDLE_CHECK_S = 10.0  # how often the idle pager looks (learner.page_out_idle_s is the rule)

log = logging.getLogger(__name__)


class LearnerHandler:
    """One method per learner verb, named like it, over a trainer (a learner.trainer.MultiAdapterTrainer,
    or learner.lockstep.LockstepTrainer in front of N ranks' trainers)."""

    def __init__(self, trainer: Any, run_dir: Path, keep_versions: int = 0):
        self.trainer = trainer
        self.run_dir = Path(run_dir)
        self.keep_versions = keep_versions  # LearnerOptions.keep_versions (0: keep every version)
        self.lock = asyncio.Lock()
        self.counts_busy_time = hasattr(trainer, "verb_seconds")  # a lockstep front of several ranks pages nothing

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        async with self.lock:
            check_deadline(fn.__name__)  # its turn came after its caller gave up (a pause): not run
            started = time.monotonic()
            try:
                return await asyncio.to_thread(fn, *args)
            finally:
                if self.counts_busy_time:  # the idle rule's clock (learner/paging.py)
                    self.trainer.verb_seconds += time.monotonic() - started

    async def add_experiment(self, req: AddExperimentRequest) -> AdapterVersion:
        return await self._run(self.trainer.add_experiment, req.name, req.lora, req.algorithm, req.resync)

    async def train(self, req: TrainRequest) -> TrainMetrics:
        return await self._run(self.trainer.train, req)

    async def save_adapter(self, req: SaveAdapterRequest) -> AdapterVersion:
        return await self._run(self.trainer.save_adapter, req.name)

    async def score_version(self, req: ScoreVersionRequest) -> ScoredVersion:
        return await self._run(self.trainer.score_version, req)

    async def logprobs(self, req: LogprobsRequest) -> LogprobsResponse:
        return LogprobsResponse(logprobs=await self._run(self.trainer.logprobs, req))

    async def remove_experiment(self, req: RemoveExperimentRequest) -> Removed:
        await self._run(self.trainer.remove_experiment, req.name)
        return Removed(removed=req.name)

    async def archive_experiment(self, req: ArchiveRequest) -> Archived:
        if req.label is None:
            raise BadRequest("archive_experiment needs the label to archive under")
        label = archive.check_label(req.name, req.label)

        def move_out(entries: dict[str, Path]) -> Archived:
            moved = archive.move_out(self.run_dir, label, entries)
            if req.keep is not None:
                archive.prune(self.run_dir, req.keep)
            return Archived(label=label if moved else None)

        return await self._run(self._move, req.name, move_out)

    async def restore_experiment(self, req: ArchiveRequest) -> Archived:
        def restore(entries: dict[str, Path]) -> Archived:
            if archive.live(entries):  # a restarted server's experiment, or one whose archiving failed
                return Archived(label=None, live=True)
            label = archive.newest(self.run_dir, req.name, entries) if req.label is None else req.label
            if label is None or not archive.move_back(self.run_dir, archive.check_label(req.name, label), entries):
                return Archived(label=None)
            return Archived(label=label)

        return await self._run(self._move, req.name, restore)

    async def prune_versions(self, req: PruneVersionsRequest) -> PrunedVersions:
        def prune() -> PrunedVersions:
            # Under the lock: no save or checkpoint of this experiment writes meanwhile (the one written beside
            # the steps is waited for), and its live version (kept whatever the front end says) is the one on
            # disk. Only rank 0 writes the run directory.
            self.trainer.wait_for_checkpoints()
            live = self.trainer.status().get(req.name)
            if live is None:  # a removed experiment's files are the archive's to move, not ours to thin out
                raise NotFound(f"experiment {req.name!r} is not loaded in the learner")
            kept, removed = retention.prune(self.run_dir, req.name, self.keep_versions, set(req.in_use),
                                            live["version"])
            return PrunedVersions(kept=kept, removed=removed)

        return await self._run(prune)

    def _move(self, name: str, move: Callable[[dict[str, Path]], Archived]) -> Archived:
        """Under the lock (in the worker thread): files of an experiment the trainer holds are in use."""
        if not EXPERIMENT_NAME.fullmatch(name):
            raise BadRequest(f"{name!r} is not an experiment name")
        if name in self.trainer.status():
            raise Conflict(f"experiment {name!r} is live on the learner: remove it first", code="experiment_live")
        return move({"adapters": adapter_io.adapter_root(self.run_dir, name),
                     "checkpoints": checkpoint.checkpoint_root(self.run_dir, name)})

    # --- Tinker's training verbs (learner/steps.py), under the same lock ----------------------------------------

    async def forward(self, req: ForwardBackwardRequest) -> ForwardBackwardOutput:
        return await self._run(self.trainer.forward, req)

    async def forward_backward(self, req: ForwardBackwardRequest) -> ForwardBackwardOutput:
        return await self._run(self.trainer.forward_backward, req)

    async def optim_step(self, req: OptimStepRequest) -> OptimStepResponse:
        return await self._run(self.trainer.optim_step, req)

    async def save_state(self, req: SaveStateRequest) -> SavedState:
        return await self._run(self.trainer.save_state, req)

    async def load_state(self, req: LoadStateRequest) -> SavedState:
        return await self._run(self.trainer.load_state, req)

    async def list_states(self, req: StatesRequest) -> SavedStates:
        return await self._run(self.trainer.list_states, req)

    async def delete_state(self, req: DeleteStateRequest) -> SavedState:
        return await self._run(self.trainer.delete_state, req)

    async def status(self) -> LearnerStatus:
        # No lock: a snapshot of counters, so it answers during a train step.
        residency = getattr(self.trainer, "residency", None)  # a lockstep front of N ranks pages nothing
        return LearnerStatus(experiments=self.trainer.status(), dtype=str(self.trainer.dtype).removeprefix("torch."),
                             autocast=self.trainer.autocast, paging=residency() if residency else None)

    async def health(self) -> Healthy:
        return Healthy(status="ok")


def adapter_file_route(run_dir: Path) -> web.RouteDef:
    """GET /adapters/{name}/{version}/{file}: one file of a version as is, for samplers that do not see this
    run directory (grpo_server/protocol/adapter_files.py). Versions are written once and renamed into place,
    so a file served here is whole; aiohttp sends it (sendfile) on the event loop, beside a train step."""
    async def serve(request: web.Request) -> web.FileResponse:
        name, version, file = (request.match_info[k] for k in ("name", "version", "file"))
        if file not in FILES or not EXPERIMENT_NAME.fullmatch(name) or not (version.isascii() and version.isdigit()):
            raise NotFound(f"no adapter file {request.path}", code="version_not_found")
        path = adapter_io.version_dir(run_dir, name, int(version)) / file
        if not path.is_file() and retention.was_pruned(run_dir, name, int(version)):
            raise VersionPruned(f"version {version} of {name!r} was pruned (learner.keep_versions)")
        if not path.is_file():
            raise NotFound(f"the learner has no version {version} of {name!r} ({path})", code="version_not_found")
        return web.FileResponse(path)

    return web.get(ROUTE, serve)


async def idle_pager(handler: LearnerHandler) -> None:
    """Every IDLE_CHECK_S (or half of `learner.page_out_idle_s`, if shorter), under the verbs' lock, the trainer pages
    out the experiments idle past `page_out_idle_s` and frees what page-outs left (learner/paging.py). A lockstep
    front of several ranks pages nothing, and has no such verb."""
    page_out_idle = getattr(handler.trainer, "page_out_idle", None)
    if page_out_idle is None:
        return
    idle_s = handler.trainer.config.page_out_idle_s
    interval_s = min(IDLE_CHECK_S, idle_s / 2) if idle_s else IDLE_CHECK_S  # 0: still frees what LRU page-outs left
    while True:
        await asyncio.sleep(interval_s)
        try:
            await handler._run(page_out_idle)
        except Exception as exc:  # a failed page-out (a full disk) leaves the experiment resident: tried again
            log.warning("the idle pager failed (tried again in %.0f s): %s", interval_s, exc)


def create_app(trainer: Any, run_dir: Path, secret: str, keep_versions: int = 0) -> web.Application:
    """The verbs and the adapter files, all for callers with the workers' `secret` (protocol/dispatch.py)."""
    handler = LearnerHandler(trainer, run_dir, keep_versions)
    app = worker_app(LearnerVerbs.ALL, handler, MAX_BODY_BYTES, secret=secret)
    app.add_routes([adapter_file_route(run_dir)])

    async def run_idle_pager(app: web.Application):
        task = asyncio.create_task(idle_pager(handler))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(run_idle_pager)
    return app
