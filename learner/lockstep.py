"""Rank 0 drives the other ranks through every verb that changes state, in lockstep.

The command channel is the rendezvous store, not a collective: a follower may wait hours for the next
verb, and a collective would time out (the process group's timeout is there for a peer stuck inside a
step), while a store key can be waited for again and again. Per verb, rank 0 writes `cmd/{seq}` (the verb
and its arguments: `encode_command`), runs the verb itself, then reads `done/{seq}/{rank}` of every
follower: ok, or its error. Inside a verb the ranks keep step through the verb's own collectives (DeepSpeed's gradient
reduction, the checkpoint's optimizer shards). Verbs that only read (logprobs, status) run on rank 0 alone.
The store's port is open to whatever reaches it, so what crosses it is data, never pickle (which runs code
when read): plain values and the protocol's own models, validated again on the follower's side.

Failures:
  * an ApiError (a bad request, an unknown experiment) is raised alike by every rank, from the same
    state and before any collective: it is answered as usual and the job goes on;
  * anything else, on any rank, may have left the ranks out of step (one rank's optimizer stepped, a
    collective half done): it is answered with a 500 naming each rank's error, and the job exits so that
    the supervisor restarts it from its checkpoints. A follower that fails so posts its error and exits at
    once: rank 0, blocked in a collective with it, then fails fast (peer closed) rather than at the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from pydantic import BaseModel

from grpo_server.protocol.codec import pack, unpack
from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.wire import TrainRequest
from grpo_server.protocol.worker_config import AlgorithmConfig, LoraConfig
from learner.ranks import Followers

log = logging.getLogger(__name__)

# The trainer methods a follower runs when told to; anything else in a command is refused.
LOCKSTEP_VERBS = ("add_experiment", "train", "save_adapter", "remove_experiment", "checkpoint", "checkpoint_all")
STOP = "stop"
# A follower waits for the next command in slices this long: a store wait that times out logs a
# warning (C++ side), and the socket poll under it takes a timeout of at most ~24 days in milliseconds.
_IDLE_WAIT = timedelta(hours=6)
_POLL_S = (0.005, 0.2)  # rank 0 looks for outcomes (and dead followers) this often: first, at most
# The models a command's arguments may be, by name (add_experiment's configs, train's batch): a follower
# builds only these, through their validation.
COMMAND_MODELS: dict[str, type[BaseModel]] = {m.__name__: m for m in (LoraConfig, AlgorithmConfig, TrainRequest)}


@dataclass(frozen=True)
class Outcome:
    """How one rank's run of a verb ended. Plain fields, not the exception: only its code, message and status
    cross the store."""

    rank: int
    api_error: tuple[str, str, int] | None = None  # (code, message, status): every rank raises it alike
    failure: str | None = None  # anything else: "TypeName: message"

    @classmethod
    def of(cls, rank: int, exc: BaseException | None) -> "Outcome":
        if exc is None:
            return cls(rank)
        if isinstance(exc, ApiError):
            return cls(rank, api_error=(exc.code, exc.message, exc.status))
        return cls(rank, failure=f"{type(exc).__name__}: {exc}")

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "api_error": self.api_error, "failure": self.failure}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> "Outcome":
        code, message, status = body["api_error"] or (None, None, None)
        return cls(int(body["rank"]), api_error=None if code is None else (str(code), str(message), int(status)),
                   failure=None if body["failure"] is None else str(body["failure"]))

    def describe(self) -> str:
        if self.failure:
            return f"rank {self.rank}: {self.failure}"
        if self.api_error:
            return f"rank {self.rank}: {self.api_error[0]}: {self.api_error[1]}"
        return f"rank {self.rank}: ok"


def encode_command(verb: str, args: tuple) -> bytes:
    """A verb and its arguments as msgpack: each argument a plain value, or a `COMMAND_MODELS` model as its
    name and fields (mode="python": floats and ints exactly as they are, as pickle kept them)."""
    encoded = []
    for arg in args:
        if isinstance(arg, BaseModel):
            if COMMAND_MODELS.get(type(arg).__name__) is not type(arg):
                raise TypeError(f"{verb}: a {type(arg).__name__} cannot cross the command channel")
            encoded.append({"model": type(arg).__name__, "fields": arg.model_dump(mode="python")})
        else:
            encoded.append({"value": arg})
    return pack({"verb": verb, "args": encoded})


def decode_command(data: bytes) -> tuple[str, tuple]:
    """`encode_command`'s verb and arguments, models validated again; ValueError for anything else."""
    try:
        body = unpack(data)
        args = tuple(COMMAND_MODELS[arg["model"]].model_validate(arg["fields"]) if "model" in arg else arg["value"]
                     for arg in body["args"])
        return str(body["verb"]), args
    except Exception as exc:  # msgpack raises several unrelated types; a wrong shape KeyError or TypeError
        raise ValueError(f"not a lockstep command ({type(exc).__name__}: {exc})") from exc


