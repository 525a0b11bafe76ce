"""A worker the front end connects to but did not start (`grpo-server serve --role frontend`, e.g. one
docker-compose service per sampler and one for the learner). Same interface as `processes.WorkerProcess`;
its state comes from polling the worker's `/health` instead of watching a child process.

Restarting the worker is someone else's job (compose's restart policy). What stays the front end's: wait
for the worker at start, take it out of rotation while it does not answer, and when it answers again run
`reset` (forget what the worker holds from before: it may have outlived an earlier front end) and
`on_restart` (load the live state into it) before clients reach it again, as after a local restart.

A restart is seen as a gap in the health answers: a worker only listens once its model is loaded, which
takes far longer than a few poll intervals, so a restart between two polls cannot go unnoticed.

The polls go through the front end's worker session, which sends the workers' secret: a worker that
refuses it (401: the processes of a split deployment were given different secrets) fails the start at once,
naming the fix, rather than after the whole start-up timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import aiohttp

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 5.0  # the workers answer /health while they compute (their event loops stay free)
MISSES_BEFORE_DOWN = 3  # one slow answer on a loaded host is not an outage

Hook = Callable[[], Awaitable[None]]


class RemoteWorker:
    """`state`: starting | syncing | ready | down | stopped (see `pool.Worker`)."""

    def __init__(self, name: str, url: str, session: aiohttp.ClientSession, *, startup_timeout_s: float,
                 reset: Hook | None = None, on_restart: Hook | None = None):
        self.name = name
        self.url = url
        self.session = session
        self.startup_timeout_s = startup_timeout_s
        self.reset = reset
        self.on_restart = on_restart
        self.state = "stopped"
        self.last_error: str | None = None
        self.refused = False  # the last poll was a 401: the worker holds another secret
        self._watcher: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None:
        """Wait until the worker answers (it may still be loading its model), reset it, then serve."""
        self.state = "starting"
        deadline = time.monotonic() + self.startup_timeout_s
        while not await self._healthy():
            if self.refused:
                raise PermissionError(f"{self.name} at {self.url}: {self.last_error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} at {self.url} not healthy after {self.startup_timeout_s:.0f} s "
                                   f"({self.last_error}); is it running, and is the URL right?")
            await asyncio.sleep(POLL_INTERVAL_S)
        log.info("%s: healthy at %s", self.name, self.url)
        self.state = "syncing"
        if self.reset is not None:
            await self.reset()
        self.state = "ready"
        self._watcher = asyncio.create_task(self._watch(), name=f"watch-{self.name}")

    async def _healthy(self) -> bool:
        self.refused = False
        try:
            async with self.session.get(self.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                self.refused = response.status == 401
                if response.status == 200:
                    return True
                self.last_error = f"/health answered {response.status}"
                if self.refused:
                    self.last_error += (" (unauthorized: it holds another worker secret than this front end; give "
                                        "every process the same GRPO_SERVER_WORKER_SECRET)")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.last_error = f"unreachable: {type(exc).__name__}: {exc}"
        return False

    async def _watch(self) -> None:
        misses = 0
        while True:
            await asyncio.sleep(POLL_INTERVAL_S)
            if not await self._healthy():
                misses += 1
                if misses >= MISSES_BEFORE_DOWN and self.state == "ready":
                    self.state = "down"
                    log.error("%s: out of rotation, %s", self.name, self.last_error)
                continue
            misses = 0
            if self.state == "down":
                await self._resync()

    async def _resync(self) -> None:
        self.state = "syncing"  # only the re-sync's calls (syncing_ok) reach it; clients get 503 meanwhile
        log.info("%s: answers again, re-syncing", self.name)
        try:
            if self.reset is not None:
                await self.reset()
            if self.on_restart is not None:
                await self.on_restart()
        except Exception as exc:  # reported in state and log; the next poll tries again
            self.last_error = f"re-sync failed: {exc}"
            log.error("%s: %s", self.name, self.last_error)
            self.state = "down"
            return
        self.state = "ready"
        log.info("%s: back in rotation", self.name)

    async def stop(self) -> None:
        """Stop watching; the worker itself runs on (it is not ours to stop)."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        self.state = "stopped"
