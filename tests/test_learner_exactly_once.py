"""A step's effect once, whatever happens to its answer (issue 60's chaos soak found each of these):

- a native batch sent again after its answer was lost (the front end timed out on a paused learner, put the batch
  back and sent it again) is answered from the step already taken, not trained twice (learner/trainer.py);
- a verb whose caller has stopped waiting is not run when its turn comes (grpo_server/protocol/deadline.py);
- a checkpoint that fails after a step (a full disk) does not fail the step's verb, whose caller would send the
  step again; its ledger lines wait for the next checkpoint (learner/checkpoint_writer.py);
- a worker's full disk is a 503 `disk_full` with Retry-After, not a 500 (grpo_server/protocol/dispatch.py).
"""

from __future__ import annotations

import errno
import time

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from grpo_server.protocol import deadline
from grpo_server.protocol.codec import MSGPACK, unpack
from grpo_server.protocol.dispatch import error_middleware
from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.wire import TrainRequest
from grpo_server.protocol.worker_config import AlgorithmConfig
from learner import checkpoint, ledger
from tests.learner_helpers import COMPLETION, LORA, PROMPT, _adapter_weights, _lp, _sample


def _batch(trainer, name: str, journal_seq: int, group: str) -> TrainRequest:
    return TrainRequest(name=name, samples=[_sample(PROMPT, COMPLETION, _lp(trainer, name)[0], 1.0)],
                        journal_seq=journal_seq, group_ids=[group])


def test_a_batch_sent_again_is_answered_from_its_step_not_trained_twice(trainer):
    trainer.add_experiment("once", LORA, AlgorithmConfig(learning_rate=1e-2, checkpoint_interval_s=3600))
    batch = _batch(trainer, "once", journal_seq=3, group="g3")
    first = trainer.train(batch)
    weights = _adapter_weights(trainer, "once")
    again = trainer.train(batch)  # the same batch: its answer was lost on the way
    assert again.step == first.step == 1 and again.loss == first.loss
    assert all(torch.equal(weights[k], v) for k, v in _adapter_weights(trainer, "once").items())
    with pytest.raises(ApiError) as older:  # a batch behind the weights' position, not the newest: refused
        trainer.train(_batch(trainer, "once", journal_seq=2, group="g2"))
    assert older.value.code == "batch_already_trained"
    assert trainer.train(_batch(trainer, "once", journal_seq=5, group="g5")).step == 2  # the next one trains
    trainer.checkpoint("once")
    lines = ledger.timeline(ledger.read(checkpoint.checkpoint_root(trainer.config.run_dir, "once")))
    assert [(line["step"], line["trained"]) for line in lines] == [(1, ["g3"]), (2, ["g5"])]


def test_a_failed_checkpoint_after_a_step_leaves_the_step_answered_and_its_lines_kept(trainer, monkeypatch):
    trainer.add_experiment("fullcp", LORA, AlgorithmConfig(learning_rate=1e-2, checkpoint_every=1,
                                                           checkpoint_interval_s=0))
    real_write = checkpoint.write

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write", full_disk)
    assert trainer.train(_batch(trainer, "fullcp", 1, "a")).step == 1  # its checkpoint fails on the writer's thread
    assert trainer.train(_batch(trainer, "fullcp", 2, "b")).step == 2  # which the next one meets: logged, not raised
    monkeypatch.setattr(checkpoint, "write", real_write)  # space again
    assert trainer.train(_batch(trainer, "fullcp", 3, "c")).step == 3
    trainer.checkpoint("fullcp")
    lines = ledger.timeline(ledger.read(checkpoint.checkpoint_root(trainer.config.run_dir, "fullcp")))
    assert [line["trained"] for line in lines] == [["a"], ["b"], ["c"]]


async def _answer(handler, headers=None):
    app = web.Application(middlewares=[error_middleware, deadline.deadline_middleware])
    app.router.add_post("/verb", handler)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/verb", headers=headers or {})
        return response.status, response.headers, unpack(await response.read()) \
            if response.content_type == MSGPACK else await response.text()


async def test_a_verb_whose_caller_stopped_waiting_is_not_run():
    ran = []

    async def verb(request):
        deadline.check_deadline("train")
        ran.append(True)
        return web.Response(text="ran")

    assert (await _answer(verb, deadline.deadline_headers(60)))[0] == 200 and ran == [True]
    status, _, body = await _answer(verb, {deadline.HEADER: f"{time.time() - 5:.3f}"})  # it waited 5 s too long
    assert status == 503 and body["error"]["code"] == "deadline_passed" and ran == [True]


async def test_a_full_disk_is_a_503_to_retry_not_a_500():
    async def verb(request):
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    status, _, body = await _answer(verb)
    assert status == 503 and body["error"]["code"] == "disk_full"

    async def other(request):
        raise RuntimeError("a bug")

    assert (await _answer(other))[0] == 500


def test_a_saved_version_writes_its_steps_lines_as_a_checkpoint_does(trainer):
    """A learner with no newer checkpoint resumes from the newest version (learner/resume.py): the steps in it are
    durable, so their lines are on disk once it is saved (the 30-minute soak found an experiment's first step,
    saved as v1 before its first checkpoint and resumed from it, in no line)."""
    trainer.add_experiment("saved1", LORA, AlgorithmConfig(learning_rate=1e-2, checkpoint_every=2,
                                                           checkpoint_interval_s=3600))
    trainer.train(_batch(trainer, "saved1", journal_seq=2, group="g12"))  # no checkpoint due at step 1
    root = checkpoint.checkpoint_root(trainer.config.run_dir, "saved1")
    assert [line["step"] for line in ledger.timeline(ledger.read(root))] == []
    trainer.save_adapter("saved1")
    assert [(line["step"], line["trained"]) for line in ledger.timeline(ledger.read(root))] == [(1, ["g12"])]
