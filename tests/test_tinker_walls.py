"""The walls of the native API hold for the Tinker routes too (issue 46), tried from outside as a tenant with an
ordinary key would, on the shared real server (tiny model, HTTP on loopback) through the official `tinker` SDK and
raw HTTP: no experiment takes the name `admin`; a deleted experiment's Tinker models go with it, so a new tenant of
the name starts clean; native feedback acknowledged while a Tinker model's gradients wait for their optim_step is
trained; and sizes are bounded at the edge (num_samples, sampling ranges, tensor shapes) at once, without holding
the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from grpo_server.client import AsyncClient, GrpoServerError  # noqa: E402
from tests.serving import ADMIN_KEY, wait_for  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
RANK = 8


def _call(server, method: str, path: str, key: str, body: dict | None = None) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of one raw call; `key` goes as the Tinker SDK sends it."""
    headers = {"Content-Type": "application/json", "X-API-Key": f"tml-{key}",
               "Authorization": f"Bearer {key}"}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(server.url + path, data=data, headers=headers, method=method)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"{}"), time.monotonic() - started
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}"), time.monotonic() - started


def _experiment(name: str, key: str, **algorithm) -> dict:
    return {"name": name, "api_key": key, "lora": {"r": RANK}, "sampling": {"n": 2, "max_tokens": 3},
            "algorithm": {"batch_groups": 1, "max_staleness": 1000, **algorithm}}


def test_no_experiment_takes_the_admins_name(server):
    status, body, _ = _call(server, "POST", "/v1/experiments", ADMIN_KEY,
                            {"name": "admin", "api_key": "would-be-admin-key-0123"})
    assert status == 422 and "reserved" in body["error"]["message"], body


def test_a_new_tenant_of_a_deleted_name_inherits_nothing(server, tiny_model_dir):
    first, second = "first-tenant-key-0a1b2c3d", "second-tenant-key-4e5f6a7b"
    assert _call(server, "POST", "/v1/experiments", ADMIN_KEY, _experiment("walls-reused", first))[0] == 201
    with tinker.ServiceClient(base_url=server.url, api_key=f"tml-{first}") as tenant:
        old = tenant.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result()
    assert _call(server, "DELETE", "/v1/experiments/walls-reused", ADMIN_KEY)[0] == 204
    assert _call(server, "POST", "/v1/experiments", ADMIN_KEY, _experiment("walls-reused", second))[0] == 201
    try:
        status, body, _ = _call(server, "POST", "/api/v1/get_info", second, {"model_id": old.model_id})
        assert status == 404 and body["error"]["code"] == "model_not_found", body
        with tinker.ServiceClient(base_url=server.url, api_key=f"tml-{second}") as tenant:  # its own, at once
            own = tenant.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result()
            assert own.model_id != old.model_id and own.get_info().lora_rank == RANK
    finally:
        assert _call(server, "DELETE", "/v1/experiments/walls-reused", ADMIN_KEY)[0] == 204


