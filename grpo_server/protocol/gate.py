"""An asyncio readers-writer lock that is phase-fair (used by the sampler and by the front end)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator


class Gate:
    """Many shared holders at once, or one exclusive holder alone, in alternating phases:
      * an exclusive waiter goes before shared holders that arrive after it, so a stream of shared holders cannot
        starve it;
      * shared holders that waited through an exclusive hold go before the next exclusive waiter, so a stream of
        exclusive holders cannot starve them either: a shared holder waits out at most one exclusive hold (and the
        shared holders ahead of it).
    (Brandenburg and Anderson's phase-fair readers-writer lock.) The writer-first lock this replaces let one
    tenant's stream of exclusive holds (prompt-logprob scores, train steps) hold every other tenant's shared
    calls back for as long as the stream lasted.

    The vLLM sampler keeps its prompt-logprob requests out of other requests' batches with it
    (sampler/vllm_engine.py); the front end lets sampling and training take turns with it
    (grpo_server/workers/turns.py)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive waiters
        self._holds_ended = 0  # exclusive holds ended so far: a shared waiter's phase
        self._shared_waiting: Counter[int] = Counter()  # shared waiters by the phase they arrived in

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            phase = self._holds_ended
            self._shared_waiting[phase] += 1
            try:
                # In, unless an exclusive holder holds or one waits that came before this phase ended.
                await self._cond.wait_for(lambda: not self._exclusive
                                          and (not self._waiting or phase < self._holds_ended))
            finally:
                self._shared_waiting[phase] -= 1
                if not self._shared_waiting[phase]:
                    del self._shared_waiting[phase]
                self._cond.notify_all()  # a cancelled waiter may be the last an exclusive waiter waited for
            self._shared += 1
        try:
            yield
        finally:
            await self._release_shared()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        await self._acquire_exclusive()
        try:
            yield
        finally:
            await self._release_exclusive()

    def _shared_owed(self) -> bool:
        """Shared waiters that waited through an exclusive hold: they go first."""
        return any(phase < self._holds_ended for phase in self._shared_waiting)

    async def _acquire_exclusive(self) -> None:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and not self._shared
                                          and not self._shared_owed())
            finally:
                self._waiting -= 1
                self._cond.notify_all()  # a cancelled waiter must not keep generations held back
            self._exclusive = True

    async def _release_exclusive(self) -> None:
        async with self._cond:
            self._exclusive = False
            self._holds_ended += 1
            self._cond.notify_all()

    async def _release_shared(self) -> None:
        async with self._cond:
            self._shared -= 1
            self._cond.notify_all()
