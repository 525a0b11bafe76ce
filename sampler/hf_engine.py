"""The sampler's transformers + peft engine, for machines without vLLM. Same verbs, same numbers.

It mirrors what the vLLM engine returns, so the front end cannot tell them apart:
- logprobs are vLLM's "processed logprobs": log_softmax(logits / T) after top-p masking, in float32;
  T = 0 is greedy decoding with the logprobs of the untempered distribution;
- top-p masks like vLLM's pytorch path (ascending sort, drop tokens whose cumulative probability is
  <= 1 - p, always keep the most likely one);
- an EOS token ends a completion with finish_reason "stop" and stays in token_ids (as in vLLM); a stop
  string ends it with "stop" too, its token ids kept up to the token that completed the string;
- a seed s seeds completion i with s + i (vLLM's parallel sampling does the same), so results repeat.
Every model call runs in a worker thread under one lock: the event loop keeps answering /health. Generate
requests that wait meanwhile run together, each under its own adapter (sampler/hf_batches.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path
from typing import Any

from grpo_server.protocol.errors import BadRequest, Conflict
from grpo_server.protocol.worker_config import SamplerConfig
from grpo_server.protocol.sampling_distribution import outside_nucleus
from grpo_server.protocol.wire import (
    AdapterRef,
    Completion,
    GenerateRequest,
    GenerateResponse,
    ScoreRequest,
    ScoreResponse,
)
from sampler.engine_interface import (
    Engine,
    adapter_not_loaded,
    check_adapter_dir,
    completion_text,
    torch_dtype_name,
)
from sampler.hf_batches import BASE, GenerateBatches, Waiting, decode


def _eos_ids(model_path: Path, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS plus generation_config.json's eos_token_id(s), as vLLM stops on both."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def top_p_mask(logits_B_V: Any, top_p: float) -> Any:
    """vLLM's top-p (protocol/sampling_distribution.py): -inf for tokens outside the nucleus."""
    return logits_B_V.masked_fill(outside_nucleus(logits_B_V, top_p), -float("inf"))


def sample_step(logits_B_V: Any, temperature: float, top_p: float, generators: list[Any]) -> tuple[Any, Any]:
    """Next token per row and its processed logprob. Row i draws from generators[i] only."""
    import torch

    if temperature == 0:
        logprobs_B_V = torch.log_softmax(logits_B_V, dim=-1)
        ids_B = logprobs_B_V.argmax(dim=-1)
    else:
        scaled_B_V = logits_B_V / temperature
        if top_p < 1:
            scaled_B_V = top_p_mask(scaled_B_V, top_p)
        logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
        probs_B_V = logprobs_B_V.exp()
        ids_B = torch.cat(
            [torch.multinomial(probs_B_V[i], 1, generator=gen) for i, gen in enumerate(generators)]
        )
    return ids_B, logprobs_B_V.gather(1, ids_B.unsqueeze(1)).squeeze(1)


