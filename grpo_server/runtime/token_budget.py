"""Tokens the front end holds in memory, bounded per experiment and for the whole server.

What a tenant makes the server hold is token ids and their logprobs: groups awaiting feedback (`GroupStore`),
episodes awaiting their reward (`EpisodeStore`), rated groups queued for the learner (`Experiment.queue`), and
what requests being sampled will bring back. Each count is kept where the tokens live (the stores count their
own; a queue is short and is summed); sampling requests reserve their worst case here (the prompt + n x
max_tokens) from admission until their group is stored. A request that would take an experiment or the
server over its budget gets a 429 with Retry-After at once, before anything is sampled, instead of a server
that swaps and then dies for every tenant.

A held token costs about 73 bytes in this process (an int id and a float logprob as Python objects, its share
of the completion's text; measured on a 16 x 1024-token group), so the defaults (config.py: 16M tokens per
experiment, 48M in all) hold at most about 1.2 and 3.5 GiB.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator

from grpo_server.protocol.errors import TooManyRequests

BYTES_PER_TOKEN = 73  # measured (above); what docs/operations/durability.md's memory figures use
RETRY_AFTER_S = 5.0  # held tokens leave with feedback, training and expiry: seconds, not milliseconds


class TokenBudget:
    """Admission by tokens held. `held(experiment)` / `held(None)` (the whole server) count what the stores
    already hold; `reserve` adds a request's worst case for as long as it is being sampled."""

    def __init__(self, per_experiment: int, total: int, held: Callable[[str | None], int] = lambda _: 0):
        self.per_experiment = per_experiment
        self.total = total
        self._held = held
        self._reserved: Counter[str] = Counter()
        self._reserved_total = 0

    def in_use(self, experiment: str | None = None) -> int:
        """Tokens held plus reserved, by one experiment or (None) by all."""
        reserved = self._reserved_total if experiment is None else self._reserved[experiment]
        return self._held(experiment) + reserved

    def check(self, experiment: str, tokens: int) -> None:
        """429 (code token_budget) if `tokens` more would take the experiment or the server over its budget."""
        for scope, used, limit, setting in (
                (f"experiment {experiment!r}", self.in_use(experiment), self.per_experiment,
                 "max_held_tokens_per_experiment"),
                ("the server", self.in_use(None), self.total, "max_held_tokens")):
            if used + tokens > limit:
                raise TooManyRequests(
                    f"{scope} holds {used} tokens awaiting feedback or training; this request may add {tokens} "
                    f"(its prompt + n x max_tokens), over {setting} ({limit}). Post feedback, let groups expire, "
                    "or ask for fewer tokens", code="token_budget", retry_after=RETRY_AFTER_S)

    @contextlib.contextmanager
    def reserve(self, experiment: str, tokens: int) -> Iterator[None]:
        """Hold `tokens` for a request being sampled (after `check`); the caller stores its group before the
        block ends, so the tokens move from here to the store with no await in between."""
        self.check(experiment, tokens)
        self._reserved[experiment] += tokens
        self._reserved_total += tokens
        try:
            yield
        finally:
            self._reserved[experiment] -= tokens
            self._reserved_total -= tokens
            if not self._reserved[experiment]:
                del self._reserved[experiment]
