"""TRL's side of the end-to-end race: wall time for TRL's GRPOTrainer on alphabetize to reach a mean reward.

The TRL side of scripts/bench's end_to_end figure: TRL's GRPOTrainer on the alphabetize task until the
running mean reward reaches a target (or a time limit passes). Needs the `bench` extra
(the `bench` extra, in `dev`; `GRPO_EXTRAS=bench scripts/setup`: trl, datasets).

    .venv/bin/python -m scripts.benchmarks.trl_side --target 0.35 --window 16 --time-limit-s 1500

SmolLM2-135M-Instruct from the embedded copy (grpo_server.workers.model_prep.resolve_model), float32 on CPU
(on a CUDA machine: the GPU, bf16 autocast over float32 weights, for scripts/gpu-check);
prompts and reward are examples/alphabetize.py's own `make_prompt` and `score` (imported), prompts drawn
from `random.Random(seed)` in order as the server side's client does. Matched to configs/alphabetize.yaml
(and AlgorithmConfig's defaults for what it leaves out):

  * LoRA: `peft_config=LoraConfig(r, lora_alpha, lora_dropout, target_modules, bias="none")` as the
    learner builds it;
  * sampling: num_generations = sampling.n, temperature, top_p, top_k off, max_completion_length =
    sampling.max_tokens; generation by transformers' `generate` (TRL's vLLM modes need CUDA);
  * one optimizer step per `batch_groups` groups (per_device_train_batch_size x gradient accumulation =
    batch_groups x n, micro-batches of algorithm.micro_batch_size), each batch sampled by the current
    policy (num_iterations 1);
  * torch AdamW at a constant `learning_rate` (no warm-up, no decay: the server has no scheduler),
    weight_decay, max_grad_norm;
  * loss: `loss` grpo -> TRL loss_type "grpo" with scale_rewards "group" (sequence mean, then batch
    mean; advantages divided by the group std); dr_grpo -> "dr_grpo", scale_rewards "none"; dapo -> "dapo";
    gspo -> "grpo" with importance_sampling_level "sequence". beta, epsilon = clip_low, epsilon_high =
    clip_high; gradient checkpointing off (the server's learner default).

Not matched, because TRL has no such knob: skip_zero_variance (TRL keeps groups with equal rewards in the
batch; their advantages are 0, so they add no gradient but count in the loss's batch mean), max_staleness
(TRL is on-policy: no stale groups), push_every (no separate sampler to push to).

The clock and the race are end_to_end.py's (race.py's `Race`): from just before `GRPOTrainer(...)`
(the base model already loaded: excluded, as the server's start is on the other side) to the group that
brought the mean of the last `window` groups to the target; each group's mean reward is taken in the
reward function, when TRL scores it. Prints one JSON line on stdout (TRL's own logging goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from .end_to_end import ALPHABETIZE_CONFIG
from .host import loadavg
from .race import Race

LOSS_TYPES = {"grpo": ("grpo", "group", "token"), "dr_grpo": ("dr_grpo", "none", "token"),
              "dapo": ("dapo", "group", "token"), "gspo": ("grpo", "group", "sequence")}


def experiment_config(path: Path) -> dict:
    """The experiment YAML with the server's defaults filled in (grpo_server.config)."""
    from grpo_server.config import ExperimentConfig

    return ExperimentConfig.model_validate(yaml.safe_load(path.read_text())).model_dump(mode="json")


