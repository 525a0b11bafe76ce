"""What the Tinker API keeps of its own (service.py holds them): the weights a save pushed for sampling, training
models, samplers, and the `tinker://` paths that name them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from grpo_server.api.tinker import schema as ts
from grpo_server.api.tinker.futures import SeqLane
from grpo_server.protocol.errors import BadRequest

MAX_REMEMBERED = 4096  # sample seq_ids a sampler remembers (for a resubmission's future)


@dataclass
class SamplerWeights:
    version: int
    path: str  # the version's folder on the learner (what a sampler loads)
    saved_at: float = field(default_factory=time.time)


@dataclass
class TinkerModel:
    model_id: str
    experiment: str
    owner: str
    lora: ts.LoraConfig
    lane: SeqLane = field(default_factory=SeqLane)
    sampler_weights: dict[str, SamplerWeights] = field(default_factory=dict)
    probe_tokens: list[int] | None = None  # a sequence it trained on: what its pushes' checks score
    # What a restart may roll back, as this front end last saw it: the optimizer step its last optim_step reached
    # (kept in the registry), and whether it holds summed gradients, made under which learner life.
    step: int = 0
    gradients_pending: bool = False
    learner_life: int = 0
    expires: dict[str, float] = field(default_factory=dict)  # checkpoint id -> epoch seconds (its ttl_seconds)
    created_at: float = field(default_factory=time.time)
    last_request_at: float = field(default_factory=time.time)


@dataclass
class Sampler:
    sampler_id: str
    owner: str
    model: TinkerModel | None  # None: the base model
    weights: SamplerWeights | None
    model_path: str | None
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request id (a client's retry)

    def remember(self, seq_id: int, request_id: str) -> None:
        self.seen[seq_id] = request_id
        if len(self.seen) > MAX_REMEMBERED:  # only recent samples are resubmitted
            for old in sorted(self.seen)[:MAX_REMEMBERED // 4]:
                del self.seen[old]


def parse_path(path: str, kind: str) -> tuple[str, str]:
    """`tinker://{model_id}/{kind}/{name}` -> (model_id, name); a 400 otherwise."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != kind or not parts[0] or not parts[2]:
        raise BadRequest(f"{path!r} is not a tinker://<model_id>/{kind}/<name> path", code="bad_path")
    return parts[0], parts[2]
