"""Crashes lose nothing: kill -9 the learner mid-training, then the whole server, and start it again on the
same run directory (real processes, tiny model). Feedback accepted before the crash is trained exactly once,
and a Tinker model's saved state and sampler weights are still reachable by their tinker:// paths (the
official SDK, as a cookbook run resuming from its checkpoint would use them)."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import pytest
import tinker
from tinker import types

from grpo_server.client import AsyncClient
from tests.serving import ADMIN_KEY, complete_when_admitted, start_server, stop_server, wait_for

NAME = "durable"
# What the server says of a replay: the status error of a learner restart (runtime/orchestrator.py
# _resync_learner), and the log line of an experiment restored at start (runtime/orchestrator.py _create).
RESYNCED = re.compile(r"learner restarted; resumed at v\d+ \(step (\d+)\), (\d+) journalled groups queued to train")
RESTORED = re.compile(rf"experiment {NAME} created, serving v\d+ at step (\d+), (\d+) journalled groups to train")
os.environ.setdefault("TINKER_TELEMETRY", "0")


def kill_everything(server) -> None:
    """SIGKILL the front end and every worker process group at once: no clean shutdown anywhere."""
    for pid in server.worker_pids():
        try:
            os.killpg(pid, signal.SIGKILL)  # workers lead their own process groups (vLLM's children too)
        except ProcessLookupError:
            pass
    server.process.kill()
    server.process.wait()


async def rate_one(client) -> int:
    """One group sampled and rated: 1, the group acknowledged for training (a 202 that must end up in the weights).
    Anything else fails here: a refusal raises, and a group skipped would leave nothing to train."""
    group = await complete_when_admitted(client, NAME, prompt="Pick a number")
    answer = await client.feedback(NAME, group.group_id, [float(i % 2) for i in range(4)])  # never zero variance
    assert answer.skipped is None, answer
    return 1


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def tinker_before_crash(url: str, base_model: str) -> dict:
    """A Tinker model trains a step, saves its state and sampler weights; what it scores then is what the same
    paths must give after the crash."""
    with tinker.ServiceClient(base_url=url, api_key=f"tml-{ADMIN_KEY}") as client:  # its exit ends the session
        training = client.create_lora_training_client(base_model=base_model, rank=8).result()
        batch = [_datum(training.get_tokenizer().encode("one two three four five six"))]
        training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = training.save_state("before-crash").result().path
        sampler = training.save_weights_for_sampler("served").result().path
        loss = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    return {"model_id": training.model_id, "state": state, "sampler": sampler, "batch": batch, "loss": loss}


def tinker_after_restart(url: str, saved: dict) -> None:
    with tinker.ServiceClient(base_url=url, api_key=f"tml-{ADMIN_KEY}") as client:
        restored = client.create_training_client_from_state_with_optimizer(saved["state"]).result()
        assert restored.forward(saved["batch"], "cross_entropy").result().metrics["loss:sum"] == \
            pytest.approx(saved["loss"], rel=1e-4)
        sampled = client.create_sampling_client(model_path=saved["sampler"]).result().sample(
            saved["batch"][0].model_input, 2, types.SamplingParams(max_tokens=3, seed=1)).result()
    assert len(sampled.sequences) == 2 and all(s.tokens for s in sampled.sequences)
    listed = tinker.RestClient(base_url=url, api_key=f"tml-{ADMIN_KEY}").list_checkpoints(saved["model_id"]).result()
    assert {"weights/before-crash", "sampler_weights/served"} <= {c.checkpoint_id for c in listed.checkpoints}


def tinker_gradients_pending(url: str, base_model: str) -> tuple:
    """A Tinker model that stepped once (checkpointed, as a native step is) and holds summed gradients when its
    learner dies: what a restart loses must be said to its client (issue 46)."""
    client = tinker.ServiceClient(base_url=url, api_key=f"tml-{ADMIN_KEY}")
    training = client.create_lora_training_client(base_model=base_model, rank=8).result()
    batch = [_datum(training.get_tokenizer().encode("seven eight nine ten"))]
    training.forward_backward(batch, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    training.forward_backward(batch, "cross_entropy").result()  # pending when the learner dies
    return client, training, batch


def tinker_told_of_the_rollback(client, training, batch) -> None:
    with pytest.raises(tinker.RequestFailedError) as caught:  # the next call fails, naming what was lost
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert "gradients summed by forward_backward" in str(caught.value) and "rolled back" not in str(caught.value)
    training.forward_backward(batch, "cross_entropy").result()  # and then the model goes on, from its checkpoint
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    client.close("success").result(timeout=60)


async def test_accepted_feedback_and_tinker_models_survive_crashes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    server = start_server(run_dir, tiny_model_dir)
    accepted = 0
    try:
        tinker_saved = await asyncio.to_thread(tinker_before_crash, server.url, str(tiny_model_dir))
        async with AsyncClient(server.url, server.api_key) as client:
            await client.create_experiment({
                "name": NAME, "api_key": "durable-key-8b1f04c3",
                # checkpoint_every 2 (interval 0: by steps alone): a crash loses up to one step, which the journal
                # must retrain.
                "algorithm": {"batch_groups": 1, "checkpoint_every": 2, "checkpoint_interval_s": 0,
                              "max_staleness": 1000, "learning_rate": 1e-3},
                "sampling": {"n": 4, "max_tokens": 3}})
            for _ in range(5):
                accepted += await rate_one(client)
            pending = await asyncio.to_thread(tinker_gradients_pending, server.url, str(tiny_model_dir))
            learner = next(p for p in server.worker_pids()
                           if b"learner" in open(f"/proc/{p}/cmdline", "rb").read().split(b"\0"))
            os.killpg(learner, signal.SIGKILL)  # groups are queued: it dies mid-training

            async def learner_down():
                health = await client.health()
                return health if health.workers.get("learner") != "ready" else None

            await wait_for(learner_down, timeout_s=60)
            # The Tinker client's next call, made while the learner restarts, waits for it (the SDK does not retry
            # a failed call), then fails naming what the restart lost, and the model goes on.
            told = asyncio.ensure_future(asyncio.to_thread(tinker_told_of_the_rollback, *pending))
            for _ in range(3):  # feedback is still accepted while the learner is down
                accepted += await rate_one(client)

            async def learner_back():
                status = await client.status(NAME)
                return status if any("learner restarted" in e for e in status.errors) else None

            resynced = await wait_for(learner_back, timeout_s=300)
            # The learner's restart replayed the journal: it resumed at its last checkpoint (every 2 steps, one
            # group a step), behind the 5 groups acknowledged before the kill, and queued the groups since.
            (resumed_step, replayed), = [tuple(map(int, m.groups())) for e in resynced.errors
                                         if (m := RESYNCED.search(e))]
            assert resumed_step < 5 and replayed >= 5 - resumed_step, resynced.errors

            async def every_experiment_resynced():  # the Tinker model's experiment too
                return all(any("learner restarted" in e for e in s.errors) for s in await client.list_experiments())

            await wait_for(every_experiment_resynced, timeout_s=300)
            await told
            for _ in range(3):
                accepted += await rate_one(client)
            before = await client.status(NAME)
        assert accepted == 11, accepted
        kill_everything(server)

        server = start_server(run_dir, tiny_model_dir)  # the same run directory: everything resumes
        async with AsyncClient(server.url, "durable-key-8b1f04c3") as client:  # the experiment's key survived too

            async def drained():  # every accepted group trained, and the last step's version pushed and served
                status = await client.status(NAME)
                trained = status.counters.groups_trained >= accepted and not status.queued_groups
                # A step counts as trained before its push ends: until then learner_version is one ahead.
                return status if trained and status.learner_version == status.policy_version else None

            status = await wait_for(drained, timeout_s=300)
            # Exactly once: one group per step (batch_groups 1), every accepted group trained, none twice.
            assert status.counters.groups_trained == accepted == status.step, (status.counters, accepted)
            assert status.policy_version >= before.policy_version  # numbering continues, nothing reused
            # And the journal replay is what trained the rest: the restart resumed at the last checkpoint (an even
            # step: at most 10 of the 11) and queued exactly the acknowledged groups after it.
            (resumed_step, replayed), = [tuple(map(int, m.groups())) for m in RESTORED.finditer(
                server.log_path.read_text(errors="replace"))]
            assert replayed >= 1 and resumed_step + replayed == accepted, (resumed_step, replayed, accepted)
            for _ in range(2):  # and the resumed experiment keeps learning
                accepted += await rate_one(client)
            status = await wait_for(drained, timeout_s=300)
            assert status.counters.groups_trained == accepted == status.step == 13
        await asyncio.to_thread(tinker_after_restart, server.url, tinker_saved)
    finally:
        if server.process.poll() is None:
            stop_server(server)
