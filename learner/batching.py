"""Samples -> right-padded micro-batches with the indices that pick out completion logprobs.

A sequence is prompt + completion. Only completion tokens are scored: completion token j of sequence b
sits at position P_b + j and is predicted by the logits at position P_b + j - 1. Sequences are sorted
by length before they are cut into micro-batches, so each micro-batch pads to a similar length.

A multi-turn episode is one sequence: its completion holds every turn, with the tokens the model did not
sample in between (tool results, user turns, chat-template tokens). Its loss mask (one per completion
token, 1 = sampled by the model) keeps those out of `mask_B_C`, so they are context only: no loss, no
token count, no ratio, KL or sampler-gap statistics; their sampler logprobs are placeholders.

The LM head only runs over the last K positions of a micro-batch (`logits_to_keep=K`), from the
earliest position that predicts a completion token; with vocabularies of ~50k, the logits of the
prompt would otherwise dominate the memory of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_server.protocol.errors import BadRequest


@dataclass(frozen=True)
class Sequence:
    prompt: list[int]
    completion: list[int]
    old_logp: list[float]  # behaviour (sampler) logprobs, one per completion token
    advantage: float = 0.0
    temperature: float = 1.0  # the one old_logp was sampled at; the learner's logprobs must use it too
    # Sampled by the version whose weights the learner holds now: its old_logp must equal the learner's
    # logprobs before this step (the check of the samplers that costs nothing: learner/trainer.py).
    checked: bool = False
    # One per completion token: 1 = sampled by the model (trained, old_logp real), 0 = context only (old_logp a
    # placeholder). None: every completion token is the model's.
    loss_mask: list[int] | None = None
    top_p: float = 1.0  # the nucleus old_logp is renormalised over; the learner's logprobs must use it too
    # Sampled by the version whose weights the learner holds now (checked or not): its sampler/learner KL is
    # numeric mismatch alone; a stale sequence's also holds the policy's change since (TrainMetrics).
    fresh: bool = False

    @property
    def decoding(self) -> tuple[float, float]:
        """(temperature, top_p): the sampling distribution its logprobs are under, one per micro-batch."""
        return self.temperature, self.top_p

    def trained(self) -> list[bool]:
        """Per completion token: is it trained (and its old_logp real)?"""
        if self.loss_mask is None:
            return [True] * len(self.completion)
        return [m == 1 for m in self.loss_mask]


@dataclass
class MicroBatch:
    indices: list[int]  # where these sequences sit in the request
    input_ids_B_L: Tensor  # right-padded prompt + completion
    attention_mask_B_L: Tensor  # 1 on real tokens, 0 on padding
    logits_to_keep: int  # K: the model returns logits of the last K positions only
    targets_B_K: Tensor  # the token each kept logit position predicts (0 past the end)
    gather_B_C: Tensor  # index into K of the logit that predicts completion token j (0 on padding)
    mask_B_C: Tensor  # True on trained completion tokens (False on padding and on loss_mask 0)
    old_logp_B_C: Tensor
    advantages_B: Tensor
    temperature: float  # shared by every sequence of the micro-batch, as top_p is
    top_p: float
    checked_B: Tensor  # Sequence.checked
    fresh_B: Tensor  # Sequence.fresh

    @property
    def num_tokens(self) -> int:
        return int(self.mask_B_C.sum())

    def to(self, device: torch.device | str) -> "MicroBatch":
        moved = {key: (value.to(device) if isinstance(value, Tensor) else value) for key, value in vars(self).items()}
        return MicroBatch(**moved)


def check_sequence(seq: Sequence, vocab_size: int, max_model_len: int, where: str) -> None:
    """Reject what would crash the model or silently train on garbage, with a message naming it."""
    if not seq.prompt:
        # The first completion token needs a position before it that predicts it.
        raise BadRequest(f"{where}: prompt_token_ids is empty (at least one prompt token is needed)")
    if not seq.completion:
        raise BadRequest(f"{where}: the completion is empty")
    total = len(seq.prompt) + len(seq.completion)
    if total > max_model_len:
        raise BadRequest(f"{where}: prompt + completion is {total} tokens, over max_model_len {max_model_len}")
    for label, ids in (("prompt", seq.prompt), ("completion", seq.completion)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"{where}: {label} token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(seq.old_logp) != len(seq.completion):
        raise BadRequest(
            f"{where}: {len(seq.old_logp)} sampler_logprobs for {len(seq.completion)} completion tokens"
        )
    if seq.loss_mask is not None:
        if len(seq.loss_mask) != len(seq.completion):
            raise BadRequest(f"{where}: {len(seq.loss_mask)} loss_mask entries for {len(seq.completion)} "
                             f"completion tokens")
        bad = [m for m in seq.loss_mask if m not in (0, 1)]
        if bad:
            raise BadRequest(f"{where}: loss_mask entries must be 0 or 1, got {bad[0]!r}")
        if 1 not in seq.loss_mask:
            raise BadRequest(f"{where}: loss_mask has no 1 (no completion token was sampled by the model)")
    # Placeholders (loss_mask 0) are never read: only the model's own tokens' logprobs must be real.
    if not all(math.isfinite(x) and x <= 0.0 for x, real in zip(seq.old_logp, seq.trained()) if real):
        raise BadRequest(f"{where}: sampler_logprobs must be finite and <= 0"
                         + (" where loss_mask is 1" if seq.loss_mask is not None else ""))
    if not math.isfinite(seq.advantage):
        raise BadRequest(f"{where}: advantage is not finite")


def _collate(seqs: list[Sequence], indices: list[int], pad_id: int) -> MicroBatch:
    prompt_lens = [len(s.prompt) for s in seqs]
    completion_lens = [len(s.completion) for s in seqs]
    B = len(seqs)
    L = max(p + c for p, c in zip(prompt_lens, completion_lens))
    C = max(completion_lens)
    first = min(prompt_lens) - 1  # earliest position whose logits predict a completion token
    K = L - first

    input_ids_B_L = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask_B_L = torch.zeros((B, L), dtype=torch.long)
    gather_B_C = torch.zeros((B, C), dtype=torch.long)
    mask_B_C = torch.zeros((B, C), dtype=torch.bool)
    old_logp_B_C = torch.zeros((B, C), dtype=torch.float32)
    for b, seq in enumerate(seqs):
        P, n = prompt_lens[b], completion_lens[b]
        input_ids_B_L[b, : P + n] = torch.tensor(seq.prompt + seq.completion, dtype=torch.long)
        attention_mask_B_L[b, : P + n] = 1
        gather_B_C[b, :n] = torch.arange(n) + (P - 1 - first)
        trained_C = torch.tensor(seq.trained(), dtype=torch.bool)
        mask_B_C[b, :n] = trained_C
        # Placeholders become 0, as on padding: whatever was sent there never reaches a tensor op.
        old_logp_B_C[b, :n] = torch.where(trained_C, torch.tensor(seq.old_logp, dtype=torch.float32), 0.0)

    # Kept position k is full position first + k and predicts the token at first + k + 1; the last
    # position predicts nothing (target 0, never gathered).
    targets_B_K = torch.zeros((B, K), dtype=torch.long)
    targets_B_K[:, : K - 1] = input_ids_B_L[:, first + 1 :]
    advantages_B = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    checked_B = torch.tensor([s.checked for s in seqs], dtype=torch.bool)
    fresh_B = torch.tensor([s.fresh for s in seqs], dtype=torch.bool)
    return MicroBatch(indices, input_ids_B_L, attention_mask_B_L, K, targets_B_K, gather_B_C, mask_B_C,
                      old_logp_B_C, advantages_B, seqs[0].temperature, seqs[0].top_p, checked_B, fresh_B)


def make_micro_batches(seqs: list[Sequence], micro_batch_size: int, pad_id: int = 0) -> list[MicroBatch]:
    """Cut sequences into micro-batches of at most `micro_batch_size`, one sampling distribution
    (temperature and top_p) each, longest first."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    batches = []
    for decoding in sorted({s.decoding for s in seqs}):
        same = [i for i, s in enumerate(seqs) if s.decoding == decoding]
        order = sorted(same, key=lambda i: len(seqs[i].prompt) + len(seqs[i].completion), reverse=True)
        for start in range(0, len(order), micro_batch_size):
            chunk = order[start : start + micro_batch_size]
            batches.append(_collate([seqs[i] for i in chunk], chunk, pad_id))
    return batches


def sampler_gap(logp_B_C: Tensor, batch: MicroBatch) -> dict[str, Tensor]:
    """|learner - sampler| logprob over the checked sequences' tokens: sum, token count and max."""
    valid_B_C = batch.mask_B_C & batch.checked_B[:, None]
    gap_B_C = torch.where(valid_B_C, (logp_B_C.detach() - batch.old_logp_B_C).abs(), torch.zeros_like(logp_B_C))
    return {"gap_sum": gap_B_C.sum(), "gap_tokens": valid_B_C.sum(), "gap_max": gap_B_C.max() if gap_B_C.numel()
            else torch.tensor(0.0)}


def gather_completion_logp(logp_B_K: Tensor, batch: MicroBatch) -> Tensor:
    """Per-completion-token logprobs [B, C] from per-kept-position logprobs [B, K]; 0 on padding and on
    untrained (loss_mask 0) tokens."""
    logp_B_C = logp_B_K.gather(1, batch.gather_B_C)
    return torch.where(batch.mask_B_C, logp_B_C, torch.zeros_like(logp_B_C))
