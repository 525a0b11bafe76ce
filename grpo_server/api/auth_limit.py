"""Slowing down key guessing: a client address that sent `limit` unknown keys within `window_s` gets 429
(with Retry-After) on every call that needs a key, until the oldest of those failures leaves the window. So
a guesser gets at most `limit` tries per window from one address, while a client that mistyped its key once
is not held up.

Only unknown keys count (401 invalid_key): a missing key is no guess, and a valid key for another experiment
(403) already proved itself. A blocked address is answered before its key is compared, so its tries while
blocked tell it nothing. An IPv6 client counts by its /64 (one host usually holds the whole block).

Bounded memory: at most `limit` timestamps per address, and at most `max_addresses` addresses (the one
idle longest is forgotten first)."""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict, deque
from typing import Callable, Iterable

from grpo_server.protocol.errors import TooManyRequests

MAX_ADDRESSES = 10_000


class FailedAuthLimiter:
    def __init__(self, limit: int, window_s: float, exempt: Iterable[str] = (), *,
                 max_addresses: int = MAX_ADDRESSES, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.window_s = window_s
        self.exempt = [ipaddress.ip_network(n, strict=False) for n in exempt]
        self.max_addresses = max_addresses
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()  # oldest activity first

    def check(self, address: str | None) -> None:
        """Raise 429 if `address` is blocked now."""
        bucket = self._bucket(address)
        if bucket is None:
            return
        times = self._recent(bucket)
        if times is not None and len(times) >= self.limit:
            wait = times[0] + self.window_s - self.clock()
            raise TooManyRequests(f"too many unknown keys from this address: retry after {math.ceil(wait)} s",
                                  retry_after=max(1, math.ceil(wait)), code="too_many_failed_keys")

    def failed(self, address: str | None) -> None:
        """Count an unknown key from `address`."""
        bucket = self._bucket(address)
        if bucket is None:
            return
        times = self._recent(bucket)
        if times is None:
            while len(self._failures) >= self.max_addresses:
                self._failures.popitem(last=False)
            times = self._failures[bucket] = deque(maxlen=self.limit)
        times.append(self.clock())
        self._failures.move_to_end(bucket)

    def tracked(self) -> int:
        return len(self._failures)

    def _recent(self, bucket: str) -> deque[float] | None:
        """The bucket's failures within the window (older ones dropped), or None if it has none."""
        times = self._failures.get(bucket)
        if times is None:
            return None
        horizon = self.clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[bucket]
            return None
        return times

    def _bucket(self, address: str | None) -> str | None:
        """The key `address` counts under; None when it is not limited (no limit, or exempt)."""
        if self.limit == 0:
            return None
        try:
            ip = ipaddress.ip_address(address or "")
        except ValueError:  # no peer address (a Unix socket): one shared bucket
            return ""
        if ip.version == 6 and ip.ipv4_mapped is not None:  # a dual-stack socket's IPv4 client
            ip = ip.ipv4_mapped
        if any(ip in network for network in self.exempt):
            return None
        if ip.version == 6:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)
