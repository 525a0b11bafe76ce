"""The transformers engine's generate requests, run together: one decode over the rows of every request waiting,
each row under its own adapter (peft's mixed-adapter batches, `adapter_names`), as vLLM batches LoRA requests.

Why: the engine runs one model call at a time. With one request a call, k experiments sampling at once took turns,
and on the H200 8 of them together sampled no faster than one alone (docs/development/index.md "The whole stack on a
GPU": 0.34 groups/s at once against 0.35 alone), while a decode step of 64 rows costs about what one of 8 does there
(710 against 200 tok/s). A request that arrives while a batch decodes waits for the next batch (no continuous
batching: the fallback engine stays simple); a batch ends when its longest request does.

Rows: a request's prompt is prefilled once (left-padded beside the others', with position ids from the mask),
and its cache row copied for each of its n completions; greedy requests decode one row and repeat it (as
before). Each row samples from its own generator, seeded seed + i, so a seeded request gives the same tokens
whichever batch it lands in, up to the last bits of the logits (padding changes the shapes of the matmuls).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from grpo_server.protocol.wire import Completion, GenerateRequest

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


@dataclass
class Waiting:
    """A generate request in line for a batch, with the seed it was given and where its answer goes."""

    req: GenerateRequest
    seed: int
    done: asyncio.Future = field(repr=False)

    @property
    def rows(self) -> int:
        return 1 if self.req.temperature == 0 else self.req.n


RunBatch = Callable[[list[Waiting]], Awaitable[list["list[Completion] | BaseException"]]]


class GenerateBatches:
    """Requests wait here; one runner task takes them in arrival order, up to `max_rows` rows a batch (a request
    with more rows still runs, alone), and hands each its completions or its own error."""

    def __init__(self, run_batch: RunBatch, max_rows: int):
        self.run_batch = run_batch
        self.max_rows = max_rows
        self._waiting: collections.deque[Waiting] = collections.deque()
        self._runner: asyncio.Task | None = None
        self.batches = 0  # batches run, and requests in them: how much batching happened (tests, logs)
        self.requests = 0

    async def generate(self, req: GenerateRequest, seed: int) -> list[Completion]:
        waiting = Waiting(req, seed, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name="hf-generate-batches")
        return await waiting.done

    def _take(self) -> list[Waiting]:
        batch: list[Waiting] = []
        rows = 0
        while self._waiting:
            head = self._waiting[0]
            if head.done.done():  # its caller went away (cancelled): nothing to compute
                self._waiting.popleft()
                continue
            if batch and rows + head.rows > self.max_rows:
                break
            batch.append(self._waiting.popleft())
            rows += head.rows
        return batch

    async def _run(self) -> None:
        while batch := self._take():
            try:
                results = await self.run_batch(batch)
            except asyncio.CancelledError:  # close(): the batch in flight must not leave its callers waiting
                _fail(batch)
                raise
            except Exception as exc:  # noqa: BLE001 - the whole batch failed: each caller gets the error
                results = [exc] * len(batch)
            self.batches += 1
            self.requests += len(batch)
            for waiting, result in zip(batch, results):
                if waiting.done.done():
                    continue
                if isinstance(result, BaseException):
                    waiting.done.set_exception(result)
                else:
                    waiting.done.set_result(result)

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        _fail(list(self._waiting))
        self._waiting.clear()


def _fail(batch: list[Waiting]) -> None:
    for waiting in batch:
        if not waiting.done.done():
            waiting.done.set_exception(RuntimeError("the sampler is shutting down"))


def decode(model: Any, batch: list[Waiting], adapters: list[str] | None, device: Any,
           sample_step: Callable, stopped: Callable[[list[int], list[str] | None], tuple[str | None, str | None]],
           text_of: Callable[[list[int], str | None], str]) -> list[list[Completion]]:
    """Each request's completions, decoded together. `adapters`: each request's peft adapter name (BASE for the
    base model), or None when the model has no adapters (a plain transformers model)."""
    import torch

    prompts = [w.req.prompt_token_ids for w in batch]
    width = max(len(p) for p in prompts)
    ids_Q_T = torch.zeros((len(batch), width), dtype=torch.long, device=device)  # Q: one row a request
    mask_Q_T = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    for q, prompt in enumerate(prompts):
        ids_Q_T[q, width - len(prompt):] = torch.tensor(prompt, device=device)
        mask_Q_T[q, width - len(prompt):] = 1
    positions_Q_T = (mask_Q_T.cumsum(-1) - 1).clamp(min=0)
    owner = [q for q, w in enumerate(batch) for _ in range(w.rows)]  # R rows: the request each decodes for
    owner_R = torch.tensor(owner, device=device)
    per_row = {} if adapters is None else {"adapter_names": [adapters[q] for q in owner]}
    per_request = {} if adapters is None else {"adapter_names": adapters}
    generators = [torch.Generator(device=device).manual_seed(w.seed + i) for w in batch for i in range(w.rows)]
    spans, start = [], 0
    for w in batch:
        spans.append((start, start + w.rows))
        start += w.rows
    rows = len(owner)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    finish: list[str | None] = [None] * rows
    stop_hit: list[str | None] = [None] * rows
    with torch.inference_mode():
        out = model(input_ids=ids_Q_T, attention_mask=mask_Q_T, position_ids=positions_Q_T, use_cache=True,
                    logits_to_keep=1, **per_request)
        cache = out.past_key_values
        cache.batch_select_indices(owner_R)  # prefilled once a request, then a cache row per completion
        mask_R_T = mask_Q_T[owner_R]
        next_position_R = mask_R_T.sum(-1)
        logits_R_V = out.logits[owner_R, -1, :].float()
        for step in range(max(w.req.max_tokens for w in batch)):
            next_ids_R = torch.zeros(rows, dtype=torch.long, device=device)
            for w, (a, b) in zip(batch, spans):
                ids, lps = sample_step(logits_R_V[a:b], w.req.temperature, w.req.top_p, generators[a:b])
                next_ids_R[a:b] = ids
                for i, row in enumerate(range(a, b)):
                    if finish[row] is not None or step >= w.req.max_tokens:
                        continue
                    tokens[row].append(int(ids[i]))
                    logprobs[row].append(float(lps[i]))
                    finish[row], stop_hit[row] = stopped(tokens[row], w.req.stop)
                    if finish[row] is None and step == w.req.max_tokens - 1:
                        finish[row] = "length"
            if all(f is not None for f in finish):
                break
            # Finished rows keep decoding (their tokens are dropped): the batch stays rectangular.
            mask_R_T = torch.cat([mask_R_T, torch.ones((rows, 1), dtype=mask_R_T.dtype, device=device)], dim=1)
            out = model(input_ids=next_ids_R.view(rows, 1), attention_mask=mask_R_T,
                        position_ids=next_position_R.view(rows, 1), past_key_values=cache, use_cache=True, **per_row)
            next_position_R = next_position_R + 1
            cache = out.past_key_values
            logits_R_V = out.logits[:, -1, :].float()
    results = []
    for w, (a, b) in zip(batch, spans):
        completions = [Completion(text=text_of(tokens[row], stop_hit[row]), token_ids=tokens[row],
                                  logprobs=logprobs[row], finish_reason=finish[row] or "length")
                       for row in range(a, b)]
        greedy = w.req.temperature == 0  # one row decoded: the n completions are all the same
        results.append([completions[0].model_copy(deep=True) for _ in range(w.req.n)] if greedy else completions)
    return results
