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

A decoder written in Python (a codec's `in_process`: the Tinker protobuf) runs in a process of its own instead
(`PROCESSES`), under the same slots: on a thread it held the GIL for its whole run, and the event loop, which
must take the GIL back after every socket call, waited its 5 ms switch interval each time. In the hostile-tenant
benchmark one key's bodies kept that thread busy 87% of the time (py-spy), and another key's feedback took 34 ms
instead of 3. The decoder and its body go to the process pickled (a module-level function and bytes) and its
result comes back pickled; a body over the bounds stops early there as here.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, TypeVar

from grpo_server.protocol.errors import TooManyRequests, Unavailable

T = TypeVar("T")
THREADS = 2
# One: a key decodes one body at a time anyway (its slot), and on the 2-core box a second process would only take
# the other core from the samplers and the learner. About 30 MB: it imports the decoders and pydantic, no more.
PROCESSES = 1
# Unblocked by the GIL, one key's decode flood took a core from the sampler: a neighbour's completions went from
# 5.1x to 9.6x their figure alone in the hostile-tenant benchmark while its feedback went from 11x to 2x.
DECODER_NICENESS = 10
MAX_WAITING = 8  # bodies of one key waiting for its slot


def _lower_priority() -> None:
    """The decoding process yields the cores to the samplers, the learner and the event loop (bulk work for one key
    at a time; any user may lower its own priority). With the kernel's autogroups (sched_autogroup_enabled, the
    default of desktop and many server kernels), a nice value only ranks the processes of one session, and every
    session shares the CPU equally: the workers each have a session of their own (workers/processes.py), so a
    decoder at nice 10 in the front end's session still took 0.8 of a core from the learner, whose step then took
    16 s instead of 0.7. So it takes a session of its own and lowers that session's weight too (best effort: a
    kernel without autogroups has no /proc/self/autogroup; writing it may be refused for a moment, EAGAIN)."""
    os.nice(DECODER_NICENESS)
    os.setsid()
    for _ in range(20):
        try:
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(DECODER_NICENESS))
            return
        except BlockingIOError:  # the kernel takes one change of any autogroup per 100 ms from unprivileged users
            time.sleep(0.05)
        except OSError:
            return


class BodyPool:
    def __init__(self, threads: int = THREADS, max_waiting: int = MAX_WAITING, processes: int = PROCESSES):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="body-decode")
        self._processes = processes
        self._process_pool: ProcessPoolExecutor | None = None  # `start_process`
        self._starting = asyncio.Lock()
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

    async def run(self, owner: str, decode: Callable[[], T], in_process: bool = False) -> T:
        """`decode()` on the pool, in `owner`'s slot (429 while `owner` has `max_waiting` bodies here); with
        `in_process`, in the pool's process (`decode` must then pickle: a module-level function, a partial of one)."""
        self.check(owner)
        self._waiting[owner] += 1
        slot = self._slots.setdefault(owner, asyncio.Lock())
        try:
            async with slot:
                if in_process:
                    return await self._in_process(decode)
                return await asyncio.get_running_loop().run_in_executor(self._executor, decode)
        finally:
            self._waiting[owner] -= 1
            if not self._waiting[owner]:  # an idle key holds nothing here
                del self._waiting[owner]
                self._slots.pop(owner, None)

    async def start_process(self) -> ProcessPoolExecutor:
        """The pool's process, started if it is not running: on a thread, since starting it (the forkserver, then a
        fork of it that imports the decoders) takes a few tenths of a second, which on the event loop stalled every
        request. The server calls it at start; a body finds it running."""
        async with self._starting:
            if self._process_pool is None:
                self._process_pool = await asyncio.to_thread(self._new_process_pool)
            return self._process_pool

    def _new_process_pool(self) -> ProcessPoolExecutor:
        # forkserver: a clean process forked from a server started for it, not a fork of this threaded one.
        pool = ProcessPoolExecutor(self._processes, initializer=_lower_priority,
                                   mp_context=multiprocessing.get_context("forkserver"))
        pool.submit(int).result()  # its processes start at the first task
        return pool

    async def _in_process(self, decode: Callable[[], T]) -> T:
        pool = await self.start_process()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, decode)
        except BrokenProcessPool as exc:  # the process died (killed, out of memory): a new one for the next body
            if self._process_pool is pool:
                self._process_pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise Unavailable("the body decoder's process ended while decoding this body; send it again",
                              code="decoder_restarted") from exc

    def close(self) -> None:
        """Blocking (call it on a thread): the decoder's process is waited for, so none outlives the server."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._process_pool is not None:
            self._process_pool.shutdown(wait=True, cancel_futures=True)
