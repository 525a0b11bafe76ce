"""Worker processes (sampler replicas, learner): start, wait healthy, watch, restart, stop.

Each worker runs in its own process group, so stopping it also stops what it spawned (vLLM's engine
core). A worker asks for PR_SET_PDEATHSIG itself, first thing (grpo_server/protocol/process_exit.py says why
not here), so it dies with the front end even when the front end is killed -9: Ctrl-C or a crash leaves no
orphans. Its stdout and stderr come through a pipe into its log, which rotates by size, and is only ever read
from its tail (grpo_server/workers/worker_logs.py says why).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp

from grpo_server.protocol.errors import Unavailable
from grpo_server.protocol.process_exit import SUPERVISOR_PID_ENV
from grpo_server.workers.worker_logs import LogPump, RotatingLog, tail_lines

log = logging.getLogger(__name__)

MAX_CRASHES = 5  # the MAX_CRASHES-th crash within CRASH_WINDOW_S marks the worker failed, not restarted
CRASH_WINDOW_S = 600.0
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STOP_GRACE_S = 15.0
HEALTH_PROGRESS_S = 15.0  # while a worker starts, how often the front end's log says it is still waiting
RESYNC_RETRY_S = 10.0  # a restarted worker's re-sync that failed for a reason that passes (`_resync`), again after
DRAIN_S = 3.0  # after a worker exits, how long its last output may take to reach the log before it is read


class WorkerProcess:
    """One supervised worker. `state` is starting | ready | restarting | syncing | failed | stopped."""

    def __init__(self, name: str, argv: list[str], url: str, log_path: Path, *,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 900.0,
                 on_restart: Callable[[], Awaitable[None]] | None = None):
        self.name = name
        self.argv = argv
        self.url = url
        self.log_path = log_path
        self._log = RotatingLog(log_path)
        self._pump: LogPump | None = None
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.on_restart = on_restart
        self.state = "stopped"
        self.last_error: str | None = None
        self._proc: subprocess.Popen | None = None
        self._crashes: deque[float] = deque()
        self._watcher: asyncio.Task | None = None
        self._stopping = False

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self) -> None:
        self._stopping = False
        await self._spawn_and_wait()
        self.state = "ready"
        self._watcher = asyncio.create_task(self._watch(), name=f"watch-{self.name}")

    async def _spawn_and_wait(self) -> None:
        self.state = "starting"
        self._proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # Unbuffered: a worker's prints reach its log (and the start-up progress lines) at once.
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {}), SUPERVISOR_PID_ENV: str(os.getpid())},
            start_new_session=True,  # its own process group, stopped whole (`_kill_group`)
        )
        # Before the pump starts: the worker's first bytes wait in the pipe, so this line comes first.
        self._log.write(f"--- {self.name}: started pid {self._proc.pid} at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n"
                        .encode())
        self._pump = LogPump(self._proc.stdout, self._log, self.name)
        log.info("%s: started pid %s, log %s", self.name, self._proc.pid, self.log_path)
        started = time.monotonic()
        await self._wait_healthy()
        log.info("%s: healthy at %s after %.1f s", self.name, self.url, time.monotonic() - started)

    async def _wait_healthy(self) -> None:
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        next_report = started + HEALTH_PROGRESS_S
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if time.monotonic() >= next_report:  # a model load takes minutes: say it is not stuck
                    next_report += HEALTH_PROGRESS_S
                    log.info("%s: waiting for health, %.0f s of %.0f s; its log's last line: %s", self.name,
                             time.monotonic() - started, self.startup_timeout_s, self.tail_log(1)[-200:] or "(empty)")
                if self._proc.poll() is not None:
                    await self._drained()
                    raise RuntimeError(
                        f"{self.name} exited with code {self._proc.returncode} during start-up; "
                        f"last log lines:\n{self.tail_log()}"
                    )
                try:
                    async with session.get(self.url + "/health") as response:
                        if response.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {self.startup_timeout_s:.0f} s; log {self.log_path}")

    async def _watch(self) -> None:
        while not self._stopping:
            code = await asyncio.to_thread(self._proc.wait)
            if self._stopping:
                return
            self._kill_leftovers()  # what the dead worker spawned (vLLM's engine core) goes with it
            await self._drained()  # its last words (a traceback) are in the log before the log is read
            self.last_error = f"exited with code {code}"
            log.error("%s: %s; last log lines:\n%s", self.name, self.last_error, self.tail_log())
            now = time.monotonic()
            self._crashes.append(now)
            while self._crashes and now - self._crashes[0] > CRASH_WINDOW_S:
                self._crashes.popleft()
            if len(self._crashes) >= MAX_CRASHES:  # restarted after the first MAX_CRASHES - 1 only
                self.state = "failed"
                log.error("%s: crashed %d times in %.0f s, not restarting", self.name,
                          len(self._crashes), CRASH_WINDOW_S)
                return
            self.state = "restarting"
            await asyncio.sleep(BACKOFF_S[min(len(self._crashes) - 1, len(BACKOFF_S) - 1)])
            try:
                await self._spawn_and_wait()
                # "syncing": only the front end's re-sync calls (syncing_ok) reach it; clients wait.
                self.state = "syncing"
                if self.on_restart is not None:
                    await self._resync()
                self.state = "ready"
            except Exception as exc:  # reported in state and log; the loop tries again
                self.last_error = f"restart failed: {exc}"
                log.error("%s: %s", self.name, self.last_error)
                self._kill_group(signal.SIGKILL)

    async def _resync(self) -> None:
        """The restarted worker's re-sync (`on_restart`), tried again every RESYNC_RETRY_S while it fails for a
        reason that passes (a 503: the worker's disk is full) and the worker lives. Killing a healthy worker that
        cannot write would not give it space: the chaos soak saw a learner restarted into a full disk killed and
        started five times, then given up on for good."""
        while True:
            try:
                await self.on_restart()
                return
            except Unavailable as exc:
                if self._proc.poll() is not None or self._stopping:
                    raise
                self.last_error = f"re-sync waits: {exc.message}"
                log.warning("%s: re-sync failed (%s), tried again in %.0f s", self.name, exc.message, RESYNC_RETRY_S)
                await asyncio.sleep(RESYNC_RETRY_S)

    def tail_log(self, lines: int = 20) -> str:
        """The log's last lines, read from its end only (it may hold megabytes of a long run)."""
        return tail_lines(self.log_path, lines)

    async def _drained(self, timeout_s: float = DRAIN_S) -> None:
        """Wait (a little) until the exited worker's output is all in its log: the pipe ends once every process
        of its group has closed it."""
        if self._pump is not None:
            await asyncio.to_thread(self._pump.join, timeout_s)

    def _kill_group(self, sig: int) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def _kill_leftovers(self) -> None:
        """Children of the worker share its process group (setsid at spawn): kill the whole group."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def stop(self) -> None:
        self._stopping = True
        if self._proc is not None and self._proc.poll() is None:
            self._kill_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(self._proc.wait), STOP_GRACE_S)
            except asyncio.TimeoutError:
                self._kill_group(signal.SIGKILL)
                await asyncio.to_thread(self._proc.wait)
        self._kill_leftovers()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await self._drained()
        self._log.close()
        self.state = "stopped"
