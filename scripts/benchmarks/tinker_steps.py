"""Time per GRPO step on alphabetize: through the Tinker route set vs the native route (issue 26's >= 0.8x).

The same work each step, one step at a time on one server (the embedded SmolLM2, or --tiny):
  * native: 2 groups of 8 completions (examples/alphabetize.py's prompts and reward, configs/alphabetize.yaml's
    LoRA, loss, learning rate and sampling), their feedback, then wait until the learner stepped and the new
    version serves (push_every 1);
  * Tinker, through the official SDK: 2 prompts x 8 samples from the newest sampler weights, the same rewards
    and group advantages, one forward_backward with the server's `grpo` loss, one optim_step, one
    save_weights_and_get_sampling_client (a checked version push).
Ratio = native seconds per step / Tinker seconds per step (>= 0.8: Tinker is at most 1.25x slower). The sides
alternate step by step (which goes first alternates too); steps after the first `--warmup` count.

    .venv/bin/python -m scripts.benchmarks.tinker_steps [--tiny] [--steps 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from examples.alphabetize import make_prompt, score
from grpo_server.client import AsyncClient

GROUPS, N, MAX_TOKENS, TEMPERATURE, LR, RANK = 2, 8, 40, 0.8, 5e-4, 16
TARGET = 0.8


def _config(name: str) -> dict:
    return {"name": name, "lora": {"r": RANK},
            "algorithm": {"loss": "grpo", "learning_rate": LR, "clip_low": 0.2, "clip_high": 0.28, "batch_groups":
                          GROUPS, "push_every": 1, "max_staleness": 2, "skip_zero_variance": False},
            "sampling": {"n": N, "temperature": TEMPERATURE, "max_tokens": MAX_TOKENS}}


class NativeSide:
    """One GRPO step through the native route: the groups, their feedback, then wait for the step's version."""

    name = "bench-native"

    def __init__(self, client: AsyncClient, seed: int):
        self.client, self.rng = client, random.Random(seed)

    async def start(self) -> None:
        await self.client.create_experiment(_config(self.name))

    async def step(self) -> float:
        client, name = self.client, self.name
        started = time.perf_counter()
        before = (await client.status(name)).step

        async def group() -> None:
            messages, words = make_prompt(self.rng)
            sampled = await client.complete(name, messages=messages)
            await client.feedback(name, sampled.group_id, [score(c.text, words) for c in sampled.completions])
        await asyncio.gather(*(group() for _ in range(GROUPS)))
        while True:
            status = await client.status(name)
            if status.step > before and status.policy_version >= status.step:
                return time.perf_counter() - started
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.client.delete_experiment(self.name)


class TinkerSide:
    """The same step through the official SDK (blocking calls: run on a thread)."""

    def __init__(self, url: str, key: str, base_model: str, tokenizer, seed: int):
        import tinker
        from tinker import types

        self.types, self.tokenizer, self.rng = types, tokenizer, random.Random(seed)
        self.service = service = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
        self.training = service.create_lora_training_client(base_model=base_model, rank=RANK).result()
        self.sampler = self.training.save_weights_and_get_sampling_client().result()

    def step(self) -> float:
        types, tokenizer = self.types, self.tokenizer
        started = time.perf_counter()
        params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE)
        prompts = [make_prompt(self.rng) for _ in range(GROUPS)]
        ids = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
               for m, _ in prompts]
        futures = [self.sampler.sample(types.ModelInput.from_ints(p), N, params) for p in ids]
        data = []
        for prompt, (_, words), future in zip(ids, prompts, futures):
            sequences = future.result().sequences
            rewards = [score(tokenizer.decode(s.tokens, skip_special_tokens=True), words) for s in sequences]
            mean, spread = statistics.fmean(rewards), statistics.pstdev(rewards)
            for seq, reward in zip(sequences, rewards):
                advantage = (reward - mean) / (spread + 1e-4)
                full = prompt + seq.tokens
                start = len(prompt) - 1  # position i predicts full[i + 1]: the completion's targets start here
                n = len(full) - 1
                data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                    "target_tokens": full[1:], "logprobs": [0.0] * start + list(seq.logprobs),
                    "advantages": [advantage] * n, "weights": [0.0] * start + [1.0] * len(seq.tokens)}))
        self.training.forward_backward(data, "grpo", loss_fn_config={"clip_low": 0.2, "clip_high": 0.28}).result()
        self.training.optim_step(types.AdamParams(learning_rate=LR)).result()
        self.sampler = self.training.save_weights_and_get_sampling_client().result()
        return time.perf_counter() - started

    def stop(self) -> None:
        self.service.close("success").result(timeout=60)  # ends the session, and with it the SDK's heartbeats


async def figure(model_dir: Path, steps: int, warmup: int, seed: int = 0) -> dict:
    """Rounds alternate which side goes first (native, Tinker / Tinker, native / ...), so that a change in the
    box's load falls on both sides alike."""
    from transformers import AutoTokenizer

    from .server import start, stop

    run_dir = Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    handle = await start(run_dir, model_dir, engine="vllm", max_model_len=1024, learner={"zero_stage": 2},
                         tinker_base_model=str(model_dir))
    native, tinker = [], []
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as client:
            await client.health()
            native_side = NativeSide(client, seed)
            await native_side.start()
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            tinker_side = await asyncio.to_thread(TinkerSide, handle.url, handle.api_key, str(model_dir), tokenizer,
                                                  seed)
            for round_ in range(steps):
                if round_ % 2 == 0:
                    native.append(await native_side.step())
                    tinker.append(await asyncio.to_thread(tinker_side.step))
                else:
                    tinker.append(await asyncio.to_thread(tinker_side.step))
                    native.append(await native_side.step())
            await native_side.stop()
            await asyncio.to_thread(tinker_side.stop)
    finally:
        await stop(handle)
    native_s, tinker_s = statistics.median(native[warmup:]), statistics.median(tinker[warmup:])
    ratio = native_s / tinker_s
    per_round = [round(n / t, 3) for n, t in zip(native[warmup:], tinker[warmup:])]
    return {"groups": GROUPS, "n": N, "max_tokens": MAX_TOKENS, "steps": steps, "warmup": warmup,
            "native_step_s": [round(t, 3) for t in native], "tinker_step_s": [round(t, 3) for t in tinker],
            "native_median_s": round(native_s, 3), "tinker_median_s": round(tinker_s, 3), "ratio": round(ratio, 3),
            "round_ratios": per_round, "target": TARGET, "met": ratio >= TARGET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tests/tiny_model.py's model (else the embedded SmolLM2)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from .server import bench_model, stop_on_signals

    stop_on_signals()
    model_dir = bench_model(args.tiny, "bench-tinker-tiny-llama")
    result = asyncio.run(figure(model_dir, args.steps, args.warmup))
    text = json.dumps({"model": str(model_dir), "command": "python -m scripts.benchmarks.tinker_steps "
                       + ("--tiny " if args.tiny else "") + f"--steps {args.steps}", **result}, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
