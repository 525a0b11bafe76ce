"""Shared by the learner's tests (tests/test_learner.py, tests/test_learner_adapters.py, tests/test_learner_http.py):
the LoRA shape, one prompt and completion of the tiny Llama, and the small helpers to build samples and score
them. The `trainer` fixture they share is in tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_server.protocol.worker_config import LoraConfig
from grpo_server.protocol.wire import LogprobsRequest, TrainSample

TARGETS = ["q_proj", "v_proj", "down_proj"]
LORA = LoraConfig(r=8, alpha=16, target_modules=TARGETS)
PROMPT = [1, 504, 2156, 30, 3357, 28, 253]
COMPLETION = [3946, 314, 253, 1789, 2]


def _fresh_base(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def _logprobs_unpadded(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Reference scoring: one sequence, no padding, no logits_to_keep."""
    from learner.policy_loss import token_logprobs

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
