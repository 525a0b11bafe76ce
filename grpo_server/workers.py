"""The front end's view of its workers: sampler replicas and the learner.

Requests go to the ready replica with the least outstanding work; an adapter version is loaded on every
replica before it is served, so any replica can serve any live version.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from grpo_server.errors import Unavailable
from grpo_server.worker_client import WorkerClient
from grpo_server.wire import AdapterRef, LoadAdapterRequest, UnloadAdapterRequest


class WorkerPool:
    def __init__(self, samplers: list[WorkerClient], learner: WorkerClient):
        self.samplers = samplers
        self.learner = learner
        self._outstanding = {id(s): 0 for s in samplers}

    def ready_samplers(self) -> list[WorkerClient]:
        return [s for s in self.samplers if s.process.ready]

    @contextlib.asynccontextmanager
    async def sampler(self) -> AsyncIterator[WorkerClient]:
        """The ready replica with the least outstanding requests, counted while in use."""
        ready = self.ready_samplers()
        if not ready:
            states = ", ".join(f"{s.name}: {s.process.state}" for s in self.samplers)
            raise Unavailable(f"no sampler is ready ({states})", code="sampler_unavailable")
        chosen = min(ready, key=lambda s: self._outstanding[id(s)])
        self._outstanding[id(chosen)] += 1
        try:
            yield chosen
        finally:
            self._outstanding[id(chosen)] -= 1

    async def load_everywhere(self, adapter: AdapterRef, path: str) -> None:
        """Load a version on every replica; raises if any ready replica fails. A replica that is
        re-syncing after a restart gets it too (its re-sync may have listed versions before this one)."""
        request = LoadAdapterRequest(adapter=adapter, path=path)
        targets = [s for s in self.samplers if s.process.state in ("ready", "syncing")]
        await asyncio.gather(*(s.call("load_adapter", request, syncing_ok=True) for s in targets))

    async def unload_everywhere(self, adapter: AdapterRef) -> None:
        request = UnloadAdapterRequest(adapter=adapter)
        # A replica that already lost it (restart) is fine: unloading is best effort.
        await asyncio.gather(*(s.call("unload_adapter", request) for s in self.ready_samplers()),
                             return_exceptions=True)

    async def wait_learner_ready(self, timeout_s: float) -> None:
        """Let a restarting learner come back before a batch is sent (rather than losing the batch)."""
        deadline = time.monotonic() + timeout_s
        while self.learner.process.state in ("starting", "restarting", "syncing") and time.monotonic() < deadline:
            await asyncio.sleep(0.5)

    def states(self) -> dict[str, str]:
        return {w.name: w.process.state for w in [*self.samplers, self.learner]}
