"""Learner: training tok/s of the real learner's train step vs a plain peft + AdamW loop, on the same batches.

    .venv/bin/python -m scripts.benchmarks.learner_vs_peft [--sequences 16 --steps 2 --max-completion 48]
    .venv/bin/python -m scripts.benchmarks.learner_vs_peft --autocast    # the bf16 learner (LearnerOptions.autocast)

The learner side is `learner.trainer.MultiAdapterTrainer.train` (DeepSpeed ZeRO-2 engine over the peft
model, its micro-batches, its GRPO loss), in this process. The plain side is a second copy of the same
base model wrapped by `peft.get_peft_model` with the same LoRA (r, alpha, the 7 linear layers), a torch
AdamW over the adapter and the same loop: the learner's own micro-batches (`learner.batching`), the same
forward (`logits_to_keep`), the same loss (`learner.policy_loss.policy_loss`), gradient clipping, one step.
After one warm-up step each, blocks of `BLOCK` steps alternate (learner, plain, learner without checkpoints,
each round starting with the next side), so all see the same load (`--autocast`: single steps alternate).

Both sides run the learner's defaults on this CPU: float32 weights, and train steps under bf16 autocast where
the CPU computes bf16 natively (learner.autocast auto), the plain loop under the same autocast.

The learner checkpoints by default after an experiment's first step (here the warm-up), then after the first step
that ends `checkpoint_interval_s` (30 s) or more after the last checkpoint started (`checkpoint_every` 1): the
step copies the checkpoint's state and a thread writes it beside what follows (learner/checkpoint_writer.py).
The default path is timed as a block of steps back to back, the last write waited for at the block's end, so the
writes' cost, in the step or beside the next, is in its time; the 30 s run on the wall clock, through the other
sides' blocks too, so the default blocks checkpoint more often than steps back to back would. The checkpoints
written and the checkpoint's part of a step (its copy, and any wait for the write before it) are reported apart.
A block of the same steps with checkpoints off is the variant row.

With `--autocast`, the learner's steps alternate between float32 and bf16 autocast (the same trainer, its
`autocast` switched between steps), and the plain loop runs under the same autocast: learner bf16 vs float32,
learner vs plain in bf16, and the logprob gap bf16 autocast makes (mean |bf16 - float32| over the batch's
completion tokens, what the free check would see against a float32 sampler).

Tokens are real tokens (prompt + completion) of the batch; padding waste is the padded positions of the
learner's micro-batches over the real tokens. Prints one JSON object (scripts/bench runs this in a fresh
process, `learner_figure`: DeepSpeed's distributed setup and two model copies stay out of the caller).
(Not named `learner.py`: that would read as the `learner` worker package.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpo_server.config import EMBEDDED_MODEL_NAME

from . import REPO

BLOCK = 2  # steps back to back per side and round: a checkpoint's write runs beside the step after it


def make_batch(sequences: int, group_size: int, max_completion: int, seed: int = 0):
    """A GRPO batch of mixed lengths: groups share a prompt (16-48 tokens); completions 4..max_completion
    tokens, advantages +-1, behaviour logprobs around -2."""
    from grpo_server.protocol.wire import TrainRequest, TrainSample

    rng = random.Random(seed)
    samples = []
    for g in range((sequences + group_size - 1) // group_size):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(16, 48))]
        for j in range(min(group_size, sequences - g * group_size)):
            length = rng.randint(4, max_completion)
            samples.append(TrainSample(
                prompt_token_ids=prompt, completion_token_ids=[rng.randrange(100, 40000) for _ in range(length)],
                sampler_logprobs=[-2.0 - rng.random() for _ in range(length)], advantage=1.0 if j % 2 else -1.0,
                reward=float(j % 2), policy_version=0))
    return TrainRequest(name="learn", samples=samples, max_tokens=max_completion,
                        num_groups=(sequences + group_size - 1) // group_size)


def padding_waste(request, micro_batch_size: int) -> dict:
    """Padded positions of the learner's micro-batches over real tokens (prompt + completion)."""
    from learner.batching import Sequence, make_micro_batches

    seqs = [Sequence(s.prompt_token_ids, s.completion_token_ids, s.sampler_logprobs, s.advantage, s.temperature)
            for s in request.samples]
    batches = make_micro_batches(seqs, micro_batch_size)
    real = sum(len(s.prompt) + len(s.completion) for s in seqs)
    padded = sum(b.input_ids_B_L.numel() for b in batches) - real
    completion = sum(len(s.completion) for s in seqs)
    kept = sum(b.input_ids_B_L.shape[0] * b.logits_to_keep for b in batches)  # LM-head positions computed
    return {"micro_batches": len(batches), "real_tokens": real, "padded_tokens": padded,
            "padded_over_real": round(padded / real, 4), "completion_tokens": completion,
            "lm_head_positions_over_completion_tokens": round(kept / completion, 3)}


