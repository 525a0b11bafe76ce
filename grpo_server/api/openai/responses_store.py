"""Stored responses, for `previous_response_id`: each keeps its conversation as chat messages (its previous
response's, its input, its output: not its instructions, which OpenAI does not carry over), so a follow-up is
that conversation + its own input, with no chain to walk.

Bounded as episodes are (the server's `max_pending_episodes` per experiment, four times that in all, and
`episode_ttl_s` after it was stored) and never refused: the oldest are dropped first, and a dropped, expired,
unknown or other experiment's id is the same 400 `previous_response_not_found` (OpenAI's answer; names do not
leak). An experiment deleted and created again under its name does not see its predecessor's responses.
In memory: a restart forgets them, as it forgets pending episodes.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from grpo_server.api_models import ChatMessage
from grpo_server.protocol.errors import BadRequest


@dataclass(frozen=True)
class StoredResponse:
    experiment: str
    incarnation: float  # the experiment's created_at: another experiment of the same name is another
    messages: tuple[ChatMessage, ...]
    stored_at: float


class ResponseStore:
    def __init__(self, per_experiment: int, total: int, ttl_s: float):
        self.per_experiment = per_experiment
        self.total = total
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._count: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def count(self, experiment: str) -> int:
        return self._count[experiment]

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._expire(stored.stored_at)
        if self._count[stored.experiment] >= self.per_experiment:  # its own oldest goes
            oldest = next(k for k, v in self._items.items() if v.experiment == stored.experiment)
            self._drop(oldest)
        while len(self._items) >= self.total:
            self._drop(next(iter(self._items)))
        self._items[response_id] = stored
        self._count[stored.experiment] += 1

    def get(self, experiment: str, incarnation: float, response_id: str) -> StoredResponse:
        self._expire(time.monotonic())
        stored = self._items.get(response_id)
        if stored is None or stored.experiment != experiment or stored.incarnation != incarnation:
            raise BadRequest(f"Previous response with id {response_id!r} not found (unknown, expired, stored "
                             "with store: false, or another experiment's)", code="previous_response_not_found")
        return stored

    def _drop(self, response_id: str) -> None:
        stored = self._items.pop(response_id)
        self._count[stored.experiment] -= 1
        if not self._count[stored.experiment]:
            del self._count[stored.experiment]

    def _expire(self, now: float) -> None:
        while self._items:
            response_id, stored = next(iter(self._items.items()))
            if now - stored.stored_at < self.ttl_s:
                break
            self._drop(response_id)
