"""The front end's handles on its workers: the HTTP connection to each, the choice of sampler replica, and
the turns that sampling and training take on a CPU host.

**Connections.** A worker that is down or restarting answers 503 at once (no connection attempt, no hang);
a worker's 4xx passes through with its code and its message (a check of what was sent), less any absolute
path, URL or traceback (`protocol/errors.py` `public_message`), and so does its 503 (it cannot run the verb for
now: its disk is full, the verb's deadline passed, its engine is restarting), with a Retry-After. Its other 5xx
become 502 `worker_error` with a fixed message naming the worker, the verb and an incident id: its text (an exception's, with the
worker's paths) goes to the front end's log at ERROR under that id, never to a client. So does a worker's
401: it refused the front end's worker secret, a misconfiguration of the server, not the client's key. A
connection that fails (refused, reset, dropped before the answer) is a `WorkerUnreachable` (503): the
worker died or is not there, so a caller whose verb has no side effects may send it to another replica.
Its client sees the worker's name and an incident id; aiohttp's text, which holds the worker's address,
goes to the log.

**Replicas.** Requests go to the ready replica with the least outstanding work (ties in turn, so a trickle
of requests spreads too); a replica that cannot be reached is skipped for the next one. An adapter version
is loaded on every replica before it is served, so any replica can serve any live version; a replica that
comes back from a restart is re-synced with the live versions before it serves again.

**Turns** (`schedule` in the server config). On GPUs the sampler and the learner each have their own
device, and sampling while the learner trains is pure gain. On a CPU host they share the cores: vLLM's
CPU worker computes on one core and its scheduler process busy-polls another, the learner's threads want
every core, and running both at once made each train step 2-3x slower here than the same step alone
(docs/benchmarks/findings.md "Scheduling on CPU"), 7x for SmolLM2 beside another tenant's back-to-back requests. There
they take turns instead: a train step waits until its experiment's sampler calls end, and that experiment's calls that
arrive while the step waits or runs wait for it to end. Training goes before the calls that come after it, so a
busy sampler cannot starve it; sampling cannot be starved either: calls that waited through one step go before
the next (protocol/gate.py), and only rated groups (which sampling makes) give the learner something to train. Other experiments' sampling is held back only by a solo turn, bounded in length and in
share of the time (grpo_server/workers/turns.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Protocol, TypeVar

import aiohttp
from pydantic import BaseModel

from grpo_server.api_models import ReplicaHealth
from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.deadline import deadline_headers
from grpo_server.protocol.log_context import context_headers
from grpo_server.protocol.errors import ApiError, Unavailable, WorkerFailed, public_message
from grpo_server.protocol.verbs import LearnerClient, SamplerClient, Verb
from grpo_server.protocol.wire import AdapterRef, GenerateRequest
from grpo_server.workers.turns import ComputeTurns

Ans = TypeVar("Ans", bound=BaseModel)
log = logging.getLogger(__name__)

# States in which a worker is expected back: a train batch waits for it rather than failing.
COMING_BACK = ("starting", "restarting", "syncing", "down")


# --- one worker's connection --------------------------------------------------------------------------


class Worker(Protocol):
    """What the front end needs of a worker, whether it started the process (`processes.WorkerProcess`)
    or only connects to it (`remote.RemoteWorker`). `state` is starting | ready | syncing (back after a
    restart, being re-synced: only re-sync calls reach it) | restarting | down | failed | stopped."""

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


class WorkerConnection:
    """One worker's verbs over HTTP (a `protocol.verbs.Transport`). The front end's `session` carries the
    workers' secret on every request (grpo_server/api/app.py, protocol/worker_auth.py)."""

    def __init__(self, process: Worker, session: aiohttp.ClientSession, timeout_s: float):
        self.process = process
        self.session = session
        self.timeout_s = timeout_s

    @property
    def name(self) -> str:
        return self.process.name

    async def request(self, verb: Verb[Any, Ans], body: BaseModel | dict | None, *, timeout_s: float | None = None,
                      syncing_ok: bool = False) -> Ans:
        if not (self.process.ready or (syncing_ok and self.process.state == "syncing")):
            raise Unavailable(f"{self.name} is {self.process.state}", retry_after=5.0, code="worker_unavailable")
        timeout_s = timeout_s or self.timeout_s
        try:
            async with self.session.request(
                verb.method, f"{self.process.url}/{verb.name}", data=None if body is None else pack(body),
                # The log context (request id, experiment, version) goes along: the worker's lines carry it too.
                headers={"Content-Type": MSGPACK, **context_headers(), **deadline_headers(timeout_s)},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                payload = unpack(await response.read())
                status = response.status
        except asyncio.TimeoutError as exc:
            raise Unavailable(f"{self.name} did not answer {verb.name} within {timeout_s:.0f} s",
                              code="worker_timeout") from exc
        except aiohttp.ClientConnectionError as exc:  # refused, reset (a reused connection to a dead worker), dropped
            raise WorkerUnreachable(self._unreachable(verb, exc), code="worker_unavailable") from exc
        except aiohttp.ClientError as exc:
            raise Unavailable(self._unreachable(verb, exc), code="worker_unavailable") from exc
        if status >= 400:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            code, text = error.get("code", "bad_request"), str(error.get("message", payload))
            if status == 503:  # unavailable for now (its disk full, a deadline passed): the client may retry
                log.warning("%s could not run %s: %s: %s", self.name, verb.name, code, text)
                raise Unavailable(f"{self.name}: {public_message(text)}", code=code)
            if status >= 500 or status == 401:
                incident = new_incident()
                log.error("%s failed on %s [incident %s]: %d %s: %s", self.name, verb.name, incident, status, code,
                          text)
                raise WorkerFailed(f"{self.name} failed on {verb.name}; see the server log (incident {incident})")
            message = public_message(text)
            if message != text:  # what the client does not see, the operator can
                log.warning("%s refused %s: %d %s: %s", self.name, verb.name, status, code, text)
            raise ApiError(f"{self.name}: {message}", code=code, status=status)
        return verb.answer.model_validate(payload)

    def _unreachable(self, verb: Verb, exc: Exception) -> str:
        incident = new_incident()
        # WARNING, not ERROR: a worker that died is the supervisor's to report (processes.py), and every call
        # in flight to it ends here.
        log.warning("%s unreachable on %s [incident %s]: %s: %s", self.name, verb.name, incident,
                    type(exc).__name__, exc)
        return f"{self.name} is unreachable; retry shortly (incident {incident})"


def new_incident() -> str:
    """A short random id that ties a client's error to the server's log line about it."""
    return secrets.token_hex(4)


# --- sampling and training turns -----------------------------------------------------------------------

Schedule = Literal["auto", "overlap", "alternate", "alternate_all"]
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the NVIDIA driver sees


def resolve_schedule(schedule: Schedule, remote_workers: bool) -> Literal["overlap", "alternate", "alternate_all"]:
    """`auto`: alternate when the workers run on this machine and it has no NVIDIA GPU (they share its
    CPU cores), overlap otherwise."""
    if schedule != "auto":
        return schedule
    has_gpu = NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir())
    return "overlap" if remote_workers or has_gpu else "alternate"


