"""Work answered later: the Tinker API's futures and the order each model's requests run in.

A Tinker call (forward_backward, optim_step, save_weights, ...) answers at once with a request id; the client
then long-polls `retrieve_future` for the result. `FutureStore` runs each call's work as a task it owns and keeps
the outcome until it is read, plus `read_grace_s` for the SDK's retry of the same poll, or at most `ttl_s` after
it finished (then the id is `future_expired`). It bounds how many calls any one owner may have unread (running,
or finished and not retrieved), and the bytes of the results it holds (`payload_bytes`, until they go): a client
that reads its results never meets the bounds. Each owner's unread ids are indexed and the deadlines kept in a
heap, so a call costs the same however many results are held.

`SeqLane` runs one model's calls in the client's `seq_id` order, whatever order the HTTP requests arrived in
(the SDK sends them concurrently): a call waits for every lower id of its model, and a gap that stays open fails
the waiting call rather than hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from grpo_server.protocol.errors import ApiError, BadRequest, NotFound, TooManyRequests

log = logging.getLogger(__name__)

Work = Callable[[], Awaitable[Any]]


@dataclass
class Outcome:
    """A finished call: its answer, or the error it ended with."""

    value: Any = None
    error: ApiError | None = None
    finished_at: float = field(default_factory=time.monotonic)


@dataclass
class _Entry:
    owner: str
    task: asyncio.Task | None = None
    outcome: Outcome | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    read: bool = False  # retrieved once: no longer counts as unread, and goes after the grace
    bytes: int = 0  # its outcome's size (payload_bytes), counted in its owner's held bytes until it goes


class Pending(Exception):
    """The call has not finished within the poll's wait (the route answers 408: try again)."""


