"""Which weights serve a request on the vLLM engine: the base model's (adapters through LoRA), or one
experiment's adapter merged into them (sampler/merged_weights.py does the merge inside vLLM's worker).

A request for a lone experiment's newest loaded version needs that version merged in and carries no LoRA:
base-model speed on CPU, the same function. Every other request (an older version, an adapter merging
refused, the base model) needs the base weights, its adapter through LoRA. While several experiments
sample at once (any of their requests waiting or running here, or done within `lone_after_s`: a client
pauses between its groups), `several_experiments` decides:

- `lora_batch` (the default): their requests all need the base weights, so vLLM batches them together,
  each through its own adapter. With sampler/lora_cpu_ops.py's grouped ops that beats merged turns on this
  CPU in total tok/s and in latency alike (docs/benchmarks/findings.md "Several experiments"): a batch
  of k experiments' sequences costs far less than k batches of one. Once the others' requests are done,
  the remaining experiment's next ones need its merge again.
- `turns`: each experiment's newest version still needs its own merge, and the states take turns.
- `auto`: turns where the sampler computes in bf16, else lora_batch. In bf16 vLLM adds a LoRA update to a
  layer output already rounded to bf16, so a small update applies only in part (the push check read a first
  step at 0.44 of itself), where a merge rounds it stochastically into the weights
  (sampler/merged_weights.py). Not the default: in two fleet races each on the bf16 defaults, four
  experiments at once were no sooner at 0.6 in turns (docs/benchmarks/findings.md "Several experiments").

Either way the weight states change through sampler/weight_turns.py: requests needing the state held now
run, batched together, and the weights change between turns only, with the gate held exclusively (no
request running); the prefix cache is reset after each change, since un-adapted blocks are keyed by
tokens alone. The turns' budget also keeps a lone experiment and a batch of several from trading the
weights faster than every few seconds. Where merging is off or unsupported (GPU, `merge_lone_adapter:
false`, a failed merge) every request needs the base weights: one state, no turns, LoRA as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

from grpo_server.protocol.errors import Unavailable
from grpo_server.protocol.wire import AdapterRef, ServedAs
from sampler.engine_interface import adapter_not_loaded
from sampler.weight_turns import WeightTurns

log = logging.getLogger(__name__)


def several_experiments_policy(setting: str, dtype: str) -> str:
    """`several_experiments` as it applies to a sampler computing in `dtype` (its resolved config's)."""
    if setting != "auto":
        return setting
    return "turns" if dtype in ("bfloat16", "float16") else "lora_batch"


# Tries of reset_prefix_cache after a weight change: it refuses while blocks are still held by a
# request the scheduler has not freed yet.
PREFIX_RESET_TRIES = 50


class ExperimentsSampling:
    """Which experiments sample here now: requests waiting or running, by experiment ("" for the base
    model), and when each experiment's last request ended."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.last_end: dict[str, float] = {}

    def started(self, name: str) -> _Request:
        self.requests[name] += 1
        return _Request(self, name)

    def others_than(self, name: str, within_s: float) -> bool:
        """Whether another experiment has a request here, or had one that ended within `within_s`."""
        recent = time.monotonic() - within_s
        # Forget the experiments quiet for longer than that (deleted ones among them), so the look stays short.
        for quiet in [other for other, ended in self.last_end.items() if ended <= recent and self.requests[other] <= 0]:
            del self.last_end[quiet], self.requests[quiet]
        return any(other != name for other in self.requests)


class _Request:
    __slots__ = ("sampling", "name", "ended")

    def __init__(self, sampling: ExperimentsSampling, name: str) -> None:
        self.sampling, self.name, self.ended = sampling, name, False

    def end(self) -> None:
        """Idempotent: the first call counts."""
        if not self.ended:
            self.ended = True
            self.sampling.requests[self.name] -= 1
            self.sampling.last_end[self.name] = time.monotonic()


class MergedServing:
    """Mixed into `VllmEngine`: uses its `_llm`, `_adapters` (key -> entry with `.ref`, `.path`), `_gate`,
    and its `merged` / `merge_unsupported` attributes."""

    @property
    def _turns(self) -> WeightTurns:
        # Made on first use, beside the engine's own attributes (VllmEngine.__init__ knows nothing of it).
        turns = getattr(self, "_weight_turns", None)
        if turns is None:
            turns = self._weight_turns = WeightTurns(lambda: self.merged, self._switch_weights)
        return turns

    @property
    def _sampling_now(self) -> ExperimentsSampling:
        # Made on first use, as _turns.
        sampling = getattr(self, "_experiments_sampling", None)
        if sampling is None:
            sampling = self._experiments_sampling = ExperimentsSampling()
        return sampling

    @property
    def several_policy(self) -> str:
        return several_experiments_policy(self.config.several_experiments, self.config.dtype)

    def _merge_target(self, adapter: AdapterRef | None) -> str | None:
        """The weight state a request on `adapter` needs: its own key when it is its experiment's newest
        loaded version, merging works here, and (with `lora_batch`) no other experiment samples now; else
        None (the base weights, adapters through LoRA)."""
        if adapter is None or self.merge_unsupported is not None or adapter.key not in self._adapters:
            return None
        newest = max(entry.ref.version for entry in self._adapters.values() if entry.ref.name == adapter.name)
        if adapter.version != newest:
            return None
        if self.several_policy == "lora_batch" and self._sampling_now.others_than(
                adapter.name, self.config.lone_after_s):
            return None
        return adapter.key

    @staticmethod
    def _served_as(adapter: AdapterRef | None, held: str | None) -> ServedAs:
        if adapter is None:
            return "base"
        return "merged" if held == adapter.key else "lora"

    @contextlib.asynccontextmanager
    async def _serving(self, adapter: AdapterRef | None, alone: bool = False) -> AsyncIterator[ServedAs]:
        """Wait for the turn of the weights right for `adapter`, then hold the gate; yields how its requests
        are to be sent. The weights stay put until the body is done.

        `alone`: the requests must have the engine to themselves (prompt logprobs, see vllm_engine.py's
        docstring): the gate exclusively, inside the turn, so the turn's other requests wait around them."""
        if adapter is not None and adapter.key not in self._adapters:
            raise adapter_not_loaded(adapter)  # before any waiting: a bad request must not take a turn
        name = adapter.name if adapter is not None else ""
        request = self._sampling_now.started(name)
        try:
            async with self._turns.turn(lambda: self._merge_target(adapter)) as held:
                try:
                    async with self._gate.exclusive() if alone else self._gate.shared():
                        yield self._served_as(adapter, held)
                finally:
                    request.end()  # before the turn's end decides what runs next: the others' needs change
        finally:
            request.end()  # cancelled or failed while waiting for the turn

    async def _switch_weights(self, key: str | None) -> None:
        """The turns' switch: no request runs (WeightTurns calls it only then); the gate is taken anyway,
        so nothing else that holds it can overlap a weight change."""
        if key is not None and key not in self._adapters:
            return  # unloaded while its requests waited: they need the base weights now, the next switch
        async with self._gate.exclusive():
            await self._set_merged(key)

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
        # Debug: with several experiments this happens every turn.
        log.debug("weights now %s (%.2f s)", f"merged with {key}" if key else "the base model's", seconds)
        self.merged = key

    async def _reset_prefix_cache(self) -> None:
        for _ in range(PREFIX_RESET_TRIES):
            if await self._llm.reset_prefix_cache():
                return
            await asyncio.sleep(0.02)
        raise Unavailable("vLLM kept refusing to reset its prefix cache after a weight change", code="engine_busy")