class CommandChannel:
    """Commands from rank 0 and outcomes back, as keys of the rendezvous store."""

    def __init__(self, store: Any):
        from torch.distributed import PrefixStore

        self.store = PrefixStore("learner-lockstep", store)

    def publish(self, seq: int, verb: str, args: tuple) -> None:
        self.store.set(f"cmd/{seq}", encode_command(verb, args))

    def next_command(self, seq: int) -> tuple[str, tuple]:
        """Wait as long as it takes for command `seq`. If rank 0 (the store's host) dies, the wait fails
        at once with a network error, which ends the follower; a command it cannot read, with ValueError."""
        from torch.distributed import DistStoreError, DistNetworkError

        key = f"cmd/{seq}"
        while True:
            try:
                self.store.wait([key], _IDLE_WAIT)
                data = self.store.get(key)
            except DistNetworkError:
                raise
            except DistStoreError:  # the slice ran out: wait again
                continue
            return decode_command(data)

    def post(self, seq: int, outcome: Outcome) -> None:
        self.store.set(f"done/{seq}/{outcome.rank}", pack(outcome.to_wire()))

    def outcome(self, seq: int, rank: int) -> Outcome | None:
        """The rank's outcome of command `seq`, or None if it has not posted it yet. A check, not a
        timed wait: rank 0 polls, looking at the followers' liveness in between."""
        key = f"done/{seq}/{rank}"
        if not self.store.check([key]):
            return None
        data = self.store.get(key)
        try:
            return Outcome.from_wire(unpack(data))
        except Exception as exc:  # not a follower's (msgpack raises several unrelated types): that rank failed
            return Outcome(rank, failure=f"unreadable outcome ({type(exc).__name__}: {exc})")

    def forget(self, seq: int, ranks: list[int]) -> None:
        # The store keeps every key until deleted; a train command carries the whole batch.
        self.store.delete_key(f"cmd/{seq}")
        for rank in ranks:
            self.store.delete_key(f"done/{seq}/{rank}")


