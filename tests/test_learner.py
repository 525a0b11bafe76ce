"""The learner with its real parts: peft multi-adapter, DeepSpeed ZeRO-2 on CPU, the tiny Llama.

Most tests drive one in-process MultiAdapterTrainer (module-scoped: the model loads once); the last one
starts `python -m learner` and talks msgpack over HTTP.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from grpo_server.protocol.worker_config import AlgorithmConfig, LearnerConfig, LoraConfig
from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.wire import LogprobsRequest, TrainRequest, TrainSample

REPO = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA = LoraConfig(r=8, alpha=16, target_modules=TARGETS)
PROMPT = [1, 504, 2156, 30, 3357, 28, 253]
COMPLETION = [3946, 314, 253, 1789, 2]
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # One process, one rank, as learner/__main__.py sets it up.
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0", "DS_ACCELERATOR": "cpu"}.items():
        os.environ.setdefault(key, value)
    from learner.trainer import MultiAdapterTrainer

    run_dir = tmp_path_factory.mktemp("learner-run")
    return MultiAdapterTrainer(LearnerConfig(model_path=tiny_model_dir, run_dir=run_dir, port=1, max_model_len=64))


def _fresh_base(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _logprobs_unpadded(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Reference scoring: one sequence, no padding, no logits_to_keep."""
    from learner.loss import token_logprobs

    ids_1_L = torch.tensor([prompt + completion])
    logits_1_L_V = model(input_ids=ids_1_L).logits
    P, C = len(prompt), len(completion)
    return token_logprobs(logits_1_L_V[:, P - 1 : P + C - 1], ids_1_L[:, P:], temperature)[0]


def _sample(prompt, completion, logprobs, advantage, reward=0.0, temperature=1.0) -> TrainSample:
    return TrainSample(prompt_token_ids=prompt, completion_token_ids=completion, sampler_logprobs=logprobs,
                       advantage=advantage, reward=reward, policy_version=0, temperature=temperature)


def _adapter_weights(trainer, name: str) -> dict[str, torch.Tensor]:
    adapter = trainer.experiments[name].adapter
    return {n.replace(f".{adapter}.", "."): p.detach().clone()
            for n, p in trainer.model.named_parameters() if f".{adapter}." in n}


def _lp(trainer, name, prompt=PROMPT, completions=(COMPLETION,), temperature=1.0) -> list[list[float]]:
    return trainer.logprobs(LogprobsRequest(name=name, prompt_token_ids=prompt,
                                            completions_token_ids=list(completions), temperature=temperature))


def test_v0_adapter_is_the_base_model_in_plain_peft_format(trainer, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file

    version = trainer.add_experiment("zero", LORA, AlgorithmConfig())
    assert version.version == 0 and Path(version.path).name == "v000000"
    folder = Path(version.path)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    # Exactly lora_A / lora_B of the target modules, named as peft and vLLM expect: no adapter name, no embeddings.
    pattern = re.compile(r"base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.(q_proj|v_proj|down_proj)"
                         r"\.lora_[AB]\.weight")
    assert all(pattern.fullmatch(k) for k in tensors), [k for k in tensors if not pattern.fullmatch(k)]
    assert len(tensors) == 2 * len(TARGETS) * 2  # 2 layers x 3 modules x (A, B)
    assert all(torch.count_nonzero(v) == 0 for k, v in tensors.items() if ".lora_B." in k)
    assert all(torch.count_nonzero(v) > 0 for k, v in tensors.items() if ".lora_A." in k)

    base = _fresh_base(tiny_model_dir)
    with torch.no_grad():
        base_lp = _logprobs_unpadded(base, PROMPT, COMPLETION, 0.7)
        peft_lp = _logprobs_unpadded(PeftModel.from_pretrained(base, str(folder)).eval(), PROMPT, COMPLETION, 0.7)
    trainer_lp = torch.tensor(_lp(trainer, "zero", temperature=0.7)[0])
    assert torch.allclose(peft_lp, base_lp, atol=1e-6)
    assert torch.allclose(trainer_lp, base_lp, atol=1e-5), (trainer_lp, base_lp)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_advantage_sign_moves_the_completion_logprob(trainer, advantage):
    name = "up" if advantage > 0 else "down"
    trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=5e-3))
    before = sum(_lp(trainer, name)[0])
    for _ in range(4):  # on-policy: the sampler logprobs are the current policy's
        metrics = trainer.train(TrainRequest(name=name, samples=[
            _sample(PROMPT, COMPLETION, _lp(trainer, name)[0], advantage, reward=advantage)]))
        assert metrics.tokens == len(COMPLETION) and metrics.grad_norm > 0
    after = sum(_lp(trainer, name)[0])
    assert metrics.step == 4 and abs(metrics.ratio_mean - 1.0) < 1e-4 and metrics.reward_mean == advantage
    assert (after - before) * advantage > 0.5, (before, after)


