"""Sampling and training turns on a CPU host (`schedule` alternate / alternate_all; grpo_server/workers/pool.py
has why they take turns at all): per experiment, and the solo turns a train step takes beside other
experiments' sampling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import AsyncIterator, Callable, Protocol

from grpo_server.protocol.gate import Gate

log = logging.getLogger(__name__)

# A train step waits for the others' share of the time (OTHERS_SHARE) only if one of them sampled within this long
# (a client's pause between its requests): with nobody else sampling, there is nobody to leave time to.
RECENT_SAMPLING_S = 1.0
SOLO_CLAIM_S = 2.0  # longest hold of others' new calls while theirs in flight end; past it the step shares the cores
OTHERS_SHARE = 2.0  # after others were held d seconds by a solo turn, they sample for at least OTHERS_SHARE x d
SOLO_POLL_S = 0.05
PAUSE_LEASE_S = 600.0  # a sampler resumes by itself after this if the front end never says so (it died)


class SamplerPause(Protocol):
    """What freezes the samplers' requests in flight for a solo turn (grpo_server/workers/pool.py WorkerPool)."""

    async def pause_samplers(self, lease_s: float) -> bool: ...

    async def resume_samplers(self) -> None: ...


class ComputeTurns:
    """Sampler calls share their turn; a train step has it alone, and goes before the calls that arrive after it
    (protocol/gate.py, phase-fair: calls that waited through one step go before the next).
    With `alternate` False nothing waits; sampler calls are counted either way.

    Turns are by experiment (one gate each) unless `by_experiment` is False (schedule `alternate_all`, one gate
    for all): a train step waits for its own experiment's sampler calls and holds its new ones back (what that
    samples next comes from the step's version). One gate for all makes every tenant's completion wait out
    every other tenant's train step and push, and the sampler calls that step waits for (seconds): 4.9x a
    tenant's latency alone beside a flooding one (tests/test_budgets.py). But other experiments' calls running
    beside a step share the 2 cores with it, and a step then took 7x its time alone (SmolLM2: 19 s, not 2.7 s;
    its push 12 s): beside a neighbour sampling back to back, a flooded experiment's 6 rated groups waited over
    30 s for a step (tests/test_fairness_learning.py). So, by experiment, a train step is a solo turn: other
    experiments' calls in flight are frozen in the samplers (`pauser`; vLLM's pause) or, where they cannot pause,
    end first (their new ones held meanwhile, at most SOLO_CLAIM_S, else the step shares the cores after all), and
    their calls that arrive until the step and its push end wait for it. A
    neighbour waits out at most one step at a time, and for at most 1 / (1 + OTHERS_SHARE) of the time: once it
    was held d seconds, the next step that would hold it waits until it has sampled OTHERS_SHARE x d (a step that
    began while it did not sample lets it run beside instead), so its median latency stays within 2x while the
    flooded tenant keeps learning."""

    def __init__(self, alternate: bool, by_experiment: bool = True,
                 clock: Callable[[], float] = time.monotonic, pauser: SamplerPause | None = None):
        self.alternate = alternate
        self.by_experiment = by_experiment
        self.clock = clock
        # With one, a solo turn does not wait for the others' calls in flight to end: they are frozen in the
        # samplers until the step and its push are done (vLLM's pause, sampler/vllm_engine.py). Waiting got the
        # step nowhere beside a tenant whose requests run for minutes: it waited SOLO_CLAIM_S, then shared the
        # cores (2 s and a step 1.5x longer, every step of the neighbour in the hostile-tenant benchmark).
        self.pauser = pauser
        self._paused_for: list[str | None] = []  # the experiment whose solo turn paused the samplers (one at most)
        self._gates: dict[str | None, Gate] = {}
        self._sampling = 0  # sampler calls running
        self._running: Counter[str | None] = Counter()  # the same, by experiment
        self._last_end: dict[str | None, float] = {}  # when each experiment's latest call ended
        self._idle = asyncio.Event()  # set while no sampler call runs
        self._idle.set()
        self._training: dict[str | None, bool] = {}  # experiments whose step runs: may it hold the others?
        self._solo: str | None = None  # the experiment whose train step holds every experiment's sampling
        self._held_since = 0.0  # since when the solo turn holds others (its claim, or the first call it held)
        self._no_solo = asyncio.Event()
        self._no_solo.set()
        self._solo_free_at = 0.0  # no solo turn before this (OTHERS_SHARE)
        self.solo_turns = 0  # solo turns that held others (tests, the log)

    def _gate(self, experiment: str | None) -> Gate:
        key = experiment if self.by_experiment else None
        if key not in self._gates:
            self._gates[key] = Gate()
        return self._gates[key]

    def forget(self, experiment: str) -> None:
        """A deleted experiment's gate (none of its calls is left)."""
        if self.by_experiment:
            self._gates.pop(experiment, None)
        self._running.pop(experiment, None)
        self._last_end.pop(experiment, None)

    @property
    def sampling_calls(self) -> int:
        """Sampler calls running now (counted in both modes)."""
        return self._sampling

    @contextlib.asynccontextmanager
    async def sampling(self, experiment: str | None = None) -> AsyncIterator[None]:
        async with (self._gate(experiment).shared() if self.alternate else contextlib.nullcontext()):
            while self._held_back(experiment):
                await self._no_solo.wait()
            self._sampling += 1
            self._running[experiment] += 1
            self._idle.clear()
            try:
                yield
            finally:
                self._sampling -= 1
                self._running[experiment] -= 1
                self._last_end[experiment] = self.clock()
                if not self._sampling:
                    self._idle.set()

    def _held_back(self, experiment: str | None) -> bool:
        """Whether a call of `experiment` must wait for another experiment's train step: its solo turn, or one
        that becomes solo now (it began with nobody else sampling) if the others have had their share."""
        if self._solo is None:
            trainer = next((t for t, may in self._training.items() if may and t != experiment), None)
            if trainer is None or self.clock() < self._solo_free_at:
                return False
            self._begin_solo(trainer)
            self.solo_turns += 1
        return self._solo != experiment

    @contextlib.asynccontextmanager
    async def training(self, experiment: str | None = None) -> AsyncIterator[None]:
        solo = self.alternate and self.by_experiment  # alternate_all's one gate holds everyone already
        if solo:  # before its own gate: its own calls go on while it waits for the others' share
            await self._solo_chance(experiment)
        async with (self._gate(experiment).exclusive() if self.alternate else contextlib.nullcontext()):
            if solo:
                await self._solo_chance(experiment)  # another solo turn may have begun meanwhile
                self._training[experiment] = await self._claim(experiment)
            try:
                yield
            finally:
                self._training.pop(experiment, None)
                if self._solo == experiment:
                    self._end_solo()
                if experiment in self._paused_for:
                    self._paused_for.clear()
                    await self.pauser.resume_samplers()

    def _others_sampling(self, experiment: str | None) -> bool:
        recent = self.clock() - RECENT_SAMPLING_S
        return any(other != experiment and (self._running[other] > 0 or self._last_end.get(other, -1e18) > recent)
                   for other in set(self._running) | set(self._last_end))

    async def _solo_chance(self, experiment: str | None) -> None:
        """Wait while others sample and a solo turn is not allowed yet: another experiment's runs, or they have
        not had their share since the last one. Nobody else sampling: nothing to wait for."""
        while self._others_sampling(experiment) and (self._solo is not None or self.clock() < self._solo_free_at):
            await asyncio.sleep(SOLO_POLL_S)

    async def _claim(self, experiment: str | None) -> bool:
        """With others' calls in flight, hold their new ones and freeze these (`pauser`), or else let them end:
        whether the step may hold others (False: they could not be paused and outlasted SOLO_CLAIM_S, and it shares
        the cores). None in flight: it holds the first call that comes (`_held_back`)."""
        if not self._sampling:
            return True
        if self.clock() < self._solo_free_at:  # nobody sampled lately (`_solo_chance`), yet a call runs now
            return False
        self._begin_solo(experiment)
        if self.pauser is not None:
            try:
                paused = await self.pauser.pause_samplers(PAUSE_LEASE_S)
            except BaseException:
                self._end_solo()
                raise
            if paused:  # the others' calls are frozen where they are: the step has the cores now
                self._paused_for[:] = [experiment]
                self.solo_turns += 1
                return True
        try:
            # Only others' calls run: this experiment's gate is held. Waiting on an Event cancels cleanly.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), SOLO_CLAIM_S)
        except BaseException:  # cancelled (deleted, stopping): nobody stays held
            self._end_solo()
            raise
        if self._sampling:
            log.info("%s: other experiments' sampler calls ran on past %.0f s: this train step shares the cores",
                     experiment, SOLO_CLAIM_S)
            self._end_solo()
            return False
        self.solo_turns += 1
        return True

    def _begin_solo(self, experiment: str | None) -> None:
        self._solo = experiment
        self._held_since = self.clock()
        self._no_solo.clear()

    def _end_solo(self) -> None:
        now = self.clock()
        self._solo_free_at = now + OTHERS_SHARE * (now - self._held_since)  # the time others were held
        self._solo = None
        self._no_solo.set()