class LockstepTrainer:
    """Rank 0's face of the job: the trainer's verbs, the state-changing ones run on every rank.

    `on_broken(reason)` is called once when the ranks may have fallen out of step; the job must then exit.
    `outcome_timeout_s` bounds the wait for a follower after rank 0 has finished its part of a verb; it
    is longer than the collective timeout, so that a follower stuck in a collective reports first.
    """

    def __init__(self, trainer: Any, channel: CommandChannel, followers: Followers,
                 on_broken: Callable[[str], None], outcome_timeout_s: float):
        self.trainer = trainer
        self.channel = channel
        self.followers = followers
        self.on_broken = on_broken
        self.outcome_timeout_s = outcome_timeout_s
        self.broken: str | None = None
        self._seq = 0
        self._lock = threading.Lock()  # one command at a time: the sequence numbers are the lockstep

    # --- verbs that change state: every rank ---------------------------------------------------

    def add_experiment(self, *args: Any) -> Any:
        return self._everywhere("add_experiment", *args)

    def train(self, request: Any) -> Any:
        return self._everywhere("train", request)

    def save_adapter(self, name: str) -> Any:
        return self._everywhere("save_adapter", name)

    def remove_experiment(self, name: str) -> None:
        return self._everywhere("remove_experiment", name)

    def checkpoint(self, name: str) -> None:
        return self._everywhere("checkpoint", name)

    def checkpoint_all(self) -> None:
        return self._everywhere("checkpoint_all")

    # --- verbs that read: rank 0's copy of the state answers -------------------------------------

    def logprobs(self, request: Any) -> Any:
        return self.trainer.logprobs(request)

    def previous_logprobs(self, request: Any) -> Any:
        """Rank 0 alone: it moves its own weights to the previous version and back within the call."""
        return self.trainer.previous_logprobs(request)

    def score_version(self, request: Any) -> Any:
        """Rank 0 alone, as previous_logprobs."""
        return self.trainer.score_version(request)

    def status(self) -> Any:
        return self.trainer.status()

    def wait_for_checkpoints(self) -> None:
        """Rank 0 alone: it writes every checkpoint."""
        self.trainer.wait_for_checkpoints()

    @property
    def dtype(self) -> Any:
        """The same on every rank (one config): rank 0's answers for all (the status says it)."""
        return self.trainer.dtype

    @property
    def autocast(self) -> bool:
        return self.trainer.autocast

    # --- Tinker's verbs (learner/steps.py): rank 0 alone. forward reads, the states are rank 0's files; the verbs
    # that move weights or optimizer state refuse themselves (409) with several ranks before touching anything,
    # so no follower is left waiting for a collective.

    def forward(self, request: Any) -> Any:
        return self.trainer.forward(request)

    def forward_backward(self, request: Any) -> Any:
        return self.trainer.forward_backward(request)

    def optim_step(self, request: Any) -> Any:
        return self.trainer.optim_step(request)

    def save_state(self, request: Any) -> Any:
        return self.trainer.save_state(request)

    def load_state(self, request: Any) -> Any:
        return self.trainer.load_state(request)

    def list_states(self, request: Any) -> Any:
        return self.trainer.list_states(request)

    def delete_state(self, request: Any) -> Any:
        return self.trainer.delete_state(request)

    # --- the job --------------------------------------------------------------------------------

    def stop_followers(self, timeout_s: float) -> None:
        with self._lock:
            self.followers.expect_exit()
            if self.broken is None:
                self.channel.publish(self._seq, STOP, ())
                self._acknowledged(self._seq, timeout_s)
            else:  # out of step: they may be stuck in a collective, deaf to commands
                self.followers.kill()
        self.followers.wait_or_kill(timeout_s)

    def _acknowledged(self, seq: int, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until every follower has read the stop: followers a launcher started are
        not ours to wait for, and the store they read it from may be ours, gone when we exit."""
        deadline = time.monotonic() + timeout_s
        for rank in self.followers.ranks:
            while self.channel.outcome(seq, rank) is None and self.followers.exit_code(rank) is None:
                if time.monotonic() >= deadline:
                    log.warning("rank %d did not acknowledge the stop within %.0f s", rank, timeout_s)
                    return
                time.sleep(_POLL_S[1])

    def _everywhere(self, verb: str, *args: Any) -> Any:
        with self._lock:
            if self.broken is not None:
                raise ApiError(f"the learner is restarting: {self.broken}", code="learner_broken", status=503)
            seq = self._seq
            self._seq += 1
            self.channel.publish(seq, verb, args)
            result, mine = None, None
            try:
                result = getattr(self.trainer, verb)(*args)
            except BaseException as exc:  # judged with the other ranks' outcomes below
                if not isinstance(exc, ApiError):
                    log.exception("rank 0: %s failed", verb)
                mine = exc
            own = Outcome.of(0, mine)
            # A failure of rank 0's own may leave the followers in a collective that never completes:
            # take what they have posted (or that they died), without waiting for the rest.
            outcomes = [own, *self._collect(seq, wait=own.failure is None)]
            # The same ApiError everywhere (compared by code and status) is a normal answer.
            errors = {(o.api_error[0], o.api_error[2]) if o.api_error else None for o in outcomes}
            if all(o.failure is None for o in outcomes) and len(errors) == 1:
                self.channel.forget(seq, self.followers.ranks)
                if mine is not None:
                    raise mine
                return result
            reason = f"{verb} failed on the learner's ranks ({'; '.join(o.describe() for o in outcomes)})"
            self.broken = reason
            log.error("%s; the ranks may be out of step: the learner exits to restart from its checkpoints", reason)
            self.on_broken(reason)
            raise ApiError(reason + "; the learner restarts from its checkpoints", code="rank_failed", status=500)

    def _collect(self, seq: int, wait: bool) -> list[Outcome]:
        outcomes = []
        deadline = time.monotonic() + (self.outcome_timeout_s if wait else 0.0)
        for rank in self.followers.ranks:
            pause = _POLL_S[0]
            while (outcome := self.channel.outcome(seq, rank)) is None:
                code = self.followers.exit_code(rank)
                if code is not None:
                    # A follower posts its outcome before it exits: look once more, it may have done both
                    # since the check above.
                    outcome = self.channel.outcome(seq, rank) or Outcome(rank, failure=f"exited with code {code}")
                    break
                if time.monotonic() >= deadline:
                    outcome = Outcome(rank, failure=f"no answer within {self.outcome_timeout_s:.0f} s" if wait
                                      else "did not finish (rank 0 failed first)")
                    break
                time.sleep(pause)
                pause = min(pause * 2, _POLL_S[1])
            outcomes.append(outcome)
        return outcomes


def follow(trainer: Any, channel: CommandChannel, rank: int) -> int:
    """A follower's life: run rank 0's commands until told to stop. Returns the exit code."""
    from torch.distributed import DistNetworkError

    seq = 0
    while True:
        try:
            verb, args = channel.next_command(seq)
        except DistNetworkError as exc:  # rank 0 died (the kernel's SIGKILL for us may be a moment behind)
            log.error("rank %d: rank 0 is gone (%s); exiting", rank, exc)
            return 1
        except ValueError as exc:  # not rank 0's: the ranks cannot stay in step past it
            log.error("rank %d: command %d unreadable (%s); leaving the job", rank, seq, exc)
            channel.post(seq, Outcome(rank, failure=f"unreadable command: {exc}"))
            return 1
        if verb == STOP:
            log.info("rank %d: stopping as rank 0 asked", rank)
            channel.post(seq, Outcome(rank))
            return 0
        if verb not in LOCKSTEP_VERBS:
            channel.post(seq, Outcome(rank, failure=f"unknown lockstep verb {verb!r}"))
            return 1
        try:
            getattr(trainer, verb)(*args)
        except ApiError as exc:  # rank 0 raises it too, from the same state: the job goes on
            channel.post(seq, Outcome.of(rank, exc))
        except BaseException as exc:  # reported to rank 0; then this rank leaves the job
            log.exception("rank %d: %s failed; leaving the job", rank, verb)
            channel.post(seq, Outcome.of(rank, exc))
            return 1
        else:
            channel.post(seq, Outcome(rank))
        seq += 1
