"""Calls from the front end to a worker's verbs (msgpack over HTTP), with timeouts and error mapping.

A worker that is down or restarting answers 503 at once (no connection attempt, no hang); a worker's
4xx passes through with its code and message; a worker's 5xx becomes 502 with its message. A connection
that fails (refused, reset, dropped before the answer) is a `WorkerUnreachable` (503): the worker died or
is not there, so a caller whose verb has no side effects may send it to another replica.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, TypeVar

import aiohttp
from pydantic import BaseModel

from grpo_server.errors import ApiError, Unavailable, WorkerFailed
from grpo_server.wire import MSGPACK, pack, unpack

T = TypeVar("T", bound=BaseModel)


class Worker(Protocol):
    """What the front end needs of a worker, whether it started the process (`supervisor.WorkerProcess`)
    or only connects to it (`remote_worker.RemoteWorker`). `state` is starting | ready | syncing (back
    after a restart, being re-synced: only re-sync calls reach it) | restarting | down | failed | stopped."""

    name: str
    url: str
    state: str
    last_error: str | None

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class WorkerUnreachable(Unavailable):
    """The connection failed or dropped before an answer: the worker died or is not there (yet)."""


class WorkerClient:
    def __init__(self, process: Worker, session: aiohttp.ClientSession, timeout_s: float):
        self.process = process
        self.session = session
        self.timeout_s = timeout_s

    @property
    def name(self) -> str:
        return self.process.name

    def _check_up(self, syncing_ok: bool = False) -> None:
        if not (self.process.ready or (syncing_ok and self.process.state == "syncing")):
            raise Unavailable(f"{self.name} is {self.process.state}", retry_after=5.0,
                              code="worker_unavailable")

    async def call(self, verb: str, body: BaseModel | dict, response_model: type[T] | None = None,
                   timeout_s: float | None = None, syncing_ok: bool = False) -> Any:
        """One verb. `syncing_ok`: the call re-syncs a restarted worker, so it may reach it before clients do."""
        self._check_up(syncing_ok)
        return await self._request("POST", verb, pack(body), response_model, timeout_s)

    async def get(self, path: str, response_model: type[T] | None = None, syncing_ok: bool = False) -> Any:
        """A read-only GET (`health`, the learner's `status`)."""
        self._check_up(syncing_ok)
        return await self._request("GET", path, None, response_model, None)

    async def _request(self, method: str, path: str, data: bytes | None, response_model: type[T] | None,
                       timeout_s: float | None) -> Any:
        timeout_s = timeout_s or self.timeout_s
        try:
            async with self.session.request(
                method, f"{self.process.url}/{path}", data=data, headers={"Content-Type": MSGPACK},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                payload = unpack(await response.read())
                status = response.status
        except asyncio.TimeoutError as exc:
            raise Unavailable(f"{self.name} did not answer {path} within {timeout_s:.0f} s",
                              code="worker_timeout") from exc
        except aiohttp.ClientConnectionError as exc:  # refused, reset (a reused connection to a dead worker), dropped
            raise WorkerUnreachable(f"{self.name} is unreachable: {exc}", code="worker_unavailable") from exc
        except aiohttp.ClientError as exc:
            raise Unavailable(f"{self.name} is unreachable: {exc}", code="worker_unavailable") from exc
        if status >= 400:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            message = f"{self.name}: {error.get('message', payload)}"
            if status >= 500:
                raise WorkerFailed(message)
            raise ApiError(message, code=error.get("code", "bad_request"), status=status)
        return response_model.model_validate(payload) if response_model else payload
