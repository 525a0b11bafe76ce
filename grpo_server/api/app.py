"""The front end's aiohttp application: the route table (every API family's `ROUTES`, `route_table.py`), the
middlewares of `edge.py` (one error mapping), workers and experiments owned by a cleanup context (started before
the port opens, stopped when the app stops)."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from typing import AsyncIterator

import aiohttp
from aiohttp import web

from grpo_server.api import prometheus, status_page
from grpo_server.api.app_state import (ADMIN_KEY, AUTH_LIMITER, BODY_POOL, DOWNLOADS, HTTP_COUNTER, METRICS_REGISTRY,
                                      MODEL_NAME, OPENAPI_JSON, ORCHESTRATOR, RATE_LIMITER, REFUSAL_PACER, RESPONSES,
                                      TINKER)
from grpo_server.api.anthropic.routes import ROUTES as ANTHROPIC_ROUTES
from grpo_server.api.auth_limit import FailedAuthLimiter
from grpo_server.api.body_pool import BodyPool
from grpo_server.api.rate_limit import KeyRateLimiter, RefusalPacer
from grpo_server.api.native.downloads import Downloads
from grpo_server.api.edge import (aiohttp_routes, context_middleware, count_middleware, echo_request_id,
                                   error_middleware)
from grpo_server.api.native.routes import ROUTES as NATIVE_ROUTES
from grpo_server.api.openai.responses import response_store
from grpo_server.api.openai.routes import ROUTES as OPENAI_ROUTES
from grpo_server.api.openapi import openapi_json
from grpo_server.api.route_table import Endpoint
from grpo_server.api.tinker.futures import FutureStore
from grpo_server.api.tinker.routes import ROUTES as TINKER_ROUTES
from grpo_server.api.tinker.service import TinkerService
from grpo_server.config import EMBEDDED_MODEL_HUB_ID, EMBEDDED_MODEL_NAME, ServerConfig
from grpo_server.protocol.worker_auth import auth_headers
from grpo_server.runtime.orchestrator import Orchestrator
from grpo_server.runtime.prompts import PromptBuilder
from grpo_server.workers.launch import WorkerSet

log = logging.getLogger(__name__)


# The server's route table: every API family's rows. Registration, auth (tests/test_auth.py) and the OpenAPI
# document all read it.
ENDPOINTS: tuple[Endpoint, ...] = NATIVE_ROUTES + OPENAI_ROUTES + ANTHROPIC_ROUTES + TINKER_ROUTES


def routes() -> list[web.RouteDef]:
    return aiohttp_routes(ENDPOINTS)


def page_routes() -> list[web.RouteDef]:
    """Pages for people, beside the API (so not in its OpenAPI table): they hold no data and need no key;
    their scripts call the API with the key the person gives them."""
    return [web.get("/", status_page.status_page)]


def create_app(config: ServerConfig, admin_key: str) -> web.Application:
    app = web.Application(middlewares=[context_middleware, count_middleware, error_middleware],
                          client_max_size=config.max_body_bytes)
    app.on_response_prepare.append(echo_request_id)
    app.add_routes(routes() + page_routes())
    app[HTTP_COUNTER] = prometheus.HttpCounter()
    app[METRICS_REGISTRY] = prometheus.registry(app[HTTP_COUNTER], lambda: app[ORCHESTRATOR])
    app[ADMIN_KEY] = admin_key
    app[AUTH_LIMITER] = FailedAuthLimiter(config.auth_failure_limit, config.auth_failure_window_s,
                                          config.auth_limit_exempt)
    app[RATE_LIMITER] = KeyRateLimiter(config.key_rate_limit, config.key_rate_burst)
    app[REFUSAL_PACER] = RefusalPacer(config.key_refusal_hold_s)
    # The public health answer names the model, never a server path: a local folder by its own name.
    app[MODEL_NAME] = Path(config.model).name
    app[OPENAPI_JSON] = openapi_json(ENDPOINTS)
    app[RESPONSES] = response_store(config)
    app[DOWNLOADS] = downloads = Downloads()
    app[BODY_POOL] = bodies = BodyPool()

    async def close_pools(app: web.Application) -> None:
        downloads.close()
        await asyncio.to_thread(bodies.close)
    app.on_cleanup.append(close_pools)

    async def workers_and_orchestrator(app: web.Application) -> AsyncIterator[None]:
        workers = WorkerSet(config)
        # Every call to a worker (verbs, health polls, adapter downloads) goes through this session, so it
        # carries the workers' secret (grpo_server/protocol/worker_auth.py), and nothing else does.
        session = aiohttp.ClientSession(headers=auth_headers(workers.secret))
        orchestrator: Orchestrator | None = None
        # The tokenizers load on a thread while the workers start (~10 s of importing transformers and copying
        # tokenizers, measured on 2 cores): the workers take longer, and leave a core free for most of it.
        prompts_loading = asyncio.ensure_future(asyncio.to_thread(
            PromptBuilder, workers.model_dir, config.max_model_len, config.max_prompt_tokens))
        decoder_starting = asyncio.ensure_future(bodies.start_process())  # api/body_pool.py: not at the first body
        try:
            pool = await workers.start(session, on_sampler_restart=lambda i: orchestrator.resync_sampler(i),
                                       on_learner_restart=lambda: orchestrator.resync_learner())
            orchestrator = Orchestrator(config, pool, await prompts_loading)
            app[ORCHESTRATOR] = orchestrator
            app[TINKER] = TinkerService(orchestrator, tinker_base_model(config), FutureStore(
                max_running_per_owner=config.tinker_max_calls_per_key,
                max_bytes_per_owner=config.tinker_max_result_mib_per_key * 2**20))
            # Experiments of an earlier run in this run directory resume first; the config's own are
            # created if they are not among them. Both start from their files as they are (a restart
            # archives nothing; only an API create does, grpo_server/protocol/archive.py).
            resumed = orchestrator.saved_experiments()
            names = {e.name for e in resumed}
            await orchestrator.start_saved(resumed + [e for e in config.experiments if e.name not in names])
            app[TINKER].restore()
            orchestrator.start_upkeep()
            await decoder_starting
            log.info("grpo_server ready on http://%s:%s (status page at /)", config.host, config.port)
            # What exists now (imports, tokenizers, the route table) lives as long as the process: out of the
            # collector's sight, its full collections stay short while serving, and the interpreter's final
            # one at exit took 0.7 s of every stop (faulthandler stacks of a test server's stop).
            gc.freeze()
            yield
        finally:
            if TINKER in app:
                await app[TINKER].futures.close()
            if orchestrator is not None:
                await orchestrator.close()
            else:  # the workers failed to start: the tokenizers' threads go too (a thread cannot be cancelled)
                loaded = (await asyncio.gather(prompts_loading, return_exceptions=True))[0]
                if isinstance(loaded, PromptBuilder):
                    loaded.close()
            await workers.stop()
            await session.close()

    app.cleanup_ctx.append(workers_and_orchestrator)
    return app


def tinker_base_model(config: ServerConfig) -> str:
    """The base model's name on the Tinker API (config.tinker_base_model's default)."""
    if config.tinker_base_model is not None:
        return config.tinker_base_model
    return EMBEDDED_MODEL_HUB_ID if config.model == EMBEDDED_MODEL_NAME else config.model
