"""Where large request bodies are decoded: threads of their own, a slot per key.

Decoding and validating a body of megabytes is CPU work (JSON or msgpack and pydantic: about a second per 8 MiB of
numbers; a Tinker protobuf forward_backward: about 1.2 s per MiB), so it cannot run on the event loop. On asyncio's
shared default executor it queued behind, and ahead of, everything else that runs there (tokenizing, journal
writes, the Tinker registry), and one key's flood of bodies took every thread. Here:
- the bodies have a pool of their own (`THREADS`), so nothing else waits for them;
- each key decodes one body at a time (its slot): a key's flood queues behind itself, and another key's body
  takes the next free thread;
- a key with `MAX_WAITING` bodies waiting already gets a 429 at once, so a flood holds no memory here either.
Callers are past auth and scope (api/edge.py `guarded`): an unknown key never reaches a thread.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from grpo_server.protocol.errors import TooManyRequests

T = TypeVar("T")
THREADS = 2
MAX_WAITING = 8  # bodies of one key waiting for its slot


class BodyPool:
    def __init__(self, threads: int = THREADS, max_waiting: int = MAX_WAITING):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="body-decode")
        self.max_waiting = max_waiting
        self._slots: dict[str, asyncio.Lock] = {}
        self._waiting: defaultdict[str, int] = defaultdict(int)  # owner -> its bodies here (decoding or waiting)

    def waiting(self, owner: str) -> int:
        return self._waiting.get(owner, 0)

    def check(self, owner: str) -> None:
        """429 while `owner` has `max_waiting` bodies here: asked before a large body is read off the socket too,
        so a refused flood costs no reading."""
        if self._waiting.get(owner, 0) >= self.max_waiting:
            raise TooManyRequests(f"{self._waiting[owner]} large bodies of this key are being decoded; send fewer "
                                  "at once", code="too_many_bodies", retry_after=1.0)

    async def run(self, owner: str, decode: Callable[[], T]) -> T:
        """`decode()` on the pool, in `owner`'s slot (429 while `owner` has `max_waiting` bodies here)."""
        self.check(owner)
        self._waiting[owner] += 1
        slot = self._slots.setdefault(owner, asyncio.Lock())
        try:
            async with slot:
                return await asyncio.get_running_loop().run_in_executor(self._executor, decode)
        finally:
            self._waiting[owner] -= 1
            if not self._waiting[owner]:  # an idle key holds nothing here
                del self._waiting[owner]
                self._slots.pop(owner, None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
