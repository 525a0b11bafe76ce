"""Which weights serve a request on the vLLM engine: the base model's (adapters through LoRA), or one
experiment's adapter merged into them (sampler/merged_weights.py does the merge inside vLLM's worker).

While one experiment is loaded, its newest version is
folded into the base weights and its requests carry no LoRA: base-model speed on CPU, the same
function. The weights change only with the gate held exclusively (no request running) and the
prefix cache is reset after each change, since un-adapted blocks are keyed by tokens alone. The merged
version only moves forward: a request for an older version, a second experiment or the base model
restores the base weights and runs through LoRA as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from grpo_server.protocol.errors import Unavailable
from grpo_server.protocol.wire import AdapterRef, ServedAs
from sampler.engine import adapter_not_loaded

log = logging.getLogger(__name__)

# Tries of reset_prefix_cache after a weight change: it refuses while blocks are still held by a
# request the scheduler has not freed yet.
PREFIX_RESET_TRIES = 50


class MergedServing:
    """Mixed into `VllmEngine`: uses its `_llm`, `_adapters` (key -> entry with `.ref`, `.path`), `_gate`,
    and its `merged` / `merge_unsupported` attributes."""

    def _merge_target(self, adapter: AdapterRef | None) -> str | None:
        """The adapter key the weights should hold for a request on `adapter`: its own when it is the
        only experiment loaded and not older than what is merged now; else None (base weights)."""
        if adapter is None or self.merge_unsupported is not None or adapter.key not in self._adapters:
            return None
        if any(entry.ref.name != adapter.name for entry in self._adapters.values()):
            return None
        if self.merged is not None and self.merged != adapter.key:
            merged = self._adapters.get(self.merged)
            if merged is not None and merged.ref.version > adapter.version:
                return None
        return adapter.key

    def _served_as(self, adapter: AdapterRef | None) -> ServedAs:
        if adapter is None:
            return "base"
        return "merged" if self.merged == adapter.key else "lora"

    @contextlib.asynccontextmanager
    async def _serving(self, adapter: AdapterRef | None, alone: bool = False) -> AsyncIterator[ServedAs]:
        """Hold the gate with the weights right for `adapter`; yields how its requests are to be sent.

        `alone`: the requests must have the engine to themselves (prompt logprobs, see the module
        docstring)."""
        if adapter is not None and adapter.key not in self._adapters:
            raise adapter_not_loaded(adapter)  # before any weight change: a bad request must not unmerge
        if alone:
            async with self._gate.exclusive():
                await self._set_merged(self._merge_target(adapter))
                yield self._served_as(adapter)
            return
        while True:
            target = self._merge_target(adapter)
            if target == self.merged:
                async with self._gate.shared():
                    if self._merge_target(adapter) == self.merged:
                        yield self._served_as(adapter)
                        return
                continue
            async with self._gate.exclusive_then_shared(lambda: self._set_merged(self._merge_target(adapter))):
                yield self._served_as(adapter)
                return

    async def _set_merged(self, key: str | None) -> None:
        """Fold `key`'s adapter into the weights (None: restore the base). Called with the gate held
        exclusively. A failure restores the base weights and turns merging off for good."""
        if key == self.merged:
            return
        path = self._adapters[key].path if key is not None else None
        try:
            seconds = (await self._llm.collective_rpc("merge_adapter", args=(path,)))[0]
            await self._reset_prefix_cache()
        except Exception as exc:
            log.exception("merging %s failed; serving through LoRA from now on", key)
            self.merge_unsupported = f"merging {key} failed: {exc}"
            self.merged = None
            await self._llm.collective_rpc("merge_adapter", args=(None,))
            await self._reset_prefix_cache()
            return
        log.info("weights now %s (%.2f s)", f"merged with {key}" if key else "the base model's", seconds)
        self.merged = key

    async def _reset_prefix_cache(self) -> None:
        for _ in range(PREFIX_RESET_TRIES):
            if await self._llm.reset_prefix_cache():
                return
            await asyncio.sleep(0.02)
        raise Unavailable("vLLM kept refusing to reset its prefix cache after a weight change", code="engine_busy")
