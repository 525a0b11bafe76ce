"""How long the front end waits for a worker's verb, told to the worker, so that a verb nobody waits for any more is
not run.

The front end gives up on a verb after its timeout (grpo_server/workers/pool.py: 503 `worker_timeout` to its
client). A worker that was paused meanwhile (SIGSTOP, a stalled host, swap) still holds the request, and would run
it when it goes on: a train step the front end then trains again from its queue, or a Tinker `optim_step` whose
client was told it failed. So every verb carries its deadline (`HEADER`: seconds since the epoch, the front end's
clock), and the learner checks it when the verb's turn comes (learner/app.py, under its lock), refusing one whose
caller is gone (503 `deadline_passed`; nobody reads it). A verb that starts in time and ends late is still run:
a train step's retry is then answered from the step already taken (learner/trainer.py, by journal position).

Hosts apart: the deadline is wall-clock time, so the workers' clocks must agree with the front end's to within the
timeouts' margin (NTP keeps them within milliseconds).
"""

from __future__ import annotations

import contextvars
import time
from typing import Awaitable, Callable

from aiohttp import web

from grpo_server.protocol.errors import Unavailable

HEADER = "X-Grpo-Deadline"
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("verb_deadline", default=None)


def deadline_headers(timeout_s: float) -> dict[str, str]:
    """The header of a verb sent now that its caller waits `timeout_s` for."""
    return {HEADER: f"{time.time() + timeout_s:.3f}"}


@web.middleware
async def deadline_middleware(request: web.Request,
                              handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """The request's deadline, bound while its verb runs (absent or unreadable: none)."""
    try:
        deadline = float(request.headers[HEADER])
    except (KeyError, ValueError):
        deadline = None
    token = _deadline.set(deadline)
    try:
        return await handler(request)
    finally:
        _deadline.reset(token)


def check_deadline(verb: str) -> None:
    """Refuse to start `verb` once its caller has stopped waiting for it."""
    deadline = _deadline.get()
    if deadline is not None and time.time() > deadline:
        raise Unavailable(f"{verb}: the caller stopped waiting {time.time() - deadline:.1f} s ago; not run",
                          code="deadline_passed")
