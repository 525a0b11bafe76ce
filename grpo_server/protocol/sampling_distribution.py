"""What a sampled token's logprob means, for both workers: the distribution the sampler draws from and the
learner scores under.

vLLM reports "processed" logprobs (sampler/vllm_engine.py): log softmax(logits / T), renormalised over the
top-p nucleus. Its nucleus (apply_top_k_top_p): sort the tempered logits ascending, drop every token whose
cumulative probability is <= 1 - top_p, and always keep the most likely one. The transformers sampler
(sampler/hf_engine.py) samples from that distribution, and the learner (learner/policy_loss.py) scores its tokens
under it, so that the importance ratio of a token sampled by the weights the learner holds is 1, whatever
T and top_p are.

torch is imported inside the function: the protocol package imports no ML package at import time.
"""

from __future__ import annotations

from typing import Any


def outside_nucleus(scaled_logits_N_V: Any, top_p: float) -> Any:
    """True where vLLM's top-p drops the token, for each row of (already tempered) logits [N, V]."""
    import torch

    sorted_N_V, index_N_V = scaled_logits_N_V.sort(dim=-1, descending=False)
    cumulative_N_V = sorted_N_V.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted_N_V = cumulative_N_V <= 1 - top_p
    drop_sorted_N_V[:, -1] = False  # keep at least the most likely token
    return torch.empty_like(drop_sorted_N_V).scatter_(-1, index_N_V, drop_sorted_N_V)