class FutureStore:
    def __init__(self, ttl_s: float = 3600.0, max_unread_per_owner: int = 4096, read_grace_s: float = 120.0,
                 max_running_per_owner: int = 256, max_bytes_per_owner: int = 256 * 2**20):
        self.ttl_s = ttl_s
        self.max_unread_per_owner = max_unread_per_owner
        # Results one owner's finished calls hold (read ones within their grace too). A call is refused while its
        # owner is over; the calls already running may take it past by their own results, no more.
        self.max_bytes_per_owner = max_bytes_per_owner
        self.max_running_per_owner = max_running_per_owner  # calls not finished: work queued for the workers
        self.read_grace_s = read_grace_s  # the SDK polls a result again if the answer was lost on the way
        self._entries: dict[str, _Entry] = {}
        self._unread: defaultdict[str, set[str]] = defaultdict(set)  # owner -> ids it has not retrieved
        self._deadlines: list[tuple[float, str]] = []  # (monotonic time, id): when an entry may go, a heap
        self._running: defaultdict[str, int] = defaultdict(int)  # owner -> its calls not finished
        self._bytes: defaultdict[str, int] = defaultdict(int)  # owner -> bytes its held results take

    def unread(self, owner: str) -> int:
        return len(self._unread.get(owner, ()))

    def held_bytes(self, owner: str) -> int:
        return self._bytes.get(owner, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def submit(self, owner: str, work: Work, name: str = "tinker-call") -> str:
        """Start `work`; its id for `retrieve`. 429 while `owner` has too many calls it has not read."""
        self._expire()
        held = self.unread(owner)
        if held >= self.max_unread_per_owner:
            raise TooManyRequests(f"{held} calls of this key are running or their results unread (max "
                                  f"{self.max_unread_per_owner}): retrieve them first", code="too_many_futures",
                                  retry_after=5.0)
        if self._running[owner] >= self.max_running_per_owner:
            raise TooManyRequests(f"{self._running[owner]} calls of this key are running or queued (max "
                                  f"{self.max_running_per_owner}): retry when some have finished",
                                  code="too_many_calls", retry_after=1.0)
        if self.held_bytes(owner) >= self.max_bytes_per_owner:
            raise TooManyRequests(f"results of this key's calls hold {self.held_bytes(owner) / 2**20:.0f} MiB (max "
                                  f"{self.max_bytes_per_owner / 2**20:.0f} MiB): retrieve them first, read ones go "
                                  f"{self.read_grace_s:.0f} s later", code="too_many_futures", retry_after=5.0)
        request_id = f"fut-{secrets.token_hex(12)}"
        entry = _Entry(owner)
        self._entries[request_id] = entry
        self._unread[owner].add(request_id)
        self._running[owner] += 1
        entry.task = asyncio.get_running_loop().create_task(self._run(request_id, entry, work),
                                                            name=f"{name}-{request_id}")
        return request_id

    async def retrieve(self, request_id: str, owner: str, wait_s: float) -> Outcome:
        """The outcome, waiting up to `wait_s` (then `Pending`). Another owner's id is as unknown as an expired
        one: ids do not leak across keys. Once read, the result stays `read_grace_s` (a retried poll), no more."""
        self._expire()
        entry = self._entries.get(request_id)
        if entry is None or (owner != entry.owner and owner != "admin"):
            raise NotFound(f"no result for request {request_id!r}: unknown, or expired (results are kept "
                           f"{self.read_grace_s:.0f} s after they are read, {self.ttl_s:.0f} s after they finish "
                           "if unread)", code="future_expired")
        if entry.outcome is None:
            try:
                await asyncio.wait_for(entry.done.wait(), wait_s)
            except asyncio.TimeoutError:
                raise Pending(request_id) from None
        assert entry.outcome is not None
        if not entry.read:
            entry.read = True
            self._forget_unread(entry.owner, request_id)
            heapq.heappush(self._deadlines, (time.monotonic() + self.read_grace_s, request_id))
        return entry.outcome

    def cancel(self, request_id: str, owner: str) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and entry.owner == owner and entry.task is not None:
            entry.task.cancel()

    def forget_owner(self, owner: str) -> None:
        """Drop every finished result of `owner` (an experiment's key that was deleted: a new experiment of the
        name, maybe another tenant's, must not read them). Its calls still running were cancelled first."""
        for request_id in [i for i, e in self._entries.items() if e.owner == owner and e.outcome is not None]:
            entry = self._entries.pop(request_id)
            self._forget_unread(owner, request_id)
            self._bytes[owner] -= entry.bytes
        if not self._bytes.get(owner, 1):
            del self._bytes[owner]

    async def close(self) -> None:
        tasks = [e.task for e in self._entries.values() if e.task is not None and not e.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, request_id: str, entry: _Entry, work: Work) -> None:
        try:
            entry.outcome = Outcome(value=await work())
        except ApiError as exc:
            # Kept without its traceback and causes: their frames hold what the call held (a decoded request of
            # up to a call's bounds), for as long as the result waits to be read.
            exc.__traceback__ = exc.__cause__ = exc.__context__ = None
            entry.outcome = Outcome(error=exc)
        except asyncio.CancelledError:
            entry.outcome = Outcome(error=ApiError("the call was cancelled", code="cancelled", status=499))
            raise
        except Exception:  # noqa: BLE001 - a bug in one call must reach its client, not kill the store
            log.exception("a Tinker call failed")
            entry.outcome = Outcome(error=ApiError("internal error (logged on the server)", code="internal",
                                                   status=500))
        finally:
            entry.bytes = payload_bytes(entry.outcome.value) if entry.outcome is not None else 0
            self._bytes[entry.owner] += entry.bytes
            entry.done.set()
            self._running[entry.owner] -= 1
            if not self._running[entry.owner]:
                del self._running[entry.owner]
            heapq.heappush(self._deadlines, (time.monotonic() + self.ttl_s, request_id))

    def _expire(self) -> None:
        """Drop the entries whose deadline passed (an entry has two, its ttl and its read grace: the first wins)."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                self._forget_unread(entry.owner, request_id)
                self._bytes[entry.owner] -= entry.bytes
                if not self._bytes[entry.owner]:
                    del self._bytes[entry.owner]

    def _forget_unread(self, owner: str, request_id: str) -> None:
        unread = self._unread.get(owner)
        if unread is not None:
            unread.discard(request_id)
            if not unread:
                del self._unread[owner]


def payload_bytes(value: Any) -> int:
    """About how many bytes `value` (a result: pydantic models, dicts, lists of numbers) holds in memory. A list
    of numbers is costed by its length, so a result of a million floats costs one look, not a million; other
    containers are walked (a result has few of them: datums, sequences, tensors). Estimated rather than measured:
    sys.getsizeof misses what containers point to, and pympler's deep size walks every number."""
    if value is None or isinstance(value, (bool, int, float)):
        return 8
    if isinstance(value, (str, bytes, bytearray)):
        return 49 + len(value)
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], (bool, int, float)):
            return 56 + 32 * len(value)  # a pointer and a boxed number each
        return 56 + sum(8 + payload_bytes(item) for item in value)
    if isinstance(value, dict):
        return 64 + sum(payload_bytes(k) + payload_bytes(v) for k, v in value.items())
    fields = getattr(value, "__dict__", None)  # a pydantic model or a dataclass: its fields
    return 56 + payload_bytes(fields) if isinstance(fields, dict) else 64


