"""Calls from the front end to a worker's verbs (msgpack over HTTP), with timeouts and error mapping.

A worker that is down or restarting answers 503 at once (no connection attempt, no hang); a worker's
4xx passes through with its code and message; a worker's 5xx becomes 502 with its message.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel

from grpo_server.errors import ApiError, Unavailable, WorkerFailed
from grpo_server.supervisor import WorkerProcess
from grpo_server.wire import MSGPACK, pack, unpack

T = TypeVar("T", bound=BaseModel)


class WorkerClient:
    def __init__(self, process: WorkerProcess, session: aiohttp.ClientSession, timeout_s: float):
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
        try:
            async with self.session.post(
                f"{self.process.url}/{verb}", data=pack(body), headers={"Content-Type": MSGPACK},
                timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s),
            ) as response:
                payload = unpack(await response.read())
                status = response.status
        except asyncio.TimeoutError as exc:
            raise Unavailable(f"{self.name} did not answer {verb} within {timeout_s or self.timeout_s:.0f} s",
                              code="worker_timeout") from exc
        except aiohttp.ClientError as exc:
            raise Unavailable(f"{self.name} is unreachable: {exc}", code="worker_unavailable") from exc
        if status >= 400:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            message = f"{self.name}: {error.get('message', payload)}"
            if status >= 500:
                raise WorkerFailed(message)
            raise ApiError(message, code=error.get("code", "bad_request"), status=status)
        return response_model.model_validate(payload) if response_model else payload