def test_a_step_compares_the_sampler_logprobs_of_the_version_it_starts_from(trainer):
    """The free check (grpo_server/runtime/verification.py): samples of the version the weights are at have their
    sampler logprobs compared with the learner's own; other versions' samples, and any sample once a step
    has moved the weights past the last saved version, are not."""
    def step(policy_version: int, offset: float):
        own = _lp(trainer, "gap")[0]
        return trainer.train(TrainRequest(name="gap", samples=[
            TrainSample(prompt_token_ids=PROMPT, completion_token_ids=COMPLETION,
                        sampler_logprobs=[min(x + offset, 0.0) for x in own], advantage=1.0, reward=1.0,
                        policy_version=policy_version),
            TrainSample(prompt_token_ids=PROMPT[:3], completion_token_ids=COMPLETION[:2], sampler_logprobs=[-3.0, -4.0],
                        advantage=-1.0, reward=0.0, policy_version=policy_version - 1)]))

    trainer.add_experiment("gap", LORA, AlgorithmConfig(learning_rate=1e-2))
    first = step(policy_version=0, offset=0.0)  # fresh: the weights are v0's
    assert first.checked_version == 0 and first.sampler_gap_tokens == len(COMPLETION)
    assert first.sampler_gap_mean < 1e-5 and first.sampler_gap_max < 1e-5
    moved = step(policy_version=0, offset=0.0)  # the weights moved past v0 and nothing was saved
    assert moved.checked_version is None and moved.sampler_gap_tokens == 0
    assert trainer.save_adapter("gap").version == 1
    wrong = step(policy_version=1, offset=-0.25)  # a sampler serving other weights than v1's
    assert wrong.checked_version == 1 and wrong.sampler_gap_tokens == len(COMPLETION)
    assert abs(wrong.sampler_gap_mean - 0.25) < 1e-4 and abs(wrong.sampler_gap_max - 0.25) < 1e-4


def test_stepping_one_experiment_leaves_the_other_exactly_unchanged(trainer):
    trainer.add_experiment("iso-a", LORA, AlgorithmConfig(learning_rate=1e-2))
    trainer.add_experiment("iso-b", LORA, AlgorithmConfig(learning_rate=1e-2))
    a0, b0 = _adapter_weights(trainer, "iso-a"), _adapter_weights(trainer, "iso-b")
    b_lp = _lp(trainer, "iso-b")
    for advantage in (1.0, -0.5):
        trainer.train(TrainRequest(name="iso-a", samples=[
            _sample(PROMPT, COMPLETION, _lp(trainer, "iso-a")[0], advantage),
            _sample(PROMPT[:3], COMPLETION[:2], [-3.0, -4.0], -advantage)]))
    a1, b1 = _adapter_weights(trainer, "iso-a"), _adapter_weights(trainer, "iso-b")
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)
    assert all(torch.equal(b0[k], b1[k]) for k in b0)
    assert _lp(trainer, "iso-b") == b_lp


