"""The sampler's HTTP side: `SamplerVerbs` (grpo_server/protocol/verbs.py) on one `Engine`.

POST /generate /score /load_adapter /unload_adapter /pause /resume, GET /health, as routes of
`grpo_server/protocol/dispatch.py`, which also maps every error to `{"error": {"code", "message"}}`
(an `ApiError` the engine raises keeps its code and status). The engine starts and stops with the app
(a cleanup context), so the port only answers once the model is loaded. A version whose folder this
host does not see is copied from the learner first (sampler/adapter_copies.py), only from the learner this
replica was configured with (`SamplerConfig.learner_url`).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from aiohttp import web

from grpo_server.protocol.dispatch import worker_app
from grpo_server.protocol.verbs import AdapterList, SamplerVerbs
from grpo_server.protocol.wire import (
    GenerateRequest, GenerateResponse, LoadAdapterRequest, Paused, PauseRequest, ResumeRequest, SamplerHealth,
    ScoreRequest, ScoreResponse, UnloadAdapterRequest,
)
from sampler.adapter_copies import AdapterCopies
from sampler.engine_interface import Engine

log = logging.getLogger(__name__)

# Score bodies carry many completions; aiohttp's 1 MiB default is too small.
MAX_BODY_BYTES = 256 * 1024 * 1024


class SamplerHandler:
    """One method per sampler verb, each named like it, over the engine."""

    def __init__(self, engine: Engine, copies: AdapterCopies) -> None:
        self.engine = engine
        self.copies = copies

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        return await self.engine.generate(req)

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        return await self.engine.score(req)

    async def load_adapter(self, req: LoadAdapterRequest) -> AdapterList:
        async with self.copies.loading(req) as path:  # the learner's folder, or a copy of it fetched over HTTP
            try:
                await self.engine.load_adapter(req.adapter, path)
            except Exception:
                if path != req.path and req.adapter.key not in await self.engine.loaded_adapters():
                    self.copies.forget(req.adapter)
                raise
        loaded = await self.engine.loaded_adapters()
        self.copies.sweep(loaded)  # copies whose unload never arrived: disk bounded by what is loaded
        return AdapterList(adapters=loaded)

    async def unload_adapter(self, req: UnloadAdapterRequest) -> AdapterList:
        await self.engine.unload_adapter(req.adapter)
        self.copies.forget(req.adapter)
        return AdapterList(adapters=await self.engine.loaded_adapters())

    async def pause(self, req: PauseRequest) -> Paused:
        return Paused(paused=await self.engine.pause(req.lease_s))

    async def resume(self, req: ResumeRequest) -> Paused:
        await self.engine.resume()
        return Paused(paused=False)

    async def health(self) -> SamplerHealth:
        engine = self.engine
        return SamplerHealth(
            engine=engine.name,
            model=str(engine.config.model_path),
            adapters=await engine.loaded_adapters(),
            max_model_len=engine.max_model_len,
            merged_adapter=engine.merged,
            merge_unsupported=engine.merge_unsupported,
            prefix_cache=engine.prefix_cache,
            dtype=engine.dtype_name,
            compiled=engine.compiled,
        )


def create_app(engine: Engine, secret: str) -> web.Application:
    """The sampler's verbs for callers with the workers' `secret` (protocol/dispatch.py); the same secret
    fetches adapter files from the learner."""
    async def engine_lifetime(app: web.Application) -> AsyncIterator[Any]:
        await engine.start()
        log.info("%s engine ready (max_model_len %d)", engine.name, engine.max_model_len)
        yield
        await engine.shutdown()

    config = engine.config
    handler = SamplerHandler(engine, AdapterCopies(config.run_dir, config.replica, config.learner_url, secret))
    app = worker_app(SamplerVerbs.ALL, handler, MAX_BODY_BYTES, secret=secret)
    app.cleanup_ctx.append(engine_lifetime)
    app.on_cleanup.append(lambda _: handler.copies.close())
    return app
