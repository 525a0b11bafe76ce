"""Turns on the engine's weights: which weight state the vLLM engine holds, and whose requests run in it.

A state is what the linear weights hold: None for the base model's (a request under an adapter then goes
through LoRA) or one adapter key merged in (sampler/merged_serving.py). Each request needs one state and
may run only while the engine holds it; the state may change only while no request runs. So the states
take turns:

- requests needing the state held now are let in at once: vLLM batches them together;
- the others wait, and the states are served in the order their oldest waiter arrived (FIFO); a state
  nobody waits for never gets a turn;
- a turn ends when its running requests are done and either nobody waits for its state any more, or its
  budget is spent while another state waits. Past the budget, new arrivals for the current state wait for
  its next turn, so a steady stream of requests for one state cannot starve the others.

The budget (`budget()`) is chosen from what the queue costs, measured as it runs: at least MIN_TURN_S,
at least SWITCH_MULTIPLE times a switch, at least HOLD_MULTIPLE times a request's hold, at most
MAX_TURN_S. A switch leaves the engine idle (the merge, the prefix-cache reset, then cold caches), and
the end of every turn drains: no new request starts while the last ones finish, so the batch shrinks for
up to one request's time. Turns many times longer than both keep that overhead to a small share of the
engine's time (the target: k experiments in turns give at least 0.8x one experiment's tok/s). Past that,
a longer turn only makes the other states' requests wait longer, hence the floor of a few seconds rather
than more, and the cap: with very long requests the drain, not the budget, sets the turn's length.

Pure asyncio, no vLLM: tests/test_weight_turns.py drives it with fake switches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable

log = logging.getLogger(__name__)

MIN_TURN_S = 2.0
SWITCH_MULTIPLE = 10.0  # a switch then costs at most ~10% of a turn
HOLD_MULTIPLE = 2.0  # the drain at a turn's end (under one request's time) stays a minor part of it
MAX_TURN_S = 30.0
EWMA = 0.2  # weight of the newest measurement in the running switch / hold times

State = Hashable  # None (the base weights) or an adapter key


class _Waiter:
    __slots__ = ("need", "admitted")

    def __init__(self, need: Callable[[], State]) -> None:
        self.need = need
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class WeightTurns:
    """`held()` reads the state the engine holds now; `switch(state)` changes it, called only while no
    request runs (it may land elsewhere, e.g. on the base weights when a merge fails: `held()` is the truth).
    A request's `need()` is asked again at every decision, since loading a newer version changes it."""

    def __init__(self, held: Callable[[], State], switch: Callable[[State], Awaitable[None]], *,
                 min_turn_s: float = MIN_TURN_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._held = held
        self._switch = switch
        self._min_turn_s = min_turn_s
        self._clock = clock
        self._waiting: list[_Waiter] = []  # in arrival order
        self._running = 0
        self._switching: asyncio.Task | None = None
        self._turn_started = clock()
        self._switch_s: float | None = None  # running averages (EWMA) of a switch and of a request's hold
        self._hold_s: float | None = None
        self.switches = 0

    def budget(self) -> float:
        """How long the current turn may keep letting requests in once another state waits (module doc)."""
        return min(MAX_TURN_S, max(self._min_turn_s, SWITCH_MULTIPLE * (self._switch_s or 0.0),
                                   HOLD_MULTIPLE * (self._hold_s or 0.0)))

    @contextlib.asynccontextmanager
    async def turn(self, need: Callable[[], State]) -> AsyncIterator[State]:
        """Wait until the engine holds the state `need()` names and the turn lets this request in; yields
        that state, which stays put until the body is done."""
        waiter = _Waiter(need)
        self._waiting.append(waiter)
        self._advance()
        try:
            await waiter.admitted
        except BaseException:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.admitted.done() and not waiter.admitted.cancelled() and waiter.admitted.exception() is None:
                self._running -= 1  # let in just as it was cancelled
            self._advance()
            raise
        started = self._clock()
        try:
            yield self._held()
        finally:
            # Synchronous bookkeeping only: a second cancellation cannot cut it short.
            self._running -= 1
            self._hold_s = _average(self._hold_s, self._clock() - started)
            self._advance()

    def _advance(self) -> None:
        """Let in whoever may run now, or start the next switch; called after every change."""
        if self._switching is not None:
            return
        # A cancelled request's future is cancelled at once; its own clean-up comes a step later.
        self._waiting = [w for w in self._waiting if not w.admitted.done()]
        held = self._held()
        needs = [(w, w.need()) for w in self._waiting]
        others = [n for _, n in needs if n != held]
        closed = bool(others) and self._clock() - self._turn_started >= self.budget()
        if not closed:
            for waiter, need in needs:
                if need == held:
                    self._waiting.remove(waiter)
                    self._running += 1
                    waiter.admitted.set_result(None)
        if self._running == 0 and others:
            # Nothing runs and the turn is over: the state whose oldest waiter came first goes next.
            self._switching = asyncio.get_running_loop().create_task(self._switch_to(others[0]))

    async def _switch_to(self, target: State) -> None:
        started = self._clock()
        error: BaseException | None = None
        try:
            await self._switch(target)
        except Exception as exc:  # the engine's own fallbacks failed too: fail the waiters, do not spin
            log.exception("switching the weights to %s failed", target)
            error = exc
        self._switch_s = _average(self._switch_s, self._clock() - started)
        self.switches += 1
        self._turn_started = self._clock()
        self._switching = None
        if error is not None and self._held() != target:
            for waiter in [w for w in self._waiting if not w.admitted.done() and w.need() == target]:
                self._waiting.remove(waiter)
                waiter.admitted.set_exception(error)
        self._advance()


def _average(average: float | None, sample: float) -> float:
    return sample if average is None else average + EWMA * (sample - average)
