"""The per-key request rate (grpo_server/api/rate_limit.py, ServerConfig.key_rate_limit / key_rate_burst): a key's
flood past its burst is answered 429 `rate_limited` with Retry-After before its body is read, while another key,
the admin and public routes go on; the bucket refills at the rate. Over the real app's routes and middlewares
(without workers), then the bucket on its own on a fake clock."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from grpo_server.api.rate_limit import KeyRateLimiter
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

    app = create_app(ServerConfig(key_rate_limit=2.0, key_rate_burst=5), "admin-key-0123456789")
    del app.cleanup_ctx[:]  # no workers: the routes only
    app[ORCHESTRATOR] = _Orchestrator()
    limiter = app[RATE_LIMITER]
    assert (limiter.rate, limiter.burst) == (2.0, 5)  # the config's
    limiter.clock = clock = Clock()
    async with TestClient(TestServer(app)) as http:
        yield http, clock


async def _call(http, key: str, name: str = "flood", body: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"}
    if body is None:
        response = await http.get(f"/v1/experiments/{name}", headers=headers)
    else:
        response = await http.post(f"/v1/experiments/{name}/feedback", data=body, headers=headers)
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