async def test_feedback_acknowledged_while_tinker_gradients_wait_is_trained(server, tiny_model_dir):
    """Issue 46: a native step met the Tinker model's pending gradients (409 gradients_pending), its batch was not
    put back, and a later checkpoint compacted those acknowledged groups out of the journal. Now batches wait in
    the experiment's one training queue while a Tinker client's gradients wait for its optim_step."""
    key = "pending-grads-key-8c9d0e1f"
    config = _experiment("walls-pending", key)
    assert _call(server, "POST", "/v1/experiments", ADMIN_KEY, config)[0] == 201
    tenant = tinker.ServiceClient(base_url=server.url, api_key=f"tml-{key}")
    try:
        def pending_gradients():
            training = tenant.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result()
            tokens = training.get_tokenizer().encode("one two three four")
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
            training.forward_backward([datum], "cross_entropy").result()
            return training

        training = await asyncio.to_thread(pending_gradients)
        async with AsyncClient(server.url, key) as client:
            rated = 0
            while True:  # as many groups as the server admits while no step can run (then 429 learner_behind)
                try:
                    group = await client.complete("walls-pending", prompt="Pick a number")
                except GrpoServerError as exc:
                    assert exc.status == 429 and rated >= 2, exc
                    break
                answer = await client.feedback("walls-pending", group.group_id, [1.0, 0.0])
                assert answer.skipped is None  # a 202 for a group that must be trained
                rated += 1
            await asyncio.sleep(3)  # native steps try meanwhile, and meet the pending gradients
            assert (await client.status("walls-pending")).counters.groups_trained == 0
            await asyncio.to_thread(lambda: training.optim_step(types.AdamParams(learning_rate=1e-3)).result())

            async def all_trained():
                status = await client.status("walls-pending")
                return status if status.counters.groups_trained >= rated else None

            status = await wait_for(all_trained, timeout_s=120)
            assert status.counters.groups_trained == rated and not status.queued_groups
            # One queue, one rule: the batches waited for the optim_step; no step was sent to fail on the gradients
            assert not [e for e in status.errors if "train step failed" in e], status.errors
    finally:
        await asyncio.to_thread(tenant.close, "success")
        assert _call(server, "DELETE", "/v1/experiments/walls-pending", ADMIN_KEY)[0] == 204


def _sample_body(**fields) -> dict:
    return {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "sampling_params": {},
            "base_model": None, **fields}


@pytest.mark.parametrize("fields, code", [
    ({"num_samples": 3_000_000}, "invalid_request"),  # past any server's max_n: the body's own bound
    ({"num_samples": 65}, "over_limit"),  # past this server's max_n (64)
    ({"sampling_params": {"max_tokens": 100_000}}, "over_limit"),
    ({"sampling_params": {"temperature": 5.0}}, "invalid_request"),
    ({"sampling_params": {"top_p": 0}}, "invalid_request"),
    ({"sampling_params": {"stop": ["x"] * 17}}, "invalid_request"),
    ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [2**62] * 40_000}}, "invalid_request"),
    ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [1, 300_000_000],
                                 "sparse_crow_indices": [0, 1], "sparse_col_indices": [0]}}, "invalid_request"),
    ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [1, 4],
                                 "sparse_crow_indices": [0, 1], "sparse_col_indices": [9]}}, "invalid_request"),
])
def test_sizes_are_bounded_at_the_edge_at_once(server, fields, code):
    status, body, seconds = _call(server, "POST", "/api/v1/asample", ADMIN_KEY, _sample_body(**fields))
    assert status == 422 and body["error"]["code"] == code, body
    assert seconds < 1.0, f"refused after {seconds:.2f} s"  # nothing built from the numbers first


def test_a_large_body_does_not_hold_the_event_loop(server):
    """A body of megabytes is decoded and validated on a thread: /v1/health keeps answering meanwhile, and the
    server's own loop-lag monitor saw no stall while it was decoded."""
    values = list(range(1_000_000, 1_850_000))  # 850k 7-digit ids: ~7.6 MB of JSON, under the 8 MiB body limit
    body = _sample_body(target_prompt_logprobs={"data": values, "dtype": "int64", "shape": [len(values)]})
    assert len(json.dumps(body)) < 8 * 1024 * 1024

    def lag() -> float:  # the largest of the last minute, as the server's own monitor measured it
        return _call(server, "GET", "/v1/health", ADMIN_KEY)[1]["event_loop_lag_max_s"]

    # Twice at most, each from a window without a stall: the lag also counts time the loop waited for a core, and on
    # a loaded 2-core box (the other test worker's server) one such wait reached 0.27 s once. The stall this test is
    # about comes back with every body; a wait for a core does not.
    lags = []
    for _ in range(2):
        deadline = time.monotonic() + 70
        while lag() >= 0.25 and time.monotonic() < deadline:
            time.sleep(1)
        slowest = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the sender's exception, if any, fails the test
            sent = pool.submit(_call, server, "POST", "/api/v1/asample", ADMIN_KEY, body)
            while not sent.done():
                slowest.append(_call(server, "GET", "/v1/health", ADMIN_KEY)[2])
            status, _, seconds = sent.result()
        assert status == 200, status  # decoded and validated (a future), not refused unread (413)
        # A liveness bound: on the loop, this body held it ~0.3 s, off it /v1/health took under 0.07 s (measured
        # on this box); the mechanism itself is test_a_large_body_is_decoded_off_the_loop's.
        assert len(slowest) >= 2 and max(slowest) < 0.5, (slowest, seconds)
        lags.append(lag())
        if 0 <= lags[-1] < 0.25:
            break
    assert 0 <= lags[-1] < 0.25, lags


