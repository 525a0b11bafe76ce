"""The learner's scoring under the version saved before the newest (learner/previous_version.py), in process (the
`trainer` fixture, tests/conftest.py): exactly the earlier version's logprobs, the live weights left exactly as
they were, and refused once a step has moved them past the save."""

from __future__ import annotations

import pytest
import torch

from grpo_server.protocol.errors import Conflict
from grpo_server.protocol.wire import LogprobsRequest, TrainRequest
from grpo_server.protocol.worker_config import AlgorithmConfig
from tests.learner_helpers import COMPLETION, LORA, PROMPT, _adapter_weights, _lp, _sample

REQUEST = LogprobsRequest(name="prev", prompt_token_ids=PROMPT, completions_token_ids=[COMPLETION, COMPLETION[:2]])


def _step(trainer) -> None:
    trainer.train(TrainRequest(name="prev", samples=[_sample(PROMPT, COMPLETION, _lp(trainer, "prev")[0], 1.0)]))


def test_the_previous_version_is_scored_from_memory_and_the_weights_come_back(trainer):
    trainer.add_experiment("prev", LORA, AlgorithmConfig(learning_rate=1e-2))
    assert trainer.previous_logprobs(REQUEST) is None  # only the start version saved: nothing before it
    at_v0 = trainer.logprobs(REQUEST)
    _step(trainer)
    assert trainer.save_adapter("prev").version == 1
    at_v1, weights_v1 = trainer.logprobs(REQUEST), _adapter_weights(trainer, "prev")
    assert at_v1 != at_v0
    version, scored = trainer.previous_logprobs(REQUEST)
    assert version == 0 and scored == at_v0  # v0's weights, bit for bit
    after = _adapter_weights(trainer, "prev")
    assert all(torch.equal(weights_v1[k], after[k]) for k in after) and trainer.logprobs(REQUEST) == at_v1
    _step(trainer)
    assert trainer.save_adapter("prev").version == 2
    assert trainer.previous_logprobs(REQUEST) == (1, at_v1)  # the window moved on: v1 is the previous now
    _step(trainer)  # weights past v2, nothing saved: copying v2 back would undo the step
    with pytest.raises(Conflict):
        trainer.previous_logprobs(REQUEST)
    trainer.remove_experiment("prev")