# --- the pool --------------------------------------------------------------------------------------------


class ReplicaLoad:
    """Requests of one replica: in flight now, and routed to it since the front end started."""

    def __init__(self) -> None:
        self.outstanding = 0
        self.requests = 0


class BalancedReplicas:
    """A `Transport` whose calls go to the least-loaded ready replica, and to the next one when the chosen
    replica cannot be reached. Sampler verbs have no side effects, so a request that never reached a
    replica (or lost it mid-way) is safe to send again."""

    name = "samplers"

    def __init__(self, pool: WorkerPool, experiment: str | None = None):
        self.pool = pool
        self.experiment = experiment

    async def request(self, verb: Verb[Any, Ans], body: BaseModel | dict | None, *, timeout_s: float | None = None,
                      syncing_ok: bool = False) -> Ans:
        if isinstance(body, GenerateRequest):  # its place among waiting requests: the experiment's share in flight
            in_flight = self.pool.sequences_in_flight
            body = body.model_copy(update={"priority": in_flight[self.experiment]})
            in_flight[self.experiment] += body.n
            try:
                return await self._request(verb, body, timeout_s, syncing_ok)
            finally:
                in_flight[self.experiment] -= body.n
                if in_flight[self.experiment] <= 0:
                    del in_flight[self.experiment]
        return await self._request(verb, body, timeout_s, syncing_ok)

    async def _request(self, verb: Verb[Any, Ans], body: BaseModel | dict | None, timeout_s: float | None,
                       syncing_ok: bool) -> Ans:
        tried: set[int] = set()
        while True:
            replica = self.pool.pick_replica(exclude=tried)
            tried.add(id(replica))
            load = self.pool.load[id(replica)]
            load.outstanding += 1
            load.requests += 1
            try:
                return await replica.request(verb, body, timeout_s=timeout_s, syncing_ok=syncing_ok)
            except WorkerUnreachable:
                if not [s for s in self.pool.ready_samplers() if id(s) not in tried]:
                    raise
            finally:
                load.outstanding -= 1


