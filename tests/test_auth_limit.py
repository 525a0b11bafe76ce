"""The failed-key limiter (grpo_server/api/auth_limit.py) on a fake clock. Over the real server:
tests/test_tenancy.py."""

from __future__ import annotations

import pytest

from grpo_server.api.auth_limit import FailedAuthLimiter
from grpo_server.protocol.errors import ApiError


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _blocked(limiter: FailedAuthLimiter, address: str) -> ApiError | None:
    try:
        limiter.check(address)
    except ApiError as exc:
        return exc
    return None


def test_limit_failures_per_window_then_429_until_the_oldest_leaves():
    clock = Clock()
    limiter = FailedAuthLimiter(3, 60.0, clock=clock)
    for _ in range(3):
        assert _blocked(limiter, "10.0.0.1") is None
        limiter.failed("10.0.0.1")
        clock.now += 10
    error = _blocked(limiter, "10.0.0.1")
    assert (error.status, error.code) == (429, "too_many_failed_keys")
    assert error.retry_after == 30  # the first failure (at 1000) leaves the window at 1060; now is 1030
    assert _blocked(limiter, "10.0.0.2") is None  # another address is not held up
    clock.now = 1060.0
    assert _blocked(limiter, "10.0.0.1") is None  # one more try ...
    limiter.failed("10.0.0.1")
    assert _blocked(limiter, "10.0.0.1").retry_after == 10  # ... and blocked until the next oldest leaves
    clock.now += 1000
    assert _blocked(limiter, "10.0.0.1") is None
    assert limiter.tracked() == 0  # old failures are forgotten


def test_exempt_networks_ipv6_blocks_and_no_limit():
    clock = Clock()
    limiter = FailedAuthLimiter(1, 60.0, ["127.0.0.1", "10.1.0.0/16"], clock=clock)
    for address in ("127.0.0.1", "::ffff:127.0.0.1", "10.1.2.3"):
        limiter.failed(address)
        assert _blocked(limiter, address) is None
    limiter.failed("2001:db8::1")
    assert _blocked(limiter, "2001:db8::2") is not None  # the same /64
    assert _blocked(limiter, "2001:db8:0:1::1") is None
    limiter.failed(None)  # no peer address (a Unix socket): one shared bucket
    assert _blocked(limiter, None) is not None
    off = FailedAuthLimiter(0, 60.0, clock=clock)
    for _ in range(100):
        off.failed("10.0.0.1")
    assert _blocked(off, "10.0.0.1") is None and off.tracked() == 0


def test_memory_is_bounded():
    clock = Clock()
    limiter = FailedAuthLimiter(5, 60.0, max_addresses=100, clock=clock)
    for i in range(1000):
        for _ in range(10):
            limiter.failed(f"10.{i // 256}.{i % 256}.1")
    assert limiter.tracked() == 100
    assert max(len(times) for times in limiter._failures.values()) == 5
    assert _blocked(limiter, "10.3.231.1") is not None  # the newest addresses are the ones kept
    assert _blocked(limiter, "10.0.0.1") is None


@pytest.mark.parametrize("limit", [1, 10])
def test_retry_after_is_at_least_a_second(limit):
    clock = Clock()
    limiter = FailedAuthLimiter(limit, 0.5, clock=clock)
    for _ in range(limit):
        limiter.failed("10.0.0.1")
    assert _blocked(limiter, "10.0.0.1").retry_after == 1