class HfEngine(Engine):
    name = "transformers"

    def __init__(self, config: SamplerConfig) -> None:
        super().__init__(config)
        self._model: Any = None  # the base model, or the PeftModel around it once an adapter is loaded
        self._tokenizer: Any = None
        self._eos: set[int] = set()
        self._adapters: dict[str, tuple[str, str]] = {}  # key -> (peft adapter name, path)
        self._next_name = 1
        self._lock = threading.Lock()  # one model call at a time (peft's active adapter is global)
        self._seeds = random.Random(config.seed)  # seeds for requests that bring none
        self.batches = GenerateBatches(self._run_batch, max_rows=config.max_num_seqs)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = str(self.config.model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = getattr(torch, torch_dtype_name(self.config.dtype))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self._model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self._eos = _eos_ids(self.config.model_path, self._tokenizer)

    async def shutdown(self) -> None:
        await self.batches.close()
        self._model = None

    async def _call(self, fn: Any, *args: Any) -> Any:
        def locked() -> Any:
            with self._lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    # --- model access --------------------------------------------------------------------------

    def _use(self, adapter: AdapterRef | None) -> Any:
        """A context manager that runs the model under `adapter` (None = the base model)."""
        import contextlib

        from peft import PeftModel

        is_peft = isinstance(self._model, PeftModel)
        if adapter is None:
            return self._model.disable_adapter() if is_peft else contextlib.nullcontext()
        entry = self._adapters.get(adapter.key)
        if entry is None or not is_peft:  # checked under the lock: an unload may have just run
            raise adapter_not_loaded(adapter)
        self._model.set_adapter(entry[0])
        return contextlib.nullcontext()

    def _device(self) -> Any:
        return next(self._model.parameters()).device

    # --- generate ------------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        if req.tool_calling is not None:
            raise BadRequest("tool calls need the vLLM engine (vLLM's tool parsers and structured outputs); "
                             "this sampler runs transformers", code="tools_unsupported")
        self.limits.check_generate(req)
        if req.stop_token_ids or req.ignore_eos:
            raise BadRequest("stop token ids and ignore_eos need the vLLM engine; this sampler runs transformers",
                             code="unsupported_parameter")
        seed = req.seed if req.seed is not None else self._seeds.randrange(2**31)
        completions = await self.batches.generate(req, seed)
        return GenerateResponse(prompt_token_ids=req.prompt_token_ids, completions=completions,
                                served_as="base" if req.adapter is None else "lora")

    async def _run_batch(self, batch: list[Waiting]) -> list[list[Completion] | BaseException]:
        return await self._call(self._decode, batch)

    def _decode(self, batch: list[Waiting]) -> list[list[Completion] | BaseException]:
        """Under the lock: each request's adapter looked up now (an unload may have just run; a request whose
        adapter is gone gets its 404, the others run), then one decode for the rest."""
        from peft import PeftModel

        is_peft = isinstance(self._model, PeftModel)
        results: list[list[Completion] | BaseException | None] = [None] * len(batch)
        names: list[str] = []
        for i, waiting in enumerate(batch):
            adapter = waiting.req.adapter
            entry = None if adapter is None else self._adapters.get(adapter.key)
            if adapter is not None and (entry is None or not is_peft):
                results[i] = adapter_not_loaded(adapter)
            else:
                names.append(BASE if entry is None else entry[0])
        runnable = [w for w, r in zip(batch, results) if r is None]
        if runnable:
            decoded = iter(decode(self._model, runnable, names if is_peft else None, self._device(), sample_step,
                                  self._stopped, lambda ids, hit: completion_text(self._tokenizer, ids, hit)))
            results = [next(decoded) if r is None else r for r in results]
        return results

    def _stopped(self, tokens: list[int], stop: list[str] | None) -> tuple[str | None, str | None]:
        if tokens[-1] in self._eos:
            return "stop", None
        if stop:
            # vLLM checks stop strings against the detokenized completion as each token arrives.
            text = self._tokenizer.decode(tokens, skip_special_tokens=True)
            for s in stop:
                if s in text:
                    return "stop", s
        return None, None

    # --- score ---------------------------------------------------------------------------------

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        self.limits.check_score(req)
        return ScoreResponse(logprobs=await self._call(self._score, req))

    def _score(self, req: ScoreRequest) -> list[list[float]]:
        import torch

        temperature = req.temperature if req.temperature > 0 else 1.0
        results = []
        with torch.inference_mode(), self._use(req.adapter):
            for completion in req.completions_token_ids:
                if not completion:
                    results.append([])
                    continue
                ids = torch.tensor([req.prompt_token_ids + completion], device=self._device())
                # Logits at the last len(completion) + 1 positions; the final one predicts nothing we score.
                out = self._model(input_ids=ids, use_cache=False, logits_to_keep=len(completion) + 1)
                logits = out.logits[0, :-1, :].float() / temperature
                lps = torch.log_softmax(logits, dim=-1)
                target = torch.tensor(completion, device=lps.device).unsqueeze(1)
                results.append(lps.gather(1, target).squeeze(1).tolist())
        return results

    # --- adapters ------------------------------------------------------------------------------

    async def load_adapter(self, adapter: AdapterRef, path: str) -> None:
        check_adapter_dir(path, self.config.max_lora_rank)
        await self._call(self._load_adapter, adapter, str(Path(path).resolve()))

    def _load_adapter(self, adapter: AdapterRef, path: str) -> None:
        from peft import PeftModel

        existing = self._adapters.get(adapter.key)
        if existing is not None:
            if existing[1] == path:
                return  # a retried push: already there
            raise Conflict(
                f"{adapter.key} is already loaded from {existing[1]}; a new version needs a new version number",
                code="adapter_exists",
            )
        if len(self._adapters) >= self.config.max_cpu_loras:
            raise Conflict(
                f"{len(self._adapters)} adapters are loaded (max_cpu_loras); unload one first", code="too_many_adapters"
            )
        # peft names become module keys (no dots allowed): use a fresh internal name per version.
        name = f"v{self._next_name}"
        self._next_name += 1
        try:
            if isinstance(self._model, PeftModel):
                self._model.load_adapter(path, adapter_name=name)
            else:
                self._model = PeftModel.from_pretrained(self._model, path, adapter_name=name).eval()
        except Exception as exc:  # peft raises ValueError/KeyError/RuntimeError for a bad folder
            raise BadRequest(f"peft could not load {path}: {exc}", code="bad_adapter") from exc
        self._adapters[adapter.key] = (name, path)

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        await self._call(self._unload_adapter, adapter)

    def _unload_adapter(self, adapter: AdapterRef) -> None:
        entry = self._adapters.pop(adapter.key, None)
        if entry is None:
            raise adapter_not_loaded(adapter)
        self._model.delete_adapter(entry[0])
        if not self._adapters:
            # peft keeps a stale active adapter once the last one is gone (disable_adapter() then
            # raises KeyError): go back to the plain model; the next load wraps it again.
            self._model = self._model.unload()

    async def loaded_adapters(self) -> list[str]:
        return list(self._adapters)
