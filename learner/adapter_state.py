"""One experiment as the learner holds it (`AdapterUnderTraining`): its own module, so that the trainer and its
mixins (learner/steps.py, previous_version.py, checkpoint_writer.py) all name it without importing each other."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_server.protocol.worker_config import AlgorithmConfig
from learner.ledger import PendingLines


@dataclass
class AdapterUnderTraining:
    """One experiment in the learner: its peft adapter, DeepSpeed engine (and optimizer) and counters."""

    name: str
    # peft adapter name: "exp_" + name, or after a page-in a spare's (learner/paging.py); never a substring of "lora_"
    adapter: str
    algorithm: AlgorithmConfig
    params: list[torch.nn.Parameter]
    engine: Any
    step: int
    version: int
    journal_seq: int = 0  # the newest feedback-journal entry these weights include (front end's numbering)
    groups_trained: int = 0
    checkpointed_step: int = -1
    checkpoint_started_s: float = field(default_factory=time.monotonic)  # the newest checkpoint's start
    used_at_s: float = field(default_factory=time.monotonic)  # its latest verb's start (paging.py's idle rule)
    busy_at_use_s: float = 0.0  # the learner's verb_seconds at that start (paging.py's idle rule)
    # The saved version whose weights the adapter holds exactly (None once a step has moved them, until
    # the next save): completions it sampled are compared with the learner's own logprobs in `train`.
    weights_version: int | None = None
    pending_backwards: int = 0  # Tinker's forward_backward calls summed into the gradients since its optim_step
    # Counts what moved its weights or optimizer state (a step, a reset, a loaded state): a page-out
    # (learner/paging.py) writes a checkpoint only if the newest one does not hold this count.
    changes: int = 0
    checkpointed_changes: int = -1
    # The newest native step's batch position and answer: a retry of that batch (its answer was lost to the front end's
    # timeout) is answered with it, not trained again (MultiAdapterTrainer.train).
    last_train: tuple[int, Any] | None = None
    # What its steps consumed since the newest checkpoint started, for the ledger written with the next one.
    ledger: PendingLines = field(default_factory=PendingLines)
