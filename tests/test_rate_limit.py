"""The per-key request rate (grpo_server/api/rate_limit.py, ServerConfig.key_rate_limit / key_rate_burst): a key's
flood past its burst is answered 429 `rate_limited` with Retry-After before its body is read, while another key,
the admin and public routes go on; the bucket refills at the rate. Over the real app's routes and middlewares
(without workers), then the bucket on its own on a fake clock."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

import asyncio
import gc
import time

from grpo_server.api.rate_limit import FREE_REFUSALS_BURST, KeyRateLimiter, RefusalPacer
from grpo_server.api.route_table import ADMIN_PRINCIPAL, Principal
from grpo_server.config import ExperimentConfig, ServerConfig
from grpo_server.protocol.errors import ApiError, Conflict

KEYS = {"flood": "flood-key-0123456789", "calm": "calm-key-0123456789"}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Orchestrator:
    """Two experiments with keys; every verb a route calls answers 409 `stub`: a request the limiter let through
    is told apart from one it refused."""

    experiments: dict = {}

    def configs(self) -> list[ExperimentConfig]:
        return [ExperimentConfig.model_validate({"name": name, "api_key": key}) for name, key in KEYS.items()]

    def __getattr__(self, verb):
        def answer(*args, **kwargs):
            raise Conflict("stub orchestrator: admitted", code="stub")
        return answer


@pytest.fixture
async def front_end():
    from grpo_server.api.app import create_app
    from grpo_server.api.app_state import ORCHESTRATOR, RATE_LIMITER

    # Refusals answered at once here: their pacing has tests of its own below.
    app = create_app(ServerConfig(key_rate_limit=2.0, key_rate_burst=5, key_refusal_hold_s=0), "admin-key-0123456789")
    del app.cleanup_ctx[:]  # no workers: the routes only
    app[ORCHESTRATOR] = _Orchestrator()
    limiter = app[RATE_LIMITER]
    assert (limiter.rate, limiter.burst) == (2.0, 5)  # the config's
    limiter.clock = clock = Clock()
    async with TestClient(TestServer(app)) as http:
        yield http, clock


# Every answer here is immediate or paced 0.5 s. One CI run had a test's first GET unanswered until aiohttp's default
# 300 s timeout, with nothing on the server's side that waits (a stub orchestrator, no body); the cause was not found.
# A call gets 30 s and, once, a fresh connection: a server that hangs fails both.
CALL_TIMEOUT = aiohttp.ClientTimeout(total=30)


async def _call(http, key: str, name: str = "flood", body: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"}
    for attempt in range(2):
        try:
            if body is None:
                response = await http.get(f"/v1/experiments/{name}", headers=headers, timeout=CALL_TIMEOUT)
            else:
                response = await http.post(f"/v1/experiments/{name}/feedback", data=body, headers=headers,
                                           timeout=CALL_TIMEOUT)
            break
        except asyncio.TimeoutError:
            if attempt:
                raise
    return response.status, (await response.json())["error"]["code"], response.headers.get("Retry-After")


async def test_a_flood_past_the_burst_is_429_rate_limited_and_other_keys_go_on(front_end):
    http, clock = front_end
    for _ in range(5):  # the burst
        assert (await _call(http, KEYS["flood"]))[:2] == (409, "stub")
    status, code, retry_after = await _call(http, KEYS["flood"])
    assert (status, code, retry_after) == (429, "rate_limited", "1")
    # Before any work: a body that would be a 400 is not even read.
    assert (await _call(http, KEYS["flood"], body=b"{not json"))[:2] == (429, "rate_limited")
    for _ in range(50):  # refused requests take no token, and keep being refused while the clock stands
        assert (await _call(http, KEYS["flood"]))[0] == 429
    # Another key, the admin and a public route are not held up by this key's flood.
    assert (await _call(http, KEYS["calm"], name="calm"))[:2] == (409, "stub")
    for _ in range(20):
        assert (await _call(http, "admin-key-0123456789"))[:2] == (409, "stub")
    assert (await http.get("/v1/health")).status != 429
    # Refilled at 2 a second: after half a second, one more request.
    clock.now += 0.5
    assert (await _call(http, KEYS["flood"]))[:2] == (409, "stub")
    assert (await _call(http, KEYS["flood"]))[:2] == (429, "rate_limited")
    assert (await _call(http, KEYS["flood"], body=b"{not json"))[:2] == (429, "rate_limited")
    clock.now += 0.5
    assert (await _call(http, KEYS["flood"], body=b"{not json"))[:2] == (400, "malformed_body")


def _refused(limiter: KeyRateLimiter, who: Principal) -> ApiError | None:
    try:
        limiter.take(who)
    except ApiError as exc:
        return exc
    return None


def test_the_bucket_refills_to_its_burst_and_says_when_to_retry():
    clock = Clock()
    limiter = KeyRateLimiter(0.25, 2, clock=clock)
    exp = Principal("experiment", "e")
    assert _refused(limiter, exp) is None and _refused(limiter, exp) is None
    error = _refused(limiter, exp)
    assert (error.status, error.code, error.retry_after) == (429, "rate_limited", 4)  # one token every 4 s
    clock.now += 3
    assert _refused(limiter, exp).retry_after == 1
    clock.now += 1
    assert _refused(limiter, exp) is None
    clock.now += 3600  # idle for long: the burst, not more
    assert [_refused(limiter, exp) is None for _ in range(3)] == [True, True, False]
    assert all(_refused(limiter, ADMIN_PRINCIPAL) is None for _ in range(100))
    off = KeyRateLimiter(0, 1, clock=clock)
    assert all(_refused(off, exp) is None for _ in range(100)) and off.tracked() == 0


def test_memory_is_bounded():
    limiter = KeyRateLimiter(1.0, 1, max_keys=10, clock=Clock())
    for i in range(100):
        limiter.take(Principal("experiment", f"e{i}"))
    assert limiter.tracked() == 10
    assert _refused(limiter, Principal("experiment", "e99")) is not None  # the newest are the ones kept
    assert _refused(limiter, Principal("experiment", "e0")) is None


# --- pacing a key that keeps being refused (RefusalPacer) ---------------------------------------------------------

@pytest.fixture
async def paced_front_end():
    """The real app's routes with the defaults' pacing, a burst of 2 and a stopped clock: every call past the burst
    is refused."""
    from grpo_server.api.app import create_app
    from grpo_server.api.app_state import ORCHESTRATOR, RATE_LIMITER, REFUSAL_PACER

    app = create_app(ServerConfig(key_rate_limit=2.0, key_rate_burst=2, key_refusal_hold_s=0.5), "admin-key-0123456789")
    del app.cleanup_ctx[:]
    app[ORCHESTRATOR] = _Orchestrator()
    app[RATE_LIMITER].clock = clock = Clock()
    app[REFUSAL_PACER].clock = clock
    # The tests time answers against the 0.5 s hold: no garbage collection of what the worker's earlier tests left
    # may stop the loop meanwhile (one suite run had all 10 answers of a burst at 1.19 s, within 0.3 ms of each other).
    gc.collect()
    gc.disable()
    try:
        async with TestClient(TestServer(app)) as http:
            yield http, app[REFUSAL_PACER]
    finally:
        gc.enable()


async def _timed(http, key: str, name: str = "flood") -> tuple[int, float]:
    began = time.perf_counter()
    status = (await _call(http, key, name))[0]
    return status, time.perf_counter() - began


async def test_a_key_that_keeps_being_refused_gets_its_refusals_after_a_pause(paced_front_end):
    http, pacer = paced_front_end
    for _ in range(2):
        assert (await _call(http, KEYS["flood"]))[:2] == (409, "stub")
    quick = [await _timed(http, KEYS["flood"]) for _ in range(FREE_REFUSALS_BURST)]
    assert all(status == 429 and took < 0.4 for status, took in quick), quick  # its first refusals: at once
    status, took = await _timed(http, KEYS["flood"])
    assert status == 429 and took >= 0.45, took  # past them: after the pause (0.5 s, its Retry-After is 1 s)
    assert pacer.paced == 1
    # Another key is not paced for it, nor is the admin; and nothing stays held.
    assert (await _call(http, KEYS["calm"], name="calm"))[:2] == (409, "stub")
    status, took = await _timed(http, "admin-key-0123456789")
    assert status == 409 and took < 0.4
    assert pacer.held_total == 0


async def test_concurrent_refusals_are_held_up_to_the_cap_and_the_rest_answered_at_once(paced_front_end):
    http, pacer = paced_front_end
    pacer.max_held_per_key = 4
    for _ in range(2 + FREE_REFUSALS_BURST):  # the burst, then the free refusals
        await _call(http, KEYS["flood"])
    answers = await asyncio.gather(*(_timed(http, KEYS["flood"]) for _ in range(10)))
    assert all(status == 429 for status, _ in answers)
    held = sorted(took for _, took in answers)
    assert sum(took >= 0.45 for took in held) == 4, held  # the cap's worth paused, the 6 others at once
    assert pacer.held_total == 0 and pacer.paced == 4


async def test_a_flood_is_paced_to_about_one_call_per_connection_per_pause():
    """Without a server: 8 callers that retry at once for 1.5 s get about 8 x 1.5 / 0.5 = 24 paced refusals, not
    thousands."""
    pacer = RefusalPacer(0.5, free_rate=0.0, free_burst=0)
    who = Principal("experiment", "flood")
    calls = 0

    async def caller() -> None:
        nonlocal calls
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            await pacer.pace(who, retry_after=1.0)
            calls += 1

    await asyncio.gather(*(caller() for _ in range(8)))
    assert 16 <= calls <= 32, calls


async def test_bodies_that_can_never_pass_are_paced_too_and_other_answers_are_not():
    """A key that keeps sending a malformed body (400) is paced like one that keeps being refused 429; a 409 (an
    answer a working client gets) is not, however many."""
    from grpo_server.api.app import create_app
    from grpo_server.api.app_state import ORCHESTRATOR, REFUSAL_PACER

    app = create_app(ServerConfig(key_rate_limit=0, key_refusal_hold_s=0.5), "admin-key-0123456789")
    del app.cleanup_ctx[:]
    app[ORCHESTRATOR] = _Orchestrator()
    app[REFUSAL_PACER].clock = Clock()  # no free refusal comes back while the test runs
    async with TestClient(TestServer(app)) as http:
        for _ in range(FREE_REFUSALS_BURST + 10):
            began = time.perf_counter()
            assert (await _call(http, KEYS["calm"], name="calm"))[:2] == (409, "stub")
            assert time.perf_counter() - began < 0.4
        for _ in range(FREE_REFUSALS_BURST):
            assert (await _call(http, KEYS["flood"], body=b"{not json"))[:2] == (400, "malformed_body")
        began = time.perf_counter()
        assert (await _call(http, KEYS["flood"], body=b"{not json"))[:2] == (400, "malformed_body")
        assert time.perf_counter() - began >= 0.45
        assert app[REFUSAL_PACER].paced == 1
