"""Background tasks with an owner: each is kept until it ends (asyncio holds only a weak reference), an
error it ends with is logged and handed to the owner instead of vanishing, and `stop` cancels and awaits
them all (or, for short work that must not be cut off, awaits it)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

log = logging.getLogger(__name__)


class OwnedTasks:
    def __init__(self, owner: str, on_error: Callable[[str], None] | None = None):
        self.owner = owner
        self.on_error = on_error
        self._tasks: dict[asyncio.Task, bool] = {}  # task -> finish it (rather than cancel it) on stop

    def spawn(self, work: Coroutine[Any, Any, Any], name: str, finish_on_stop: bool = False) -> asyncio.Task:
        task = asyncio.create_task(work, name=name)
        self._tasks[task] = finish_on_stop
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("%s: %s failed", self.owner, task.get_name(), exc_info=exc)
        if self.on_error is not None:
            self.on_error(f"{task.get_name()} failed: {type(exc).__name__}: {exc}")

    def __len__(self) -> int:
        return len(self._tasks)

    async def stop(self) -> None:
        tasks = list(self._tasks.items())
        for task, finish in tasks:
            if not finish:
                task.cancel()
        await asyncio.gather(*(task for task, _ in tasks), return_exceptions=True)
