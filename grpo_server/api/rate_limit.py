"""A request rate per key: a token bucket per experiment key, refilled at `rate` requests a second and holding
at most `burst`. A request that finds its bucket empty gets 429 `rate_limited` (with Retry-After: when the next
token is due) right after its key is known, before its body is read or any other work is done; a refused
request takes no token, so a key that keeps sending while refused is admitted again at `rate`, not never.

The admin key is not limited (the operator's own calls, monitoring). Public routes (health) have no key and are
not limited here. One key's flood leaves every other key's bucket as it was.

Bounded memory: one bucket per experiment key that called (an experiment that is deleted leaves its bucket until
`max_keys` newer ones push it out, the one idle longest first). O(1) a request."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable

from grpo_server.api.route_table import Principal
from grpo_server.protocol.errors import TooManyRequests

MAX_KEYS = 10_000


class KeyRateLimiter:
    def __init__(self, rate: float, burst: int, *, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic):
        """`rate` 0: no limit."""
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at); idlest first

    def take(self, who: Principal) -> None:
        """One request of `who`: a token from its bucket, or 429 `rate_limited` when it has none."""
        if self.rate <= 0 or who.is_admin:
            return
        key = who.owner
        now = self.clock()
        tokens, at = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
            raise TooManyRequests(f"this key sent more than {self.rate:g} requests a second (burst {self.burst}): "
                                  f"retry after {math.ceil(wait)} s", retry_after=max(1, math.ceil(wait)),
                                  code="rate_limited")
        while len(self._buckets) >= self.max_keys:
            self._buckets.popitem(last=False)
        self._buckets[key] = (tokens - 1.0, now)

    def tracked(self) -> int:
        return len(self._buckets)