def _mixed_batch(trainer, name: str) -> TrainRequest:
    """Five samples of different prompt and completion lengths, off-policy (ratios spread, some clipped),
    sampled at two temperatures (groups of one batch may differ)."""
    g = torch.Generator().manual_seed(7)
    samples = []
    for i, (p, c, adv) in enumerate([(3, 4, 1.2), (7, 1, -0.5), (2, 6, 0.3), (5, 3, -1.0), (9, 2, 0.7)]):
        prompt = torch.randint(3, 4000, (p,), generator=g).tolist()
        completion = torch.randint(3, 4000, (c,), generator=g).tolist()
        temperature = 0.8 if i % 2 == 0 else 1.0
        current = _lp(trainer, name, prompt, [completion], temperature=temperature)[0]
        noise = (0.3 * torch.randn(c, generator=g)).tolist()
        samples.append(_sample(prompt, completion, [min(x + n, 0.0) for x, n in zip(current, noise)], adv, float(i),
                               temperature))
    return TrainRequest(name=name, samples=samples, max_tokens=8)


def _assert_same_adam_update(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    """Weights after the same AdamW steps, up to float noise.

    Adam's first steps move each weight by about lr * g / (|g| + eps): where a gradient element is of
    the size of eps (1e-8), float noise in g shows as a visible difference, so a few elements in a
    thousand may differ; a lost or double-counted micro-batch changes the direction of a large share.
    The scale is checked by the grad norm, and what the odd elements do to the model by its logprobs.
    """
    diff = (a - b).abs()
    assert float((diff <= 1e-6).float().mean()) >= 0.99, (key, int((diff > 1e-6).sum()), diff.numel())


@pytest.mark.parametrize("loss,beta", [("grpo", 0.0), ("dapo", 0.05)])
def test_micro_batched_step_equals_whole_batch_step_and_plain_torch(trainer, tiny_model_dir, loss, beta):
    from peft import PeftModel

    from learner.loss import BatchNormalizer, LossSettings, policy_loss

    algo = dict(loss=loss, beta=beta, learning_rate=2e-3, weight_decay=0.01, max_grad_norm=0.5)
    whole, micro = f"whole-{loss}", f"micro-{loss}"
    v0 = Path(trainer.add_experiment(whole, LORA, AlgorithmConfig(micro_batch_size=64, **algo)).path)
    # The same starting weights for all three: `micro` resumes from a copy of `whole`'s v0.
    shutil.copytree(v0, v0.parent.parent / micro / "v000000")
    trainer.add_experiment(micro, LORA, AlgorithmConfig(micro_batch_size=2, **algo))
    reference = PeftModel.from_pretrained(_fresh_base(tiny_model_dir), str(v0), is_trainable=True).train()
    ref_params = {n.replace(".default.", "."): p for n, p in reference.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(ref_params.values(), lr=algo["learning_rate"], weight_decay=algo["weight_decay"])
    request = _mixed_batch(trainer, whole)
    settings = LossSettings(loss, 0.2, 0.28, beta)
    norm = BatchNormalizer(len(request.samples), sum(len(s.completion_token_ids) for s in request.samples), 8)
    initial = [_lp(trainer, whole, s.prompt_token_ids, [s.completion_token_ids], s.temperature)[0]
               for s in request.samples]
    moved: list[float] = []

    for step in (1, 2):  # the second step moves lora_A too (B != 0 after the first)
        m_whole, m_micro = trainer.train(request), trainer.train(request.model_copy(update={"name": micro}))
        # Plain torch: one unpadded sequence at a time, gradients summed, one clipped AdamW step.
        optimizer.zero_grad()
        total = 0.0
        for s in request.samples:
            logp_C = _logprobs_unpadded(reference, s.prompt_token_ids, s.completion_token_ids, s.temperature)
            ref_logp_C = None
            if beta > 0:
                with torch.no_grad(), reference.disable_adapter():
                    ref_logp_C = _logprobs_unpadded(reference, s.prompt_token_ids, s.completion_token_ids,
                                                    s.temperature)
            loss_value, _ = policy_loss(logp_C[None], torch.tensor([s.sampler_logprobs]), torch.tensor([s.advantage]),
                                        torch.ones(1, len(logp_C)), settings, norm,
                                        None if ref_logp_C is None else ref_logp_C[None])
            loss_value.backward()
            total += float(loss_value.detach())
        ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref_params.values()), algo["max_grad_norm"]))
        optimizer.step()

        assert m_whole.step == m_micro.step == step
        for m in (m_whole, m_micro):
            assert math.isclose(m.grad_norm, ref_norm, rel_tol=1e-4), (m.grad_norm, ref_norm)
            assert math.isclose(m.loss, total, rel_tol=1e-4, abs_tol=1e-6), (m.loss, total)
        assert m_whole.grad_norm > algo["max_grad_norm"] or step == 2  # clipping is exercised
        assert m_micro.tokens == m_whole.tokens == norm.num_tokens
        assert math.isclose(m_micro.ratio_mean, m_whole.ratio_mean, rel_tol=1e-4)
        assert (m_micro.kl > 0) == (beta > 0 and step == 2)  # at step 1 the policy is the base model
        w_whole, w_micro = _adapter_weights(trainer, whole), _adapter_weights(trainer, micro)
        assert w_whole.keys() == ref_params.keys()
        for key, ref in ref_params.items():
            _assert_same_adam_update(w_micro[key], w_whole[key], key)
            _assert_same_adam_update(w_micro[key], ref.detach(), key)
    assert any(torch.count_nonzero(v) for k, v in w_micro.items() if ".lora_B." in k)
    # The three models agree on the batch's logprobs, and two steps moved them well beyond that.
    reference.eval()
    for s, before in zip(request.samples, initial):
        with torch.no_grad():
            ref_lp = _logprobs_unpadded(reference, s.prompt_token_ids, s.completion_token_ids, s.temperature)
        for name in (whole, micro):
            got = torch.tensor(_lp(trainer, name, s.prompt_token_ids, [s.completion_token_ids], s.temperature)[0])
            assert torch.allclose(got, ref_lp, atol=1e-4), (name, got, ref_lp)
        moved.append(float((ref_lp - torch.tensor(before)).abs().max()))
    assert max(moved) > 1e-2, moved