async def test_a_large_body_is_decoded_off_the_loop(monkeypatch):
    """parse_body hands a body over edge.OFF_LOOP_BYTES to the body pool's threads (not asyncio's shared executor),
    a small one not (no thread for nothing)."""
    from grpo_server.api import edge
    from grpo_server.api.app_state import BODY_POOL
    from grpo_server.api.body_pool import BodyPool
    from grpo_server.api.tinker.schema import SampleRequest

    seen = []
    decode = edge.decode_body
    monkeypatch.setattr(edge, "decode_body", lambda *a: seen.append(threading.current_thread()) or decode(*a))

    class Request:
        content_type, client_max_size, remote, app = "application/json", 2**30, "127.0.0.1", {BODY_POOL: BodyPool()}
        content_length = None  # unknown, as for a chunked body: the slot is checked when it is decoded

        def __init__(self, body: bytes):
            self.body = body

        async def read(self) -> bytes:
            return self.body

    small = json.dumps(_sample_body()).encode()
    large = json.dumps(_sample_body(target_prompt_logprobs={"data": list(range(20_000)), "dtype": "int64"})).encode()
    assert len(small) < edge.OFF_LOOP_BYTES < len(large)
    for body in (small, large):
        assert isinstance(await edge.parse_body(Request(body), SampleRequest), SampleRequest)
    assert seen[0] is threading.main_thread() and seen[1].name.startswith("body-decode")


async def test_a_forward_backward_body_is_decoded_in_the_pool_process_within_its_bounds():
    """The Tinker protobuf decoder is plain Python: on a thread it held the GIL against the event loop for its whole
    run (api/body_pool.py). Its codec sends it to the body pool's process, as a partial that pickles, and what it
    raises there comes back whole: a body over the bounds is OverLimit (the route's 422 over_limit)."""
    import functools
    import pickle
    from types import SimpleNamespace

    from grpo_server.api.app_state import TINKER
    from grpo_server.api.body_pool import BodyPool
    from grpo_server.api.tinker.protobuf import OverLimit
    from grpo_server.api.tinker.routes import FORWARD_BACKWARD
    from scripts.benchmarks.hostile import decode_body

    assert FORWARD_BACKWARD.in_process and FORWARD_BACKWARD.over_limit == (OverLimit,)
    request = SimpleNamespace(app={TINKER: SimpleNamespace(orchestrator=SimpleNamespace(
        config=SimpleNamespace(tinker_max_tokens_per_call=65_536)))})
    decode = FORWARD_BACKWARD.decoder(request)
    pickle.dumps(decode)
    pool = BodyPool()
    try:
        decoder = await pool.run("key", os.getpid, in_process=True)
        assert decoder != os.getpid()
        assert os.getpriority(os.PRIO_PROCESS, decoder) == 10  # it yields the cores (body_pool._lower_priority)
        autogroup = Path(f"/proc/{decoder}/autogroup")
        if autogroup.exists():  # a kernel with autogroups: its own session, weighted down too
            assert autogroup.read_text().split()[-1] == "10", autogroup.read_text()
        with pytest.raises(OverLimit, match="65 datums"):  # 6 MiB of 1,024 datums: stopped at the 65th
            await pool.run("key", functools.partial(decode, decode_body("m:0")), in_process=True)
        from tinker.proto import tinker_public_pb2 as pb  # the SDK's own messages, as a client sends them

        chunk = pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack("<3i", 1, 2, 3)))
        body = pb.ForwardBackwardRequest(model_id="m:0", data=[pb.Datum(model_input=[chunk])],
                                         loss_fn="cross_entropy").SerializeToString()
        decoded = await pool.run("key", functools.partial(decode, body), in_process=True)
        assert decoded.forward_backward_input.data[0].model_input.length == 3
    finally:
        pool.close()


