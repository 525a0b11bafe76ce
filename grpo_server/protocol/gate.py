"""An asyncio readers-writer lock whose writer goes first (used by the sampler and by the front end)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Gate:
    """Many shared holders at once, or one exclusive holder alone. An exclusive waiter goes first: new
    shared holders wait behind it, so a stream of shared holders cannot starve it. The vLLM sampler keeps
    its prompt-logprob requests out of other requests' batches with it (sampler/vllm_engine.py); the front
    end lets sampling and training take turns with it (grpo_server/workers/pool.py)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
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

    async def _acquire_exclusive(self) -> None:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._waiting -= 1
                self._cond.notify_all()  # a cancelled waiter must not keep generations held back
            self._exclusive = True

    async def _release_exclusive(self) -> None:
        async with self._cond:
            self._exclusive = False
            self._cond.notify_all()

    async def _release_shared(self) -> None:
        async with self._cond:
            self._shared -= 1
            self._cond.notify_all()
