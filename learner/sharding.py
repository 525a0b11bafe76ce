"""Data parallelism: which sequences of a batch each rank trains on, and how many passes every rank makes.

Every rank holds the whole batch (rank 0 forwards the request), so each computes every rank's share
without talking. Sequences are ordered by sampling distribution (temperature, top_p), then length, longest
first, and dealt round-robin, so the ranks get counts within one of each other and similar lengths. Each rank
cuts its share into micro-batches of `micro_batch_size` (DeepSpeed's micro batch per GPU).

Every rank must run the same number of backward passes: ZeRO-2 reduces gradients inside each backward (a
collective), and the last pass is the accumulation boundary everywhere. A rank with fewer micro-batches
adds padding passes: the batch's shortest sequence, its loss multiplied by 0, so the same graph fires the
same reduction hooks and adds exactly nothing.

The loss normalisers stay whole-batch (loss.BatchNormalizer): a rank's loss is its exact share of the
batch loss, and the ranks' gradients SUM to the batch gradient; DeepSpeed averages them over the ranks,
which the trainer undoes by scaling each rank's loss by the world size.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from learner.batching import MicroBatch, Sequence, make_micro_batches


@dataclass
class RankShare:
    micro_batches: list[MicroBatch]  # this rank's sequences, cut into micro-batches
    padding_passes: int  # zero-loss passes after them, so every rank makes the same number of backwards
    padding: MicroBatch | None  # what a padding pass runs on (None when there is none)

    @property
    def passes(self) -> int:
        return len(self.micro_batches) + self.padding_passes


def _length(seq: Sequence) -> int:
    return len(seq.prompt) + len(seq.completion)


def shard_indices(seqs: list[Sequence], world_size: int) -> list[list[int]]:
    """Each rank's sequence indices (in request order), dealt round-robin by distribution and length."""
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i].decoding, -_length(seqs[i])))
    return [sorted(order[rank::world_size]) for rank in range(world_size)]


def count_micro_batches(seqs: list[Sequence], micro_batch_size: int) -> int:
    """How many micro-batches make_micro_batches cuts (one sampling distribution per micro-batch)."""
    per_decoding = Counter(seq.decoding for seq in seqs)
    return sum(math.ceil(n / micro_batch_size) for n in per_decoding.values())


def rank_share(seqs: list[Sequence], micro_batch_size: int, rank: int, world_size: int) -> RankShare:
    shards = [[seqs[i] for i in indices] for indices in shard_indices(seqs, world_size)]
    mine = make_micro_batches(shards[rank], micro_batch_size) if shards[rank] else []
    passes = max(count_micro_batches(shard, micro_batch_size) for shard in shards)
    padding = None
    if passes > len(mine):
        padding = make_micro_batches([min(seqs, key=_length)], 1)[0]
    return RankShare(mine, passes - len(mine), padding)