def test_named_weights_outlive_pruning_and_saved_states_expire(server, tiny_model_dir):
    """One retention rule (issue 46): pushes prune old versions (learner.keep_versions, 8 here), but never one a
    client names; a saved state with ttl_seconds is deleted once they pass."""
    with tinker.ServiceClient(base_url=server.url, api_key=f"tml-{ADMIN_KEY}") as client:
        training = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result()
        experiment = "tinker-" + training.model_id.split(":")[0].removeprefix("sess-") + "-" + \
            training.model_id.split(":")[-1]
        folder = server.run_dir / "adapters" / experiment
        kept = training.save_weights_for_sampler("kept").result().path
        kept_version = max(int(p.name[1:]) for p in folder.iterdir() if p.name.startswith("v"))
        for _ in range(10):  # one name saved over and over: each earlier version is named no more
            training.save_weights_for_sampler("rolling").result()
        on_disk = sorted(int(p.name[1:]) for p in folder.iterdir() if p.name.startswith("v"))
        assert kept_version in on_disk and kept_version + 1 not in on_disk, on_disk
        sampled = client.create_sampling_client(model_path=kept).result().sample(
            types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
        assert sampled.sequences[0].tokens

        status, body, _ = _call(server, "POST", "/api/v1/save_weights", ADMIN_KEY,
                                {"model_id": training.model_id, "path": "short-lived", "ttl_seconds": 1})
        assert status == 200, body
        status, body, _ = _call(server, "POST", "/api/v1/retrieve_future", ADMIN_KEY,
                                {"request_id": body["request_id"]})
        assert status == 200 and body["path"].endswith("/weights/short-lived"), body
        listed = tinker.RestClient(base_url=server.url, api_key=f"tml-{ADMIN_KEY}")
        assert "weights/short-lived" in {c.checkpoint_id for c in listed.list_checkpoints(training.model_id).result()
                                         .checkpoints}
        time.sleep(1.5)
        assert "weights/short-lived" not in {c.checkpoint_id for c in
                                             listed.list_checkpoints(training.model_id).result().checkpoints}
        assert not (server.run_dir / "checkpoints" / experiment / "states" / "short-lived").exists()
    assert _call(server, "DELETE", f"/v1/experiments/{experiment}", ADMIN_KEY)[0] == 204


async def test_tinker_samples_go_through_the_experiments_own_verb(server, tiny_model_dir):
    """Issue 46: Tinker's asample called the workers directly, around the token budget and the counters. Now an
    experiment key's samples (its model's saved weights, or the base model) are its experiment's: counted in its
    status, and their prompt logprobs come with them."""
    key = "sampling-verb-key-2b7e9c4d"
    assert _call(server, "POST", "/v1/experiments", ADMIN_KEY, _experiment("walls-sampling", key))[0] == 201
    try:
        def sample_both() -> tuple:
            with tinker.ServiceClient(base_url=server.url, api_key=f"tml-{key}") as tenant:
                training = tenant.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result()
                own = training.save_weights_and_get_sampling_client().result().sample(
                    types.ModelInput.from_ints([5, 6, 7, 8]), 3, types.SamplingParams(max_tokens=2),
                    include_prompt_logprobs=True).result()
                base = tenant.create_sampling_client(base_model=str(tiny_model_dir)).result().sample(
                    types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=2)).result()
                return own, base

        async with AsyncClient(server.url, key) as client:
            before = (await client.status("walls-sampling")).counters
            own, base = await asyncio.to_thread(sample_both)
            after = (await client.status("walls-sampling")).counters
        assert len(own.sequences) == 3 and len(base.sequences) == 2
        assert own.prompt_logprobs[0] is None and len(own.prompt_logprobs) == 4
        assert after.completions_sampled - before.completions_sampled == 5
        sampled_tokens = sum(len(s.tokens) for s in own.sequences + base.sequences)
        assert after.tokens_sampled - before.tokens_sampled == sampled_tokens
    finally:
        assert _call(server, "DELETE", "/v1/experiments/walls-sampling", ADMIN_KEY)[0] == 204


