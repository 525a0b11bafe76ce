"""A lever for the fleet, measured before it is built: two experiments' batches in one forward and backward.

    .venv/bin/python -m scripts.benchmarks.mixed_adapter_step [--rounds 5 --sequences 16]

Issue 28 names "mixed-adapter learner steps": micro-batches of several experiments in one forward and backward,
each row through its own adapter, as multi-LoRA serving does for sampling. Today the learner runs one
experiment's step at a time (learner/trainer.py). This measures what that would save on this box, on the
learner's own pieces (learner.batching's micro-batches, learner.policy_loss), without DeepSpeed (the optimizer steps
stay one per experiment either way):

- `one_by_one`: experiment A's micro-batch of `sequences` through adapter A, forward and backward; then B's;
- `mixed`: both batches as one micro-batch of 2 x `sequences`, each row through its own adapter (peft's
  `adapter_names`, which runs the base layers once for the whole batch and each adapter on its rows), the two
  experiments' losses summed, one backward.

In the learner's allocator (tcmalloc where the system has it: grpo_server/workers/allocator.py), both sides
in eval mode (no dropout: LoRA dropout 0, the default; peft refuses `adapter_names` in training mode) with
both adapters trainable, under the learner's autocast on this CPU (bf16 where the CPU computes it natively).
Rounds alternate the two sides; each side's gradients are checked against the other's (the lever must compute
the same step). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from grpo_server.config import EMBEDDED_MODEL_NAME, AlgorithmConfig
from grpo_server.workers.allocator import allocator_env

from .learner_vs_peft import PlainLoop, make_batch


def run(rounds: int, sequences: int, max_completion: int, micro_batch: int) -> dict:
    import torch
    from grpo_server.config import LoraConfig
    from grpo_server.workers.model_prep import resolve_model
    from learner.batching import Sequence, gather_completion_logp, make_micro_batches
    from learner.engine import uses_autocast
    from learner.policy_loss import BatchNormalizer, LossSettings, policy_loss, token_logprobs

    lora, algo = LoraConfig(), AlgorithmConfig()  # an experiment's defaults: r 16 on 7 modules, dropout 0
    autocast = uses_autocast("auto", torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    model = PlainLoop(resolve_model(EMBEDDED_MODEL_NAME), lora, algo).model  # the peft model, adapter "default"
    model.add_adapter("second", model.peft_config["default"])
    for name, param in model.named_parameters():  # LoRA B starts at 0: move it, so both adapters matter
        if "lora_" in name:
            param.requires_grad_(True)
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    settings = LossSettings(algo.loss, algo.clip_low, algo.clip_high, algo.beta)
    experiments = {}
    for name, seed in (("default", 1), ("second", 2)):
        request = make_batch(sequences, 8, max_completion, seed=seed)
        seqs = [Sequence(s.prompt_token_ids, s.completion_token_ids, s.sampler_logprobs, s.advantage, s.temperature)
                for s in request.samples]
        experiments[name] = (seqs, BatchNormalizer(len(seqs), sum(len(s.completion) for s in seqs), max_completion))
    both = experiments["default"][0] + experiments["second"][0]
    mixed_batches = []  # (micro-batch, each row's adapter, each experiment's rows)
    for batch in make_micro_batches(both, micro_batch):
        row_adapter = ["default" if i < sequences else "second" for i in batch.indices]
        rows = {name: torch.tensor([r for r, a in enumerate(row_adapter) if a == name]) for name in experiments}
        mixed_batches.append((batch, row_adapter, {k: v for k, v in rows.items() if len(v)}))
    tokens = sum(len(s.prompt) + len(s.completion) for s in both)

    def loss_of(logits, batch, norm, pick=None):
        logp_B_C = gather_completion_logp(token_logprobs(logits, batch.targets_B_K, batch.temperature), batch)
        old, adv, mask = batch.old_logp_B_C, batch.advantages_B, batch.mask_B_C
        if pick is not None:
            logp_B_C, old, adv, mask = logp_B_C[pick], old[pick], adv[pick], mask[pick]
        return policy_loss(logp_B_C, old, adv, mask, settings, norm)[0]

    def one_by_one() -> None:
        for name, (seqs, norm) in experiments.items():
            model.set_adapter(name)
            for p in params:  # set_adapter marks only the active adapter trainable
                p.requires_grad_(True)
            for batch in make_micro_batches(seqs, micro_batch):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    logits = model(input_ids=batch.input_ids_B_L, attention_mask=batch.attention_mask_B_L,
                                   logits_to_keep=batch.logits_to_keep, use_cache=False).logits
                loss_of(logits, batch, norm).backward()

    def mixed() -> None:
        for batch, row_adapter, rows in mixed_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=batch.input_ids_B_L, attention_mask=batch.attention_mask_B_L,
                               logits_to_keep=batch.logits_to_keep, use_cache=False, adapter_names=row_adapter).logits
            sum(loss_of(logits, batch, experiments[name][1], picked) for name, picked in rows.items()).backward()

    def timed(side) -> tuple[float, list]:
        for p in params:
            p.grad = None
        started = time.perf_counter()
        side()
        return time.perf_counter() - started, [p.grad.clone() for p in params]

    timed(one_by_one), timed(mixed)  # warm-up
    seconds: dict[str, list[float]] = {"one_by_one": [], "mixed": []}
    gap = 0.0
    for i in range(rounds):
        order = (("one_by_one", one_by_one), ("mixed", mixed))
        grads = {}
        for name, side in order if i % 2 == 0 else order[::-1]:
            spent, grads[name] = timed(side)
            seconds[name].append(round(spent, 3))
        gap = max(gap, max(float((x - y).abs().max()) for x, y in zip(grads["one_by_one"], grads["mixed"])))
    scale = max(float(g.abs().max()) for g in grads["one_by_one"])
    ratios = [round(s / m, 3) for s, m in zip(seconds["one_by_one"], seconds["mixed"])]
    return {"figure": "mixed_adapter_step", "autocast_bf16": autocast, "threads": torch.get_num_threads(),
            "sequences_per_experiment": sequences, "tokens_both": tokens, "micro_batch": micro_batch,
            "mixed_micro_batches": len(mixed_batches),
            "seconds": seconds, "median_s": {k: statistics.median(v) for k, v in seconds.items()},
            "one_by_one_over_mixed": ratios, "median_ratio": statistics.median(ratios),
            "grad_gap_max": gap, "grad_scale_max": scale, "load_end": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=16, help="per experiment: 2 groups of 8, as alphabetize")
    parser.add_argument("--max-completion", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=AlgorithmConfig().micro_batch_size,
                        help="sequences a forward, both sides (the learner's default; mixed rows span experiments)")
    args = parser.parse_args()
    added = allocator_env(os.environ)  # the learner's allocator (tcmalloc where the system has it), as it runs
    if added:
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], {**os.environ, **added})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(run(args.rounds, args.sequences, args.max_completion, args.micro_batch)), flush=True)


if __name__ == "__main__":
    main()