def test_a_failed_step_leaves_no_stale_gradients(trainer, monkeypatch):
    """Out of memory in the middle of a batch: the next step must not add the lost step's gradients."""
    v0 = Path(trainer.add_experiment("fail-whole", LORA, AlgorithmConfig(micro_batch_size=64)).path)
    shutil.copytree(v0, v0.parent.parent / "fail-micro" / "v000000")
    trainer.add_experiment("fail-micro", LORA, AlgorithmConfig(micro_batch_size=1))
    request = _mixed_batch(trainer, "fail-whole").model_copy(update={"name": "fail-micro"})
    real_forward, calls = trainer._completion_logp, []

    def out_of_memory_at_the_third_micro_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected: out of memory")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(trainer, "_completion_logp", out_of_memory_at_the_third_micro_batch)
    with pytest.raises(MemoryError):
        trainer.train(request)
    monkeypatch.setattr(trainer, "_completion_logp", real_forward)
    assert trainer.status()["fail-micro"]["step"] == 0
    whole = trainer.train(request.model_copy(update={"name": "fail-whole"}))
    micro = trainer.train(request)
    assert micro.step == whole.step == 1
    assert math.isclose(micro.grad_norm, whole.grad_norm, rel_tol=1e-4), (micro.grad_norm, whole.grad_norm)