async def test_the_body_pool_gives_each_key_one_slot_and_refuses_a_flood():
    """One key's bodies decode one at a time, so another key's body goes ahead of its flood; past MAX_WAITING a
    key's next body is a 429 at once."""
    from grpo_server.api.body_pool import BodyPool
    from grpo_server.protocol.errors import TooManyRequests

    pool = BodyPool(threads=2, max_waiting=3)
    gate, order = threading.Event(), []

    def slow(tag: str):
        def run():
            gate.wait(10)
            order.append(tag)
            return tag
        return run

    flood = [asyncio.create_task(pool.run("flooder", slow(f"f{i}"))) for i in range(3)]
    await asyncio.sleep(0.05)
    with pytest.raises(TooManyRequests) as refused:
        await pool.run("flooder", slow("f3"))
    assert refused.value.code == "too_many_bodies"
    other = asyncio.create_task(pool.run("other", lambda: order.append("other") or "other"))
    assert await asyncio.wait_for(other, 5) == "other"  # the second thread: not behind the flood
    gate.set()
    assert await asyncio.gather(*flood) == ["f0", "f1", "f2"]
    assert order[0] == "other" and pool.waiting("flooder") == 0
    pool.close()


async def test_an_admins_pause_holds_the_tinker_calls_too(server, tiny_model_dir):
    """A pause held native sampling and batches, while the same experiment's Tinker client went on sampling and
    training. Now every verb that samples or trains answers 503 experiment_paused (the SDK surfaces it from the
    call's future), and works again once unpaused."""
    key = "paused-tinker-key-5a6b7c8d"
    name = "walls-paused"
    assert _call(server, "POST", "/v1/experiments", ADMIN_KEY, _experiment(name, key))[0] == 201
    tenant = tinker.ServiceClient(base_url=server.url, api_key=f"tml-{key}")
    try:
        training = await asyncio.to_thread(
            lambda: tenant.create_lora_training_client(base_model=str(tiny_model_dir), rank=RANK).result())
        tokens = [5, 6, 7, 8, 9]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        sampler = await asyncio.to_thread(lambda: training.save_weights_and_get_sampling_client().result())
        async with AsyncClient(server.url, ADMIN_KEY) as admin:
            assert (await admin.pause_experiment(name)).paused
            calls = {
                "forward_backward": lambda: training.forward_backward([datum], "cross_entropy").result(),
                "optim_step": lambda: training.optim_step(types.AdamParams(learning_rate=1e-3)).result(),
                "sample": lambda: sampler.sample(types.ModelInput.from_ints(tokens), 1,
                                                 types.SamplingParams(max_tokens=2)).result(),
                "save_weights_for_sampler": lambda: training.save_weights_for_sampler(name="held").result(),
            }
            for verb, call in calls.items():
                with pytest.raises(Exception) as refused:
                    await asyncio.to_thread(call)
                assert "experiment_paused" in str(refused.value) or "paused by an admin" in str(refused.value), \
                    (verb, refused.value)
            status = await admin.status(name)
            assert status.step == 0 and status.counters.completions_sampled == 0
            assert not (await admin.unpause_experiment(name)).paused
        await asyncio.to_thread(calls["forward_backward"])
        await asyncio.to_thread(calls["optim_step"])
        assert len((await asyncio.to_thread(calls["sample"])).sequences) == 1
    finally:
        await asyncio.to_thread(tenant.close, "success")
        assert _call(server, "DELETE", f"/v1/experiments/{name}", ADMIN_KEY)[0] == 204
