"""Bytes between the learner's ranks, as uint8 tensors over a CPU (gloo) process group: never pickle.

torch.distributed's `*_object` collectives (gather_object, scatter_object_list, ...) pickle on one rank and
unpickle on another, and an unpickler runs whatever callable the bytes name: whoever can put bytes on the
ranks' connections (they are plain TCP, their addresses handed out by a store open to anything that reaches
it) could run code in the learner. Here a collective carries only bytes; what they mean is encoded and
decoded by their owner as data (e.g. learner/checkpoint.py's `encode_shard` / `decode_shard`:
`torch.load(weights_only=True)` with an allow-list). Each call is a collective: every rank of `group`
makes it at the same point, in the same order.

gloo's gather and scatter move tensors of one size, so the lengths go first and the buffers are padded to
the longest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_to_first(payload: bytes, rank: int, world_size: int, group: Any) -> list[bytes]:
    """Every rank's `payload` on rank 0, in rank order (an empty list on the other ranks)."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    sizes = [int(n) for n in lengths]
    longest = max(max(sizes), 1)  # no zero-size buffers, whatever gloo makes of them
    buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)] if rank == 0 else None
    dist.gather(_padded(payload, longest), buffers, dst=0, group=group)
    if buffers is None:
        return []
    return [_bytes(buffer, size) for buffer, size in zip(buffers, sizes)]


def scatter_from_first(payloads: list[bytes] | None, rank: int, world_size: int, group: Any) -> bytes:
    """payloads[r] (given on rank 0; None elsewhere) on rank r."""
    lengths = torch.zeros(world_size, dtype=torch.int64)
    if rank == 0:
        if payloads is None or len(payloads) != world_size:
            raise ValueError(f"rank 0 scatters one payload per rank: {world_size} expected")
        lengths = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    dist.broadcast(lengths, src=0, group=group)
    longest = max(int(lengths.max()), 1)
    received = torch.empty(longest, dtype=torch.uint8)
    dist.scatter(received, [_padded(p, longest) for p in payloads] if rank == 0 else None, src=0, group=group)
    return _bytes(received, int(lengths[rank]))


def _padded(payload: bytes, length: int) -> torch.Tensor:
    buffer = torch.zeros(length, dtype=torch.uint8)
    if payload:
        buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer


def _bytes(buffer: torch.Tensor, size: int) -> bytes:
    return buffer[:size].numpy().tobytes()
