"""The learner's memory and time per token for the sampled tokens' logprobs (issue 28's lever): the learner's
`token_logprobs` (learner/policy_loss.py: top_p 1 takes `_SelectedLogprob`, which keeps no [B, T, V] tensor besides
the logits) against the same logprobs through `log_softmax(logits / T).gather(...)` under autograd, as the
learner computed them before.

A third row adds activation (gradient) checkpointing to the second, the lever for the rest of a step's memory:
at this size the layers' activations, not the logits, are most of it.

Each variant runs in a fresh process (peak RSS, VmHWM, is per process): the embedded SmolLM2 in float32 with
alphabetize's LoRA (r 16 on the attention and MLP projections), a micro-batch of 16 sequences of 48 prompt +
48 completion tokens (the logits of the 49 positions that predict completion tokens, as the learner's
`logits_to_keep`), T 0.8; forward, logprobs, a weighted sum, backward; a first step, then `--steps` timed.
Reported: the first step's peak RSS above the RSS after loading (`step_peak_mib`: what a fresh learner's step
adds), the timed steps' peak above the RSS they started from (`later_peak_mib`: the allocator keeps what the
first step freed, so later steps add only what does not fit in it), and completion tokens per second.

    .venv/bin/python -m scripts.benchmarks.logprob_memory [--steps 3] [--batch 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("log_softmax", "token_logprobs", "token_logprobs+checkpointing")
PROMPT, COMPLETION, TEMPERATURE = 48, 48, 0.8


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: writing 5 to clear_refs), so the step's own peak shows."""
    Path("/proc/self/clear_refs").write_text("5")


def run_variant(variant: str, batch: int, steps: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_server.config import EMBEDDED_MODEL_NAME
    from grpo_server.workers.model_prep import resolve_model
    from learner.policy_loss import token_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(EMBEDDED_MODEL_NAME), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if variant.endswith("+checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()  # the frozen embeddings' output must carry a gradient into the LoRA layers
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (batch, PROMPT + COMPLETION))
    keep = COMPLETION + 1
    targets = torch.randint(0, vocab, (batch, keep))
    advantages = torch.randn(batch, 1)

    def step() -> None:
        logits = model(input_ids=input_ids, logits_to_keep=keep, use_cache=False).logits
        if variant == "log_softmax":
            logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        else:
            logp = token_logprobs(logits, targets, TEMPERATURE)
        (logp * advantages).mean().backward()
        model.zero_grad(set_to_none=True)

    rss_loaded = _rss_mib("VmRSS")
    _reset_peak()
    step()
    first_peak = _rss_mib("VmHWM")
    rss_before = _rss_mib("VmRSS")
    _reset_peak()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peak = _rss_mib("VmHWM")
    seconds = statistics.median(times)
    return {"variant": variant, "batch": batch, "logits_mib": round(batch * keep * vocab * 4 / 2**20, 1),
            "rss_after_load_mib": round(rss_loaded, 1), "step_peak_mib": round(first_peak - rss_loaded, 1),
            "later_peak_mib": round(peak - rss_before, 1),
            "step_s": round(seconds, 3), "completion_tok_s": round(batch * COMPLETION / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one child process's variant
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.batch, args.steps)))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rows = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, "-m", "scripts.benchmarks.logprob_memory", "--variant", variant,
                              "--batch", str(args.batch), "--steps", str(args.steps)],
                             capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    old = rows[0]
    result = {"command": f"python -m scripts.benchmarks.logprob_memory --steps {args.steps} --batch {args.batch}",
              "loadavg": os.getloadavg(), "rows": rows,
              "vs_log_softmax": {row["variant"]: {
                  "step_peak_ratio": round(row["step_peak_mib"] / old["step_peak_mib"], 3),
                  "speed_ratio": round(row["completion_tok_s"] / old["completion_tok_s"], 3)} for row in rows[1:]}}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