def test_save_adapter_bumps_version_and_loads_in_peft_with_the_same_logprobs(trainer, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file

    trainer.add_experiment("saved", LORA, AlgorithmConfig(learning_rate=1e-2))
    for _ in range(2):
        trainer.train(TrainRequest(name="saved", samples=[_sample(PROMPT, COMPLETION, _lp(trainer, "saved")[0], 1.0)]))
    version = trainer.save_adapter("saved")
    assert version.version == 1 and Path(version.path).name == "v000001"
    tensors = load_file(str(Path(version.path) / "adapter_model.safetensors"))
    assert set(tensors) == set(load_file(str(Path(version.path).parent / "v000000" / "adapter_model.safetensors")))
    assert any(torch.count_nonzero(v) for k, v in tensors.items() if ".lora_B." in k)
    completions = [COMPLETION, COMPLETION[:2], [42, 43, 44, 45, 46, 47, 48]]
    expected = _lp(trainer, "saved", completions=completions)
    model = PeftModel.from_pretrained(_fresh_base(tiny_model_dir), version.path).eval()
    with torch.no_grad():
        for completion, row in zip(completions, expected):
            got = _logprobs_unpadded(model, PROMPT, completion)
            assert len(row) == len(completion)
            assert torch.allclose(got, torch.tensor(row), atol=1e-4), (got, row)
    assert trainer.save_adapter("saved").version == 2
    assert trainer.status()["saved"] == {"step": 2, "version": 2, "path": str(Path(version.path).parent / "v000002")}


def test_readding_a_removed_experiment_resumes_its_latest_version(trainer):
    from grpo_server.protocol.errors import ApiError

    trainer.add_experiment("resume", LORA, AlgorithmConfig(learning_rate=1e-2))
    trainer.train(TrainRequest(name="resume", samples=[_sample(PROMPT, COMPLETION, _lp(trainer, "resume")[0], 1.0)]))
    saved = trainer.save_adapter("resume")
    trained_lp = _lp(trainer, "resume")
    trainer.remove_experiment("resume")
    assert "resume" not in trainer.status() and "exp_resume" not in trainer.model.peft_config
    assert (Path(saved.path) / "adapter_model.safetensors").is_file()  # the files stay
    with pytest.raises(ApiError) as err:
        _lp(trainer, "resume")
    assert err.value.status == 404
    with pytest.raises(ApiError) as err:  # another shape than the adapter on disk
        trainer.add_experiment("resume", LoraConfig(r=4, alpha=16, target_modules=TARGETS), AlgorithmConfig())
    assert (err.value.code, err.value.status) == ("adapter_mismatch", 409)

    again = trainer.add_experiment("resume", LORA, AlgorithmConfig(learning_rate=1e-2))
    assert again.version == 1 and again.path == saved.path
    assert trainer.status()["resume"]["step"] == 1
    assert _lp(trainer, "resume") == trained_lp
    metrics = trainer.train(TrainRequest(name="resume", samples=[_sample(PROMPT, COMPLETION, trained_lp[0], 1.0)]))
    assert metrics.step == 2 and trainer.save_adapter("resume").version == 2


def test_bad_requests_get_the_right_error_codes(trainer):
    from grpo_server.protocol.errors import ApiError

    def code_of(fn, *args):
        with pytest.raises(ApiError) as err:
            fn(*args)
        return err.value.code, err.value.status

    ok = [-1.0] * len(COMPLETION)
    assert code_of(trainer.train, TrainRequest(name="nope", samples=[_sample(PROMPT, COMPLETION, ok, 1.0)])) == (
        "not_found", 404)
    assert code_of(trainer.save_adapter, "nope") == ("not_found", 404)
    assert code_of(trainer.remove_experiment, "nope") == ("not_found", 404)
    trainer.add_experiment("bad", LORA, AlgorithmConfig())
    assert code_of(trainer.add_experiment, "bad", LORA, AlgorithmConfig()) == ("exists", 409)
    assert code_of(trainer.add_experiment, "../x", LORA, AlgorithmConfig()) == ("bad_request", 400)
    assert code_of(trainer.add_experiment, "bad-target", LoraConfig(target_modules=["q_proj", "nope_proj"]),
                   AlgorithmConfig()) == ("bad_request", 400)
    assert "exp_bad-target" not in trainer.model.peft_config
    vocab = trainer.vocab_size
    cases = {
        "out of vocab": _sample(PROMPT, [5, vocab], [-1.0, -1.0], 1.0),
        "negative id": _sample([-1] + PROMPT, COMPLETION, ok, 1.0),
        "too long": _sample(PROMPT * 10, COMPLETION, ok, 1.0),  # max_model_len is 64
        "logprob count": _sample(PROMPT, COMPLETION, ok[:-1], 1.0),
        "empty prompt": _sample([], COMPLETION, ok, 1.0),
        "nan advantage": _sample(PROMPT, COMPLETION, ok, float("nan")),
    }
    before = _adapter_weights(trainer, "bad")
    for label, sample in cases.items():
        assert code_of(trainer.train, TrainRequest(name="bad", samples=[sample])) == ("bad_request", 400), label
    assert code_of(trainer.logprobs, LogprobsRequest(name="bad", prompt_token_ids=PROMPT,
                                                     completions_token_ids=[[vocab + 3]])) == ("bad_request", 400)
    assert code_of(trainer.train, TrainRequest(name="bad", samples=[
        _sample(PROMPT, COMPLETION, ok, 1.0, temperature=0.0)])) == ("bad_request", 400)
    after = _adapter_weights(trainer, "bad")
    assert all(torch.equal(before[k], after[k]) for k in before)  # rejected before any step
    assert trainer.train(TrainRequest(name="bad", samples=[_sample(PROMPT, COMPLETION, ok, 1.0)])).step == 1


def _post(url: str, verb: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/{verb}", data=body if isinstance(body, bytes) else pack(body),
                                     headers={"Content-Type": MSGPACK}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, unpack(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, unpack(exc.read())


def test_learner_process_serves_the_verbs_over_http(tiny_model_dir, tmp_path):
    port = _free_port()
    run_dir = tmp_path / "run"
    config_path = tmp_path / "learner.yaml"
    config_path.write_text(yaml.safe_dump({"model_path": str(tiny_model_dir), "run_dir": str(run_dir),
                                           "port": port, "max_model_len": 128}))
    # The parent's rank / port variables (the in-process fixture's) must not leak into the child.
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    log_file = open(tmp_path / "learner.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "learner", "--config", str(config_path)], cwd=REPO, env=env,
                            stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200 and unpack(response.read()) == {"status": "ok"}:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "learner not healthy in 240 s"
            time.sleep(0.5)
        assert yaml.safe_load((run_dir / "config" / "learner.resolved.yaml").read_text())["port"] == port

        lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
        status, body = _post(url, "add_experiment", {"name": "web", "lora": lora, "algorithm": {"learning_rate": 1e-2}})
        assert status == 200 and body["version"] == 0 and Path(body["path"]).is_dir(), body
        status, body = _post(url, "logprobs", {"name": "web", "prompt_token_ids": PROMPT,
                                               "completions_token_ids": [COMPLETION]})
        assert status == 200 and len(body["logprobs"][0]) == len(COMPLETION), body
        before = body["logprobs"][0]
        train = {"name": "web", "samples": [_sample(PROMPT, COMPLETION, before, 1.0, 1.0).model_dump()]}
        for step in (1, 2):
            status, body = _post(url, "train", train)
            assert status == 200 and body["step"] == step and body["tokens"] == len(COMPLETION), body
        # A probe to score under the saved weights (the front end's check of the version) comes back with it.
        probe = {"prompt_token_ids": PROMPT, "completions_token_ids": [COMPLETION, COMPLETION[:2]]}
        status, body = _post(url, "save_adapter", {"name": "web", "probe": probe})
        assert status == 200 and body["version"] == 1 and body["path"].endswith("v000001"), body
        saved_probe = body["probe_logprobs"]
        status, body = _post(url, "logprobs", {"name": "web", **probe})
        assert sum(body["logprobs"][0]) > sum(before)
        assert saved_probe == body["logprobs"]
        with urllib.request.urlopen(f"{url}/status", timeout=10) as response:
            assert unpack(response.read())["experiments"]["web"] == {
                "step": 2, "version": 1, "path": str((run_dir / "adapters" / "web" / "v000001").resolve())}

        assert _post(url, "train", {**train, "name": "ghost"}) == (
            404, {"error": {"code": "not_found", "message": "experiment 'ghost' is not loaded in the learner"}})
        status, body = _post(url, "add_experiment", {"name": "web", "lora": lora, "algorithm": {}})
        assert status == 409 and body["error"]["code"] == "exists"
        status, body = _post(url, "train", {"name": "web", "samples": [], "extra": 1})
        assert status == 400 and body["error"]["code"] == "bad_request" and "samples" in body["error"]["message"]
        status, body = _post(url, "train", b"\xc1 not msgpack")
        assert status == 400 and body["error"]["code"] == "bad_request"
        status, body = _post(url, "remove_experiment", {"name": "web"})
        assert status == 200 and body == {"removed": "web"}
        assert _post(url, "save_adapter", {"name": "web"})[0] == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
            log_file.close()
    assert code == 0, (tmp_path / "learner.log").read_text()[-3000:]


def _optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state (ZeRO's flat fp32 partition and AdamW's moments), copied."""
    state = engine.optimizer.state_dict()
    out = {f"fp32.{i}": t.clone() for i, t in enumerate(state["single_partition_of_fp32_groups"])}
    for index, slots in state["base_optimizer_state"]["state"].items():
        out.update({f"{index}.{k}": torch.as_tensor(v).clone() for k, v in slots.items()})
    return out


def test_checkpoint_resumes_weights_optimizer_and_step_exactly(trainer):
    name = "ckpt"
    trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=5e-3, checkpoint_every=2))

    def request(seq: int) -> TrainRequest:
        return TrainRequest(name=name, journal_seq=seq, num_groups=1,
                            samples=[_sample(PROMPT, COMPLETION, _lp(trainer, name)[0], 1.0)])

    assert trainer.train(request(1)).checkpointed_journal_seq is None
    assert trainer.train(request(2)).checkpointed_journal_seq == 2  # checkpoint_every=2
    at_checkpoint = _optimizer_tensors(trainer.experiments[name].engine)
    trainer.save_adapter(name)  # v1, step 2
    third = request(3)
    assert trainer.train(third).step == 3
    after_third = _adapter_weights(trainer, name)
    assert trainer.save_adapter(name).version == 2  # step 3: pushed, not checkpointed

    trainer.remove_experiment(name)  # as a crashed learner: only the disk is left
    resumed = trainer.add_experiment(name, LORA, AlgorithmConfig(learning_rate=5e-3, checkpoint_every=2))
    # Back at step 2 with its optimizer; v2 (step 3) is not these weights, so they get a new number.
    assert (resumed.step, resumed.journal_seq, resumed.groups_trained, resumed.version) == (2, 2, 2, 3)
    restored = _optimizer_tensors(trainer.experiments[name].engine)
    assert restored.keys() == at_checkpoint.keys() and len(restored) > 2
    assert all(torch.equal(restored[k], at_checkpoint[k]) for k in restored), "optimizer state differs"
    # Retraining the lost step gives exactly the weights it gave before the "crash".
    assert trainer.train(third).step == 3
    again = _adapter_weights(trainer, name)
    assert all(torch.equal(again[k], after_third[k]) for k in again)
    trainer.remove_experiment(name)
