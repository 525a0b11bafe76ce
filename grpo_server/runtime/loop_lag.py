"""How late the front end's event loop runs what is ready: the one number that says whether a request's CPU or
disk work (tokenising, templates, fsync, archives) stalls every other client.

A task sleeps `INTERVAL_S` again and again; whatever it wakes up later than asked is lag, the time some other
callback held the loop. Kept: the samples of the last `WINDOW_S` (percentiles for /metrics, the health answer and
the load benchmark) and the largest since start.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

INTERVAL_S = 0.02
WINDOW_S = 60.0


class LoopLag:
    def __init__(self, interval_s: float = INTERVAL_S, window_s: float = WINDOW_S):
        self.interval_s = interval_s
        self._samples: deque[float] = deque(maxlen=max(1, int(window_s / interval_s)))
        self.max_s = 0.0  # since start
        self.count = 0
        self.sum_s = 0.0

    async def watch_forever(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.add(max(0.0, time.perf_counter() - asked - self.interval_s))

    def add(self, lag_s: float) -> None:
        self._samples.append(lag_s)
        self.max_s = max(self.max_s, lag_s)
        self.count += 1
        self.sum_s += lag_s

    def quantile(self, q: float) -> float:
        """The q-quantile (0..1) of the recent window's lags (0 before any sample)."""
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def recent_max(self) -> float:
        return max(self._samples, default=0.0)