class SeqLane:
    """One model's calls, run one at a time in `seq_id` order. A call without a seq_id takes the next place."""

    def __init__(self, gap_timeout_s: float = 120.0):
        self.gap_timeout_s = gap_timeout_s
        self._next: int | None = None  # the seq_id that runs next; None until the first call names one
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # (seq_id, arrival, wake-up) heap
        self._seen: dict[int, str] = {}  # seq_id -> request id, so an HTTP retry gets the same future
        self._arrival = itertools.count()
        self._running = asyncio.Lock()

    def known(self, seq_id: int | None) -> str | None:
        """The request id already given to this seq_id (a client's retry of the same call)."""
        return None if seq_id is None else self._seen.get(seq_id)

    def check(self, seq_id: int | None) -> None:
        """A 400 for a seq_id this model's calls have passed (a retry of a recent one is `known` instead)."""
        if seq_id is not None and self._next is not None and seq_id < self._next:
            raise BadRequest(f"seq_id {seq_id} is out of order: this model's calls up to {self._next - 1} have "
                             "run", code="seq_id_out_of_order")

    def remember(self, seq_id: int | None, request_id: str) -> None:
        if seq_id is None:
            return
        self._seen[seq_id] = request_id
        if len(self._seen) > 4096:  # only recent ids can be retried
            for old in sorted(self._seen)[:1024]:
                del self._seen[old]

    @contextlib.asynccontextmanager
    async def turn(self, seq_id: int | None):
        """Wait for every lower seq_id of this model, then hold the lane while the call runs."""
        if seq_id is not None:
            if self._next is None:
                self._next = seq_id
            if seq_id != self._next:
                wake = asyncio.get_running_loop().create_future()
                heapq.heappush(self._waiting, (seq_id, next(self._arrival), wake))
                try:
                    await asyncio.wait_for(asyncio.shield(wake), self.gap_timeout_s)
                except asyncio.TimeoutError:
                    # The lane moves past the gap (this call counts as run): the calls after it need not
                    # time out one by one.
                    missing, self._next = self._next, seq_id + 1
                    self._wake_next()
                    raise BadRequest(f"seq_id {seq_id} waited {self.gap_timeout_s:.0f} s for seq_id {missing}, "
                                     "which never came", code="seq_id_gap") from None
        async with self._running:
            try:
                yield
            finally:
                if seq_id is not None:
                    self._next = max(self._next or 0, seq_id + 1)
                    self._wake_next()

    def _wake_next(self) -> None:
        while self._waiting and self._waiting[0][0] < (self._next or 0):  # ids the lane already passed
            _, _, wake = heapq.heappop(self._waiting)
            if not wake.done():
                wake.set_result(None)
        if self._waiting and self._waiting[0][0] == self._next:
            _, _, wake = heapq.heappop(self._waiting)
            if not wake.done():
                wake.set_result(None)