class WorkerPool:
    def __init__(self, samplers: list[WorkerConnection], learner: WorkerConnection | None,
                 turns: ComputeTurns | None = None):
        self.samplers = samplers  # one connection per replica
        self.learner_connection = learner
        self.learner = LearnerClient(learner) if learner is not None else None
        self.turns = turns or ComputeTurns(alternate=False)  # held by sampler calls and train steps
        if self.turns.pauser is None:  # a solo train turn freezes the samplers' requests in flight (turns.py)
            self.turns.pauser = self
        self.load = {id(s): ReplicaLoad() for s in samplers}
        # Sequences each experiment (None: no experiment's) has being sampled: the priority of its next request
        # (BalancedReplicas; GenerateRequest.priority).
        self.sequences_in_flight: Counter[str | None] = Counter()
        self.fingerprints: dict[str, str | None] = {}  # AdapterRef.key -> its fingerprint, while loaded
        self._turn = itertools.count()

    def ready_samplers(self) -> list[WorkerConnection]:
        return [s for s in self.samplers if s.process.ready]

    def pick_replica(self, exclude: set[int] = frozenset()) -> WorkerConnection:
        """The ready replica with the fewest requests in flight; among equals, each in turn."""
        ready = [s for s in self.ready_samplers() if id(s) not in exclude]
        if not ready:
            raise self._none_ready()
        start = next(self._turn) % len(ready)
        rotated = ready[start:] + ready[:start]
        return min(rotated, key=lambda s: self.load[id(s)].outstanding)

    def replica(self, index: int) -> SamplerClient:
        """One replica's verbs (a re-sync after its restart)."""
        return SamplerClient(self.samplers[index])

    @contextlib.asynccontextmanager
    async def sampler(self, take_turn: bool = True, experiment: str | None = None) -> AsyncIterator[SamplerClient]:
        """A client whose calls go to the least-loaded ready replica (see `BalancedReplicas`), held during a
        sampling turn of `experiment` (it may first wait for its train step to end) unless `take_turn` is False.
        Raises 503 at once when no replica is ready."""
        if not self.ready_samplers():
            raise self._none_ready()
        async with (self.turns.sampling(experiment) if take_turn else contextlib.nullcontext()):
            yield SamplerClient(BalancedReplicas(self, experiment))

    def _none_ready(self) -> Unavailable:
        states = ", ".join(f"{s.name}: {s.process.state}" for s in self.samplers)
        return Unavailable(f"no sampler is ready ({states}); retry shortly", code="sampler_unavailable")

    async def load_everywhere(self, adapter: AdapterRef, path: str, fingerprint: str | None = None) -> None:
        """Load a version on every replica; raises if any ready replica fails. A replica that is
        re-syncing after a restart gets it too (its re-sync may have listed versions before this one),
        and so does one that became ready or re-syncing while the others loaded: the caller records
        the version (which later re-syncs then list) right after this returns, so no replica that
        serves can miss it. `fingerprint` (AdapterVersion's) is kept for re-syncs (`load_on`)."""
        self.fingerprints[adapter.key] = fingerprint
        done: set[int] = set()
        while targets := [s for s in self.samplers if s.process.state in ("ready", "syncing") and id(s) not in done]:
            await asyncio.gather(*(self._load(s, adapter, path) for s in targets))
            done.update(id(s) for s in targets)

    async def load_on(self, index: int, adapter: AdapterRef, path: str) -> None:
        """Load a version already loaded elsewhere on one replica (its re-sync after a restart)."""
        await self._load(self.samplers[index], adapter, path)

    async def _load(self, sampler: WorkerConnection, adapter: AdapterRef, path: str) -> None:
        # `path` is the learner's; a sampler that cannot read it (another host, no shared run directory)
        # copies the version from the learner's URL (grpo_server/protocol/adapter_files.py).
        source = self.learner_connection.process.url if self.learner_connection is not None else None
        await SamplerClient(sampler).load_adapter(adapter, path, source_url=source,
                                                  fingerprint=self.fingerprints.get(adapter.key), syncing_ok=True)

    async def pause_samplers(self, lease_s: float) -> bool:
        """Freeze every ready sampler's requests where they are, for a solo train turn (turns.py), at most `lease_s`:
        whether all of them did. If one did not (an engine that cannot pause, one unreachable), none stays paused,
        and the turn does without."""
        targets = self.ready_samplers()
        answers = await asyncio.gather(*(SamplerClient(s).pause(lease_s) for s in targets), return_exceptions=True)
        if targets and all(not isinstance(a, BaseException) and a.paused for a in answers):
            return True
        await self.resume_samplers()
        return False

    async def resume_samplers(self) -> None:
        # Every ready one, paused or not (resuming is idempotent); one that restarted meanwhile is not paused.
        await asyncio.gather(*(SamplerClient(s).resume() for s in self.ready_samplers()), return_exceptions=True)

    async def unload_everywhere(self, adapter: AdapterRef) -> None:
        self.fingerprints.pop(adapter.key, None)
        # A replica that already lost it (restart) is fine: unloading is best effort.
        targets = [s for s in self.samplers if s.process.state in ("ready", "syncing")]
        await asyncio.gather(*(SamplerClient(s).unload_adapter(adapter, syncing_ok=True) for s in targets),
                             return_exceptions=True)

    async def numerics(self) -> tuple[list[str | None], bool]:
        """What the learner and each ready sampler compute in (their `dtype` resolved; None for a worker that did
        not answer or say), and whether the learner trains under bf16 autocast."""
        asks = [SamplerClient(s).health() for s in self.ready_samplers()]
        if self.learner is not None:
            asks.append(self.learner.status())
        answers = await asyncio.gather(*asks, return_exceptions=True)
        learner = answers[-1] if self.learner is not None and not isinstance(answers[-1], BaseException) else None
        return [None if isinstance(a, BaseException) else a.dtype for a in answers], bool(learner and learner.autocast)

    async def wait_learner_ready(self, timeout_s: float) -> None:
        """Let a restarting learner come back before a batch is sent (rather than losing the batch)."""
        deadline = time.monotonic() + timeout_s
        while self.learner_connection.process.state in COMING_BACK and time.monotonic() < deadline:
            await asyncio.sleep(0.5)

    def states(self) -> dict[str, str]:
        return {w.name: w.process.state for w in [*self.samplers, self.learner_connection]}

    def replica_health(self) -> dict[str, ReplicaHealth]:
        return {s.name: ReplicaHealth(state=s.process.state, outstanding=self.load[id(s)].outstanding,
                                      requests=self.load[id(s)].requests) for s in self.samplers}