def trl_settings(exp: dict, seed: int, output_dir: str, cuda: bool = False, bf16: bool = False) -> dict:
    """GRPOConfig keyword arguments matched to the experiment config. `cuda`: train on the GPU in bf16 (float32
    master weights), TRL's fastest there; on CPU float32 unless `bf16` (the same autocast on the CPU)."""
    alg, smp = exp["algorithm"], exp["sampling"]
    batch = alg["batch_groups"] * smp["n"]
    micro = min(alg["micro_batch_size"], batch)
    if batch % micro:
        micro = smp["n"]  # a micro-batch size TRL can divide the batch by
    loss_type, scale_rewards, level = LOSS_TYPES[alg["loss"]]
    return dict(
        output_dir=output_dir, use_cpu=not cuda, bf16=cuda or bf16, fp16=False, seed=seed, data_seed=seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro, num_iterations=1,
        num_generations=smp["n"], max_completion_length=smp["max_tokens"], temperature=smp["temperature"],
        top_p=smp["top_p"], top_k=0, learning_rate=alg["learning_rate"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=alg["weight_decay"], max_grad_norm=alg["max_grad_norm"],
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, beta=alg["beta"],
        epsilon=alg["clip_low"], epsilon_high=alg["clip_high"], loss_type=loss_type, scale_rewards=scale_rewards,
        importance_sampling_level=level, gradient_checkpointing=False, shuffle_dataset=False,
        max_steps=1_000_000, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ALPHABETIZE_CONFIG, help="experiment YAML")
    parser.add_argument("--target", type=float, default=0.35, help="running mean reward to reach")
    parser.add_argument("--window", type=int, default=16, help="groups in the running mean")
    parser.add_argument("--time-limit-s", type=float, default=1500.0, help="on the clock")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=8192, help="prompts in the dataset (more than needed)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU too (always on CUDA)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from examples.alphabetize import make_prompt, score
    from grpo_server.config import EMBEDDED_MODEL_NAME
    from grpo_server.workers.model_prep import resolve_model

    exp = experiment_config(args.config)
    n = exp["sampling"]["n"]
    rng = random.Random(args.seed)
    rows = []
    for _ in range(args.prompts):
        messages, words = make_prompt(rng)
        rows.append({"prompt": messages, "words": words})
    dataset = Dataset.from_list(rows)

    t0 = time.perf_counter()
    model_dir = resolve_model(EMBEDDED_MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model_load_s = round(time.perf_counter() - t0, 2)
    lora = exp["lora"]
    alpha = int(lora["alpha"]) if float(lora["alpha"]).is_integer() else lora["alpha"]
    peft_config = LoraConfig(r=lora["r"], lora_alpha=alpha, lora_dropout=lora["dropout"],
                             target_modules=list(lora["target_modules"]), bias="none", task_type="CAUSAL_LM")

    race = Race(args.target, args.window, args.time_limit_s)
    last_print = [0.0]

    def alphabetize_reward(prompts, completions, words, trainer_state=None, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [score(text, state) for text, state in zip(texts, words)]
        step = trainer_state.global_step if trainer_state is not None else -1
        for g in range(0, len(rewards), n):  # TRL lays out each prompt's n completions next to each other
            assert all(w == words[g] for w in words[g:g + n]), "a group mixes prompts"
            race.add(statistics.fmean(rewards[g:g + n]), step)
        if time.monotonic() - last_print[0] > 30 or race.done:
            last_print[0] = time.monotonic()
            recent = [r[2] for r in race.rows[-args.window:]]
            print(f"[trl] {race.elapsed():.0f} s, {len(race.rows)} groups, step {step}, mean of last {len(recent)}: "
                  f"{statistics.fmean(recent):.3f} (load {loadavg()})", file=sys.stderr, flush=True)
        return rewards

    class StopAtTarget(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            if race.done:
                control.should_training_stop = True
            return control

    load_start = loadavg()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as output_dir:
        settings = trl_settings(exp, args.seed, output_dir, cuda=torch.cuda.is_available(), bf16=args.bf16)
        race.start()  # the clock: from making the adapter (GRPOTrainer wraps the model with peft) on
        trainer = GRPOTrainer(model=model, reward_funcs=alphabetize_reward, args=GRPOConfig(**settings),
                              train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                              callbacks=[StopAtTarget()])
        trainer_init_s = round(race.elapsed(), 2)
        trainer.train()
    summary = race.summary()
    steps = trainer.state.global_step
    out = {
        "side": "trl", **summary, "load_start": load_start, "load_end": loadavg(), "model_load_s": model_load_s,
        "trainer_init_s": trainer_init_s, "optimizer_steps": steps,
        "seconds_per_step": round(summary["wall_s"] / steps, 2) if steps else None,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "grpo_config": {k: v for k, v in settings.items() if k != "output_dir"},
        "lora": {"r": lora["r"], "alpha": alpha, "dropout": lora["dropout"], "target_modules": lora["target_modules"]},
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