class PlainLoop:
    """peft + torch AdamW, no DeepSpeed, the learner's batches and loss."""

    def __init__(self, model_dir: Path, lora, algorithm, autocast: bool = False):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        base.config.use_cache = False
        alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
        self.model = get_peft_model(base, LoraConfig(r=lora.r, lora_alpha=alpha, lora_dropout=lora.dropout,
                                                     target_modules=list(lora.target_modules), bias="none",
                                                     task_type="CAUSAL_LM"))
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=algorithm.learning_rate,
                                           weight_decay=algorithm.weight_decay)
        self.algorithm = algorithm
        self.autocast = autocast

    def train(self, request) -> None:
        import torch

        from learner.batching import Sequence, gather_completion_logp, make_micro_batches
        from learner.policy_loss import BatchNormalizer, LossSettings, policy_loss, token_logprobs

        algo = self.algorithm
        seqs = [Sequence(s.prompt_token_ids, s.completion_token_ids, s.sampler_logprobs, s.advantage,
                         s.temperature) for s in request.samples]
        settings = LossSettings(algo.loss, algo.clip_low, algo.clip_high, algo.beta)
        norm = BatchNormalizer(num_sequences=len(seqs), num_tokens=sum(len(s.completion) for s in seqs),
                               max_tokens=request.max_tokens)
        for batch in make_micro_batches(seqs, algo.micro_batch_size):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                logits = self.model(input_ids=batch.input_ids_B_L, attention_mask=batch.attention_mask_B_L,
                                    logits_to_keep=batch.logits_to_keep, use_cache=False).logits
            logp_B_C = gather_completion_logp(token_logprobs(logits, batch.targets_B_K, batch.temperature), batch)
            loss, _ = policy_loss(logp_B_C, batch.old_logp_B_C, batch.advantages_B, batch.mask_B_C, settings, norm)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, algo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def run(model_dir: Path, sequences: int = 16, group_size: int = 8, max_completion: int = 48, steps: int = 2,
        seed: int = 0, autocast: bool = False) -> dict:
    """Warm-up one step each, then `steps` rounds of alternating blocks; tokens/s of each side and the ratios."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    import logging

    from deepspeed.utils import logger as ds_logger

    from grpo_server.config import AlgorithmConfig, LoraConfig

    ds_logger.setLevel(logging.WARNING)
    started = time.perf_counter()
    lora = LoraConfig()  # r=16, alpha 32, the 7 linear layers: an experiment's default
    algorithm = AlgorithmConfig()  # checkpoints as by default: the first step, then once 30 s have passed
    run_dir = Path(tempfile.mkdtemp(prefix="bench-learner-"))  # versions and checkpoints; removed at the end
    try:
        if autocast:
            no_checkpoints = algorithm.model_copy(update={"checkpoint_every": 1_000_000})  # steps alone here
            return _run_autocast(model_dir, run_dir, lora, no_checkpoints, sequences, group_size, max_completion,
                                 steps, seed)
        return _run(model_dir, run_dir, lora, algorithm, started, sequences, group_size, max_completion, steps, seed)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _run(model_dir: Path, run_dir: Path, lora, algorithm, started: float, sequences: int, group_size: int,
         max_completion: int, steps: int, seed: int) -> dict:
    import torch

    from grpo_server.protocol.worker_config import LearnerConfig
    from learner.trainer import MultiAdapterTrainer

    # The learner's defaults (dtype and autocast auto): float32 weights, train steps under bf16 autocast on a CPU
    # that computes bf16 natively. The plain loop runs the same autocast, so the ratio is the learner's overhead.
    trainer = MultiAdapterTrainer(LearnerConfig(model_path=model_dir, run_dir=run_dir, port=1, max_model_len=1024))
    trainer.add_experiment("learn", lora, algorithm)
    plain = PlainLoop(model_dir, lora, algorithm, autocast=trainer.autocast)
    setup_s = time.perf_counter() - started
    request = make_batch(sequences, group_size, max_completion, seed)
    tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in request.samples)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    exp = trainer.experiments["learn"]
    checkpointing, no_checkpoints = exp.algorithm, exp.algorithm.model_copy(update={"checkpoint_every": 1_000_000})
    in_step_s: list[float] = []  # the checkpoint's part of each default step: its copy, any wait for the write before

    def learner_block(checkpoints: bool) -> None:
        exp.algorithm = checkpointing if checkpoints else no_checkpoints
        for _ in range(BLOCK):
            trainer.train(request)
            if checkpoints and exp.checkpointed_step == exp.step:  # this step started one
                in_step_s.append(trainer._checkpoints.last_submit_s)
        trainer.wait_for_checkpoints()  # the block's last write, in its time

    def plain_block() -> None:
        for _ in range(BLOCK):
            plain.train(request)

    trainer.train(request)  # warm-up
    trainer.wait_for_checkpoints()
    plain.train(request)
    learner_s, no_ckpt_s, plain_s, save_s = [], [], [], []
    blocks = [(learner_s, lambda: learner_block(True)), (plain_s, plain_block),
              (no_ckpt_s, lambda: learner_block(False))]
    for round_index in range(steps):  # rounds of blocks, alternating sides: per-step seconds of each block
        # Each round starts with another side: the block after the round's save_adapter (its files written and
        # fsynced) ran slower, and in a fixed order that was always the default learner's.
        for times, block in blocks[round_index % 3:] + blocks[:round_index % 3]:
            times.append(timed(block) / BLOCK)
        save_s.append(timed(lambda: trainer.save_adapter("learn")))
    with_ckpt_tps = tokens * steps / sum(learner_s)
    learner_tps = tokens * steps / sum(no_ckpt_s)
    plain_tps = tokens * steps / sum(plain_s)
    return {
        "sequences": len(request.samples), "group_size": group_size, "max_completion": max_completion,
        "tokens_per_step": tokens, "steps": steps, "block": BLOCK, "micro_batch_size": algorithm.micro_batch_size,
        "lora": lora.model_dump(), "torch_threads": torch.get_num_threads(), "setup_s": round(setup_s, 1),
        "autocast": trainer.autocast, "dtype": str(trainer.dtype).removeprefix("torch."),
        "learner_step_s": [round(x, 3) for x in learner_s],
        "learner_no_checkpoint_step_s": [round(x, 3) for x in no_ckpt_s],
        "plain_step_s": [round(x, 3) for x in plain_s], "checkpoint_in_step_s": [round(x, 3) for x in in_step_s],
        "save_adapter_in_process_s": [round(x, 3) for x in save_s],
        "learner_tok_s": round(learner_tps, 1), "learner_with_checkpoint_tok_s": round(with_ckpt_tps, 1),
        "plain_tok_s": round(plain_tps, 1), "ratio": round(learner_tps / plain_tps, 3),
        "ratio_with_checkpoint": round(with_ckpt_tps / plain_tps, 3),
        "checkpoint_in_step_median_s": round(statistics.median(in_step_s), 3) if in_step_s else None,
        "checkpoints_written": len(in_step_s), "checkpoint_interval_s": algorithm.checkpoint_interval_s,
        # Each side's fastest block: on a shared box other jobs only ever add time, so this is the steadier ratio.
        "ratio_fastest_steps": round(min(plain_s) / min(learner_s), 3),
        "padding": padding_waste(request, algorithm.micro_batch_size),
    }


def _run_autocast(model_dir: Path, run_dir: Path, lora, algorithm, sequences: int, group_size: int,
                  max_completion: int, steps: int, seed: int) -> dict:
    import torch

    from grpo_server.protocol.worker_config import LearnerConfig
    from learner.batching import Sequence, make_micro_batches
    from learner.trainer import MultiAdapterTrainer

    trainer = MultiAdapterTrainer(LearnerConfig(model_path=model_dir, run_dir=run_dir, port=1, max_model_len=1024,
                                                dtype="float32", autocast="bfloat16"))
    trainer.add_experiment("learn", lora, algorithm)
    plain = PlainLoop(model_dir, lora, algorithm, autocast=True)
    request = make_batch(sequences, group_size, max_completion, seed)
    tokens = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in request.samples)

    def learner_step(bf16: bool) -> float:
        trainer.autocast = bf16
        t0 = time.perf_counter()
        trainer.train(request)
        return time.perf_counter() - t0

    def plain_step() -> float:
        t0 = time.perf_counter()
        plain.train(request)
        return time.perf_counter() - t0

    learner_step(True), learner_step(False), plain_step()  # warm-up
    fp32_s, bf16_s, plain_s = [], [], []
    for _ in range(steps):
        fp32_s.append(learner_step(False))
        bf16_s.append(learner_step(True))
        plain_s.append(plain_step())
    # The gap: the same batch scored both ways by the trainer's training forward, without grad.
    seqs = [Sequence(s.prompt_token_ids, s.completion_token_ids, s.sampler_logprobs) for s in request.samples]
    gaps = []
    trainer.model.eval()
    with torch.no_grad():
        for batch in make_micro_batches(seqs, algorithm.micro_batch_size):
            exact = trainer._completion_logp(trainer.model, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bf16 = trainer._completion_logp(trainer.model, batch)
            gaps.append((bf16 - exact).abs()[batch.mask_B_C])
    gap = torch.cat(gaps)
    return {
        "sequences": len(request.samples), "tokens_per_step": tokens, "steps": steps, "cpu_bf16": trainer.autocast,
        "learner_fp32_step_s": [round(x, 3) for x in fp32_s], "learner_bf16_step_s": [round(x, 3) for x in bf16_s],
        "plain_bf16_step_s": [round(x, 3) for x in plain_s],
        "learner_fp32_tok_s": round(tokens * steps / sum(fp32_s), 1),
        "learner_bf16_tok_s": round(tokens * steps / sum(bf16_s), 1),
        "plain_bf16_tok_s": round(tokens * steps / sum(plain_s), 1),
        "bf16_over_fp32": round(sum(fp32_s) / sum(bf16_s), 3),
        "learner_over_plain_bf16": round(sum(plain_s) / sum(bf16_s), 3),
        "logprob_gap_mean": round(float(gap.mean()), 5), "logprob_gap_max": round(float(gap.max()), 4),
    }


async def learner_figure(mode) -> dict:
    """The figure in scripts/bench: `run` in a fresh process, with the mode's counts."""
    cmd = [sys.executable, "-m", __spec__.name, "--sequences", str(mode.learner_sequences),
           "--max-completion", str(mode.learner_max_completion), "--steps", str(mode.learner_steps)]
    proc = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{__spec__.name} exited {proc.returncode}: {proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_NAME)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-completion", type=int, default=48)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--autocast", action="store_true", help="the bf16 learner against the float32 one")
    args = parser.parse_args()
    from grpo_server.workers.model_prep import resolve_model

    result = run(resolve_model(args.model), args.sequences, args.group_size, args.max_completion, args.steps,
                 autocast=args.autocast)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
