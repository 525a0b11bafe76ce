"""The transformers engine decodes the generate requests that wait together in one batch, each row under its own
adapter (sampler/hf_batches.py): each request gets what it gets alone, a request whose adapter is gone gets its
404 while the others run, and the batches really are shared. In process, on the tiny model, with the session's
peft adapters (tests/conftest.py `adapters`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.wire import AdapterRef, GenerateRequest
from tests.sampler_helpers import PROMPT
from tests.tolerances import HF_BATCHED_VS_ALONE, within

RAND, RAND2 = AdapterRef(name="rand", version=0), AdapterRef(name="rand2", version=0)


# --- the line of waiting requests, without a model ----------------------------------------------------------


def _req(n: int, **kw) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=[1, 2, 3], n=n, max_tokens=2, **kw)


async def test_waiting_requests_share_batches_up_to_max_rows_and_close_answers_everyone():
    from sampler.hf_batches import GenerateBatches

    seen: list[list[int]] = []
    release = asyncio.Event()

    async def run_batch(batch):
        seen.append([w.req.n for w in batch])
        if len(seen) == 3:
            await release.wait()  # the third batch hangs until close()
        return [[w.req.n] for w in batch]

    batches = GenerateBatches(run_batch, max_rows=8)
    calls = [asyncio.ensure_future(batches.generate(_req(n), seed=0)) for n in (3, 4, 2, 9, 1)]
    calls.append(asyncio.ensure_future(batches.generate(_req(5, temperature=0), seed=0)))  # greedy: one row
    done, pending = await asyncio.wait(calls, timeout=5)
    # 3 + 4 rows fit 8, 2 more do not; 2 + 9 do not either, and 9 runs alone (and hangs); 1 and the greedy wait.
    assert seen == [[3, 4], [2], [9]]
    assert [c.result() for c in calls[:3]] == [[3], [4], [2]] and len(pending) == 3
    await batches.close()
    for call in calls[3:]:
        with pytest.raises(RuntimeError, match="shutting down"):  # not left waiting (a TimeoutError)
            await asyncio.wait_for(call, 5)


@pytest.fixture(scope="module")
def engine_loop(tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """An HfEngine with two adapters loaded, and the event loop it lives on."""
    from grpo_server.protocol.worker_config import SamplerConfig
    from sampler.hf_engine import HfEngine

    loop = asyncio.new_event_loop()
    config = SamplerConfig(model_path=tiny_model_dir, run_dir=tmp_path_factory.mktemp("hf-batches"), port=1,
                           engine="transformers", max_model_len=256, max_num_seqs=64)
    engine = HfEngine(config)
    loop.run_until_complete(engine.start())
    loop.run_until_complete(engine.load_adapter(RAND, str(adapters["random"])))
    loop.run_until_complete(engine.load_adapter(RAND2, str(adapters["random2"])))
    yield engine, loop
    loop.run_until_complete(engine.shutdown())
    loop.close()


REQUESTS = [  # different adapters, prompt lengths, n, max_tokens, temperatures, top-p and stop strings
    GenerateRequest(prompt_token_ids=PROMPT, n=3, max_tokens=8, seed=1),
    GenerateRequest(prompt_token_ids=PROMPT[:9], n=2, max_tokens=12, seed=2, adapter=RAND),
    GenerateRequest(prompt_token_ids=PROMPT[5:30], n=4, max_tokens=5, seed=3, adapter=RAND2, temperature=0.7,
                    top_p=0.8),
    GenerateRequest(prompt_token_ids=PROMPT[:17], n=2, max_tokens=6, temperature=0, adapter=RAND),  # greedy
    GenerateRequest(prompt_token_ids=PROMPT, n=2, max_tokens=10, seed=4, adapter=RAND, stop=["e"]),
]


def _alone(engine, loop, req):
    return loop.run_until_complete(engine.generate(req)).completions


def test_each_request_in_a_batch_gets_what_it_gets_alone(engine_loop):
    engine, loop = engine_loop
    alone = [_alone(engine, loop, req) for req in REQUESTS]
    batches, requests = engine.batches.batches, engine.batches.requests

    async def together():
        return await asyncio.gather(*(engine.generate(req) for req in REQUESTS))

    batched = [r.completions for r in loop.run_until_complete(together())]
    assert (engine.batches.batches - batches, engine.batches.requests - requests) == (1, len(REQUESTS))
    for req, one, many in zip(REQUESTS, alone, batched):
        assert len(many) == req.n
        assert [c.token_ids for c in many] == [c.token_ids for c in one]
        assert [c.finish_reason for c in many] == [c.finish_reason for c in one]
        assert [c.text for c in many] == [c.text for c in one]
        assert within(HF_BATCHED_VS_ALONE, [c.logprobs for c in many], [c.logprobs for c in one])
    assert all(c.token_ids == batched[3][0].token_ids for c in batched[3])  # greedy: n equal completions
    assert batched[4][0].finish_reason == "stop" or "e" not in batched[4][0].text


def test_rows_use_their_own_adapter(engine_loop):
    """The same seeded request under the base model, rand and rand2, in one batch: each gets the answer it gets
    alone, and those three differ (a row under a neighbour's adapter would get the neighbour's)."""
    engine, loop = engine_loop
    reqs = [GenerateRequest(prompt_token_ids=PROMPT, n=2, max_tokens=6, seed=9, adapter=a) for a in (None, RAND, RAND2)]
    alone = [_alone(engine, loop, req) for req in reqs]

    async def together():
        return await asyncio.gather(*(engine.generate(req) for req in reqs))

    batched = [r.completions for r in loop.run_until_complete(together())]
    for one, many in zip(alone, batched):
        assert [c.token_ids for c in many] == [c.token_ids for c in one]
        assert within(HF_BATCHED_VS_ALONE, [c.logprobs for c in many], [c.logprobs for c in one])
    answers = [([c.token_ids for c in one], [c.logprobs for c in one]) for one in alone]
    assert answers[0] != answers[1] and answers[1] != answers[2] and answers[0] != answers[2]

def test_a_request_whose_adapter_is_gone_fails_alone(engine_loop):
    engine, loop = engine_loop
    ghost = GenerateRequest(prompt_token_ids=PROMPT, n=2, max_tokens=4, seed=1, adapter=AdapterRef(name="ghost",
                                                                                                     version=3))
    fine = GenerateRequest(prompt_token_ids=PROMPT, n=2, max_tokens=4, seed=1, adapter=RAND)

    async def together():
        return await asyncio.gather(engine.generate(ghost), engine.generate(fine), return_exceptions=True)

    missing, served = loop.run_until_complete(together())
    assert isinstance(missing, ApiError) and missing.status == 404, missing
    assert [c.token_ids for c in served.completions] == [c.token_ids for c in _alone(engine, loop, fine)]
