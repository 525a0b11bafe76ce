"""Which experiment's request enters the vLLM engine next: seats by experiment, with room kept for the light ones.

vLLM's scheduler runs at most `max_num_seqs` sequences and never preempts a running one for a waiting one (with
`scheduling_policy="priority"` it preempts only when KV blocks run out: vllm/v1/core/sched/scheduler.py breaks out
of its waiting loop once `running` is full). So a tenant whose long requests fill the batch (`n` = 64 streams of 256
tokens) made every other tenant wait for them to end: in the hostile-tenant benchmark, a neighbour's 8-token
completion waited up to 104 s. Priorities order the waiting queue only, and nobody waits there once the batch is
full of one tenant's sequences.

So the engine gets `max_num_seqs + reserved_seqs` slots, and this admission hands them out:
- any request may take a seat while at most `max_num_seqs` are taken: one experiment alone gets the batch it was
  configured for, no smaller;
- the last `reserved_seqs` seats go only to an experiment that holds at most `reserved_seqs` with the request: a
  light tenant (a group of n = 4, a turn of an episode) finds a seat at once, however full the heavy ones keep
  the rest;
- waiting requests are seated fewest-seats-held first, then by arrival (max-min fair: the experiment using least
  goes next), and the first of that order that does not fit holds the shared seats for itself, so a large request
  is not passed forever by small ones;
- while another experiment samples (`contended`: a request of another waiting or running, or done lately), an
  experiment holds at most `beside_others` seats (one request of more, only when it holds none). Seats alone do
  not make a neighbour fast: on CPU an engine step's time grows with its batch (SmolLM2, one engine thread: 68 ms
  a step for 1 sequence, 306 ms for 64, merged; 88 and 365 ms through LoRA), and each of the neighbour's tokens
  waits for a whole step. So the heavy experiment's batch shrinks while someone else samples, and a neighbour's
  8-token group no longer takes 5x its time alone. vllm_engine.py sends a larger n as requests of at most
  `beside_others`, so that a large group is not one unsplittable block;
- within one experiment, requests go in arrival order, except that a score's one-token parts (`background`) wait
  behind the experiment's completions that arrive meanwhile (`_enqueue`).

Every sequence of a request takes a seat (vLLM fans `n` out into n requests). A request larger than the shared
seats takes them all once the engine is empty. The front end's per-experiment priority (GenerateRequest.priority)
still orders whatever vLLM has waiting."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    tenant: str
    seats: int
    arrival: int
    background: bool = False
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FairAdmission:
    def __init__(self, shared: int, reserved: int, beside_others: int | None = None,
                 contended: Callable[[str], bool] = lambda tenant: False) -> None:
        self.shared = shared  # seats any request may take (the config's max_num_seqs)
        self.reserved = reserved  # seats beyond those, for experiments that hold few
        self.beside_others = beside_others or shared  # seats one experiment may hold while another samples
        self._contended = contended  # whether another experiment than this one samples now
        self.held: Counter[str] = Counter()  # seats taken, by experiment ("" for the base model)
        self.taken = 0
        # Waiting requests by experiment, each queue in arrival order: choosing the next is a look at the heads
        # (one per experiment waiting), not a sort of every request waiting.
        self._queues: dict[str, deque[_Waiter]] = {}
        self._arrivals = itertools.count()

    @property
    def capacity(self) -> int:
        """The engine's max_num_seqs."""
        return self.shared + self.reserved

    def waiting(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    @contextlib.asynccontextmanager
    async def seats(self, tenant: str, count: int, background: bool = False) -> AsyncIterator[None]:
        """Hold `count` seats for `tenant`'s request while it runs in the engine. A `background` request waits
        behind the tenant's other requests that arrive while it waits (see `_enqueue`)."""
        waiter = _Waiter(tenant, max(1, min(count, self.shared)), next(self._arrivals), background)
        self._enqueue(waiter)
        self._admit()
        if not waiter.admitted.done():
            try:
                await waiter.admitted
            except BaseException:
                if self._dequeue(waiter):
                    self._admit()  # a head of the line that left may have held the others back
                elif waiter.admitted.done() and not waiter.admitted.cancelled():
                    self._release(waiter)  # seated just as it was cancelled
                raise
        try:
            yield
        finally:
            self._release(waiter)

    def _enqueue(self, waiter: _Waiter) -> None:
        """Into its tenant's queue: last, or, if it is not `background`, before the tenant's background waiters.
        A score at temperature is one one-seat request per completion token (vllm_engine.py `_score_tempered`):
        a push check queues dozens of them, and beside another experiment (at most `beside_others` seats held) the
        experiment's next completion waited behind all of them, about a second, at every push of the hostile-tenant
        benchmark. Background waiters keep their order among themselves, and only their own experiment's requests
        pass them: an experiment that never pauses its completions delays its own scores, nobody else's."""
        queue = self._queues.setdefault(waiter.tenant, deque())
        if not waiter.background:
            for index, queued in enumerate(queue):
                if queued.background:
                    queue.insert(index, waiter)
                    return
        queue.append(waiter)

    def _dequeue(self, waiter: _Waiter) -> bool:
        """Take `waiter` out of its queue; False if it was not there (seated, or dropped by `_admit`)."""
        queue = self._queues.get(waiter.tenant)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._queues[waiter.tenant]
        return True

    def _release(self, waiter: _Waiter) -> None:
        self.taken -= waiter.seats
        self.held[waiter.tenant] -= waiter.seats
        if self.held[waiter.tenant] <= 0:
            del self.held[waiter.tenant]
        self._admit()

    def _capped(self, waiter: _Waiter) -> bool:
        """Over its share beside another experiment that samples (re-checked at each of its own releases)."""
        held = self.held[waiter.tenant]
        return held > 0 and held + waiter.seats > self.beside_others and self._contended(waiter.tenant)

    def _fits(self, waiter: _Waiter, shared_open: bool) -> bool:
        after = self.taken + waiter.seats
        if shared_open and (after <= self.shared or self.taken == 0):
            return True
        return self.held[waiter.tenant] + waiter.seats <= self.reserved and after <= self.capacity

    def _admit(self) -> None:
        """Seat the waiting requests that fit, in fair order (the module docstring): each time the head of the
        experiment holding fewest seats (the earliest among equals), until no head fits."""
        shared_open = True  # until a head of the order does not fit the shared seats: they are kept for it
        passed: set[str] = set()  # experiments whose head does not fit now
        while True:
            heads = [queue[0] for tenant, queue in self._queues.items() if tenant not in passed]
            if not heads:
                return
            waiter = min(heads, key=lambda w: (self.held[w.tenant], w.arrival))
            if waiter.admitted.done():  # cancelled while it waited; `seats` has not run its cleanup yet
                self._dequeue(waiter)
                continue
            if self._capped(waiter):  # waits for its own seats to end, not for free ones: holds nothing back
                passed.add(waiter.tenant)
                continue
            if not self._fits(waiter, shared_open):
                shared_open = False
                passed.add(waiter.tenant)
                continue
            self._dequeue(waiter)
            self.taken += waiter.seats
            self.held[waiter.tenant] += waiter.seats
            waiter.admitted.set_result(None)
