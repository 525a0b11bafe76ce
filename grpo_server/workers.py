"""The front end's view of its workers: sampler replicas and the learner.

Requests go to the ready replica with the least outstanding work (ties in turn, so a trickle of requests
spreads too); a replica that cannot be reached is skipped for the next one. An adapter version is loaded
on every replica before it is served, so any replica can serve any live version; a replica that comes
back from a restart is re-synced with the live versions before it serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any, AsyncIterator, TypeVar

from pydantic import BaseModel

from grpo_server.api_models import ReplicaHealth
from grpo_server.errors import Unavailable
from grpo_server.turns import ComputeTurns
from grpo_server.worker_client import WorkerClient, WorkerUnreachable
from grpo_server.wire import AdapterRef, LoadAdapterRequest, UnloadAdapterRequest

T = TypeVar("T", bound=BaseModel)

# States in which a worker is expected back: a train batch waits for it rather than failing.
COMING_BACK = ("starting", "restarting", "syncing", "down")


class ReplicaLoad:
    """Requests of one replica: in flight now, and routed to it since the front end started."""

    def __init__(self) -> None:
        self.outstanding = 0
        self.requests = 0


class BalancedSampler:
    """What `WorkerPool.sampler()` yields: each call goes to the least-loaded ready replica, and to the
    next one when the chosen replica cannot be reached. Sampler verbs have no side effects, so a request
    that never reached a replica (or lost it mid-way) is safe to send again."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    async def call(self, verb: str, body: BaseModel | dict, response_model: type[T] | None = None,
                   timeout_s: float | None = None) -> Any:
        tried: set[int] = set()
        while True:
            replica = self.pool.pick_replica(exclude=tried)
            tried.add(id(replica))
            load = self.pool.load[id(replica)]
            load.outstanding += 1
            load.requests += 1
            try:
                return await replica.call(verb, body, response_model, timeout_s=timeout_s)
            except WorkerUnreachable:
                if not [s for s in self.pool.ready_samplers() if id(s) not in tried]:
                    raise
            finally:
                load.outstanding -= 1


class WorkerPool:
    def __init__(self, samplers: list[WorkerClient], learner: WorkerClient, turns: ComputeTurns | None = None):
        self.samplers = samplers
        self.learner = learner
        self.turns = turns or ComputeTurns(alternate=False)  # held by sampler calls and train steps
        self.load = {id(s): ReplicaLoad() for s in samplers}
        self._turn = itertools.count()

    def ready_samplers(self) -> list[WorkerClient]:
        return [s for s in self.samplers if s.process.ready]

    def pick_replica(self, exclude: set[int] = frozenset()) -> WorkerClient:
        """The ready replica with the fewest requests in flight; among equals, each in turn."""
        ready = [s for s in self.ready_samplers() if id(s) not in exclude]
        if not ready:
            raise self._none_ready()
        start = next(self._turn) % len(ready)
        rotated = ready[start:] + ready[:start]
        return min(rotated, key=lambda s: self.load[id(s)].outstanding)

    @contextlib.asynccontextmanager
    async def sampler(self, take_turn: bool = True) -> AsyncIterator[BalancedSampler]:
        """A handle whose calls go to the least-loaded ready replica (see `BalancedSampler`), held during a
        sampling turn (grpo_server/turns.py: it may first wait for a train step to end) unless
        `take_turn` is False. Raises 503 at once when no replica is ready."""
        if not self.ready_samplers():
            raise self._none_ready()
        async with (self.turns.sampling() if take_turn else contextlib.nullcontext()):
            yield BalancedSampler(self)

    def _none_ready(self) -> Unavailable:
        states = ", ".join(f"{s.name}: {s.process.state}" for s in self.samplers)
        return Unavailable(f"no sampler is ready ({states}); retry shortly", code="sampler_unavailable")

    async def load_everywhere(self, adapter: AdapterRef, path: str) -> None:
        """Load a version on every replica; raises if any ready replica fails. A replica that is
        re-syncing after a restart gets it too (its re-sync may have listed versions before this one),
        and so does one that became ready or re-syncing while the others loaded: the caller records
        the version (which later re-syncs then list) right after this returns, so no replica that
        serves can miss it."""
        request = LoadAdapterRequest(adapter=adapter, path=path)
        done: set[int] = set()
        while targets := [s for s in self.samplers if s.process.state in ("ready", "syncing") and id(s) not in done]:
            await asyncio.gather(*(s.call("load_adapter", request, syncing_ok=True) for s in targets))
            done.update(id(s) for s in targets)

    async def unload_everywhere(self, adapter: AdapterRef) -> None:
        request = UnloadAdapterRequest(adapter=adapter)
        # A replica that already lost it (restart) is fine: unloading is best effort.
        targets = [s for s in self.samplers if s.process.state in ("ready", "syncing")]
        await asyncio.gather(*(s.call("unload_adapter", request, syncing_ok=True) for s in targets),
                             return_exceptions=True)

    async def wait_learner_ready(self, timeout_s: float) -> None:
        """Let a restarting learner come back before a batch is sent (rather than losing the batch)."""
        deadline = time.monotonic() + timeout_s
        while self.learner.process.state in COMING_BACK and time.monotonic() < deadline:
            await asyncio.sleep(0.5)

    def states(self) -> dict[str, str]:
        return {w.name: w.process.state for w in [*self.samplers, self.learner]}

    def replica_health(self) -> dict[str, ReplicaHealth]:
        return {s.name: ReplicaHealth(state=s.process.state, outstanding=self.load[id(s)].outstanding,
                                      requests=self.load[id(s)].requests) for s in self.samplers}
