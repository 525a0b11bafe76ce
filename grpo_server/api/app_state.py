"""Objects shared through the aiohttp application (typed `web.AppKey`s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.registry import CollectorRegistry

if TYPE_CHECKING:
    from grpo_server.api.auth_limit import FailedAuthLimiter
    from grpo_server.api.body_pool import BodyPool
    from grpo_server.api.native.downloads import Downloads
    from grpo_server.api.openai.responses_store import ResponseStore
    from grpo_server.api.prometheus import HttpCounter
    from grpo_server.api.rate_limit import KeyRateLimiter, RefusalPacer
    from grpo_server.api.tinker.service import TinkerService
    from grpo_server.runtime.orchestrator import Orchestrator

ORCHESTRATOR: web.AppKey["Orchestrator"] = web.AppKey("orchestrator")
ADMIN_KEY: web.AppKey[str] = web.AppKey("admin_key", str)
MODEL_NAME: web.AppKey[str] = web.AppKey("model_name", str)
OPENAPI_JSON: web.AppKey[bytes] = web.AppKey("openapi_json", bytes)  # built once, from the route table
HTTP_COUNTER: web.AppKey["HttpCounter"] = web.AppKey("http_counter")
AUTH_LIMITER: web.AppKey["FailedAuthLimiter"] = web.AppKey("auth_limiter")
RATE_LIMITER: web.AppKey["KeyRateLimiter"] = web.AppKey("rate_limiter")  # requests a second per experiment key
REFUSAL_PACER: web.AppKey["RefusalPacer"] = web.AppKey("refusal_pacer")  # a flooding key's 429s, answered later
METRICS_REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("metrics_registry", CollectorRegistry)
TINKER: web.AppKey["TinkerService"] = web.AppKey("tinker")  # the Tinker API's sessions, models and futures
RESPONSES: web.AppKey["ResponseStore"] = web.AppKey("responses")  # stored responses (previous_response_id)
BODY_POOL: web.AppKey["BodyPool"] = web.AppKey("body_pool")  # large bodies decoded on threads of their own
DOWNLOADS: web.AppKey["Downloads"] = web.AppKey("downloads")  # adapter downloads' own threads and per-key cap
