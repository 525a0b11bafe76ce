"""Issue 57's holes in the Tinker door, tried from outside as a tenant with an ordinary key would, on the shared
real server (tiny model, HTTP on loopback), with raw HTTP and the SDK's own protobuf classes:
- a small forward_backward body of many CSR tensors is refused from its shapes, before any list is built (it made
  the front end build 12.5 GiB);
- counts (datums, chunks, loss inputs) are bounded;
- a forward_backward naming another key's model is answered before its body is decoded;
- sampler-weight names are labels; AdamW values and ttl_seconds no optimizer or date takes are the client's 4xx;
- one key's asample calls hold at most tinker_max_samples_per_key sequences;
- a delete cancels the name's Tinker calls still queued, so none lands on the next life of the name."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import time
from pathlib import Path

import aiohttp
import pytest

tinker = pytest.importorskip("tinker")
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from tests.serving import ADMIN_KEY  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
RANK = 8
PROTO = "application/x-protobuf"
BASE_MODEL: list[str] = []  # the tiny model's folder, as the server names its base model (`base`)


@pytest.fixture(autouse=True)
def base(tiny_model_dir):
    BASE_MODEL[:] = [str(tiny_model_dir)]


def _headers(key: str) -> dict[str, str]:
    return {"X-API-Key": f"tml-{key}", "Authorization": f"Bearer {key}"}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _tokens(values: list[int]) -> pb.Chunk:
    return pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack(f"<{len(values)}i", *values)))


def _dense(values: list[float]) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[len(values)], dense=struct.pack(f"<{len(values)}f", *values))


def _empty_csr(rows: int, cols: int) -> pb.Tensor:
    """A CSR tensor of `rows` x `cols` with no values: a few bytes on the wire, rows x cols values dense."""
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[rows, cols], sparse_csr=pb.SparseCsr(
        values=b"", crow_indices=struct.pack(f"<{rows + 1}q", *([0] * (rows + 1))), col_indices=b""))


def _body(model_id: str, datums: list[pb.Datum], seq_id: int | None = None) -> bytes:
    request = pb.ForwardBackwardRequest(model_id=model_id, data=datums, loss_fn="cross_entropy")
    if seq_id is not None:
        request.seq_id = seq_id
    return request.SerializeToString()


def _datum(n: int = 3) -> pb.Datum:
    targets = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[n], dense=struct.pack(f"<{n}q", *range(5, 5 + n)))
    return pb.Datum(model_input=[_tokens(list(range(10, 10 + n)))],
                    loss_fn_inputs={"target_tokens": targets, "weights": _dense([1.0] * n)})


class Tenant:
    """One experiment with its own key, and a Tinker model of it made through the SDK."""

    def __init__(self, server, name: str, key: str):
        self.server, self.name, self.key = server, name, key

    async def __aenter__(self) -> "Tenant":
        self.http = aiohttp.ClientSession(base_url=self.server.url)
        try:
            return await self._create()
        except BaseException:
            await self.__aexit__()
            raise

    async def _create(self) -> "Tenant":
        async with self.http.post("/v1/experiments", headers=_headers(ADMIN_KEY), json={
                "name": self.name, "api_key": self.key, "lora": {"r": RANK},
                "sampling": {"n": 2, "max_tokens": 4}}) as answer:
            assert answer.status == 201, await answer.text()
        session = await self.call("/api/v1/create_session", {"tags": [], "sdk_version": "0.38.0"})
        self.session_id = session["session_id"]
        created = await self.call("/api/v1/create_model", {"session_id": self.session_id, "model_seq_id": 0,
                                                           "base_model": BASE_MODEL[0], "lora_config": {"rank": RANK}})
        self.model_id = (await self.outcome(created["request_id"]))["model_id"]
        return self

    async def __aexit__(self, *exc) -> None:
        async with self.http.delete(f"/v1/experiments/{self.name}", headers=_headers(ADMIN_KEY)) as answer:
            assert answer.status in (204, 404)
        await self.http.close()

    async def post(self, path: str, body: dict | bytes, key: str | None = None) -> tuple[int, dict, float]:
        started = time.monotonic()
        kwargs = {"data": body, "headers": {**_headers(key or self.key), "Content-Type": PROTO}} \
            if isinstance(body, bytes) else {"json": body, "headers": _headers(key or self.key)}
        async with self.http.post(path, **kwargs) as answer:
            return answer.status, json.loads(await answer.read() or b"{}"), time.monotonic() - started

    async def call(self, path: str, body: dict | bytes) -> dict:
        status, answer, _ = await self.post(path, body)
        assert status == 200, (status, answer)
        return answer

    async def outcome(self, request_id: str, timeout_s: float = 120) -> dict:
        """A future's JSON result, or its failure ({"error", "category"}); a protobuf result as {"protobuf": n}."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            async with self.http.post("/api/v1/retrieve_future", json={"request_id": request_id},
                                      headers=_headers(self.key)) as answer:
                if answer.status == 408:
                    continue
                assert answer.status == 200, (answer.status, await answer.text())
                if answer.content_type == PROTO:
                    return {"protobuf": len(await answer.read())}
                return await answer.json()
        raise AssertionError(f"future {request_id} did not finish in {timeout_s} s")


async def test_a_small_body_of_csr_tensors_is_refused_before_anything_is_built(server):
    """Sixteen empty 16 x 2^20 CSR tensors: ~3 KB on the wire, 268M values dense. Before: each passed the
    per-tensor bound, and the front end built them (12.5 GiB for a 16 KB body). Now the decoder stops at the first
    datum over the call's bounds: a 422 at once."""
    async with Tenant(server, "bounds-csr", "bounds-csr-key-0a1b2c3d") as tenant:
        before = _rss_mib(server.process.pid)
        datum = pb.Datum(model_input=[_tokens([1, 2, 3])],
                         loss_fn_inputs={f"input{i}": _empty_csr(16, 2**20) for i in range(16)})
        body = _body(tenant.model_id, [datum])
        assert len(body) < 16 * 1024
        status, answer, took = await tenant.post("/api/v1/forward_backward", body)
        assert status == 422 and answer["error"]["code"] == "over_limit", answer
        assert "split the batch" in answer["error"]["message"]
        grew = _rss_mib(server.process.pid) - before
        assert grew < 100, f"the front end grew {grew:.0f} MiB for a {len(body)}-byte body"
        # A call within the bounds still trains.
        status, answer, _ = await tenant.post("/api/v1/forward_backward", _body(tenant.model_id, [_datum()]))
        assert "protobuf" in await tenant.outcome(answer["request_id"])


@pytest.mark.parametrize("what, datum, count, status, code", [
    ("datums", _datum(), 1025, 422, "over_limit"),
    ("chunks", pb.Datum(model_input=[_tokens([1])] * 1025), 1, 400, "malformed_body"),
    ("loss inputs", pb.Datum(model_input=[_tokens([1])], loss_fn_inputs={f"x{i}": _dense([1.0]) for i in range(17)}),
     1, 400, "malformed_body"),
    ("token positions", pb.Datum(model_input=[_tokens(list(range(1, 1025)))] * 65), 1, 422, "over_limit"),
])
async def test_counts_in_a_forward_backward_are_bounded(server, what, datum, count, status, code):
    async with Tenant(server, "bounds-counts", "bounds-counts-key-4e5f6a7b") as tenant:
        got, answer, _ = await tenant.post("/api/v1/forward_backward", _body(tenant.model_id, [datum] * count))
        assert (got, answer["error"]["code"]) == (status, code), (what, got, answer)
        assert "at most" in answer["error"]["message"], answer


async def test_decoded_calls_waiting_in_a_lane_are_bounded_per_key(server):
    """A forward_backward waits in its model's seq_id lane decoded, at full size: one key's waiting calls hold at
    most 4 x tinker_max_tokens_per_call token positions (429 too_many_tokens_queued beyond, at once), and a
    refused call's result keeps no decoded request. The calls wait behind a gap in their seq_ids (2 never comes),
    and the delete at the end cancels them."""
    async with Tenant(server, "bounds-queued", "bounds-queued-key-6c7d8e9f") as tenant:
        status, first, _ = await tenant.post("/api/v1/forward_backward", _body(tenant.model_id, [_datum()], 1))
        assert "protobuf" in await tenant.outcome(first["request_id"])
        before = _rss_mib(server.process.pid)
        full = [pb.Datum(model_input=[_tokens(list(range(1, 1025)))] * 16)] * 4  # 65,536 positions: a whole call
        answers = [await tenant.post("/api/v1/forward_backward", _body(tenant.model_id, full, seq_id))
                   for seq_id in range(3, 9)]
        statuses = [status for status, _, _ in answers]
        assert statuses == [200] * 4 + [429] * 2, [(s, a) for s, a, _ in answers]
        assert all(a["error"]["code"] == "too_many_tokens_queued" for s, a, _ in answers if s == 429)
        grew = _rss_mib(server.process.pid) - before
        assert grew < 200, f"the front end grew {grew:.0f} MiB holding four whole calls"


async def test_another_keys_model_is_answered_before_the_body_is_decoded(server):
    """A forward_backward of ~6 MiB (1,024 datums of 256 chunks and 16 loss inputs: 2.5 s to decode here) naming a
    model the key does not own: the route table answers 404 model_not_found from a peek at the body, before any
    decoding (it decoded first, then failed the call's future)."""
    async with Tenant(server, "bounds-owner", "bounds-owner-key-8c9d0e1f") as owner, \
            Tenant(server, "bounds-other", "bounds-other-key-2a3b4c5d") as other:
        heavy = pb.Datum(model_input=[_tokens([1, 2, 3, 4])] * 256,
                         loss_fn_inputs={f"x{i}": _dense([1.0] * 4) for i in range(16)})
        body = _body(owner.model_id, [heavy] * 1024)
        assert len(body) > 5 * 2**20
        status, answer, took = await other.post("/api/v1/forward_backward", body)
        assert status == 404 and answer["error"]["code"] == "model_not_found", (status, answer)
        assert took < 1.0, f"answered after {took:.2f} s: the body was decoded first"


@pytest.mark.parametrize("path, body, code", [
    ("/api/v1/save_weights_for_sampler", {"path": "../../etc"}, "invalid_request"),
    ("/api/v1/save_weights_for_sampler", {"path": "x" * 200}, "invalid_request"),
    ("/api/v1/save_weights", {"path": "a/b"}, "invalid_request"),
    ("/api/v1/save_weights", {"path": "ok", "ttl_seconds": 10**30}, "invalid_request"),
    ("/api/v1/optim_step", {"adam_params": {"learning_rate": 1e308 * 10}}, "invalid_request"),
    ("/api/v1/optim_step", {"adam_params": {"beta1": 1.5}}, "invalid_request"),
])
async def test_names_adam_values_and_ttls_out_of_range_are_the_clients_4xx(server, path, body, code):
    async with Tenant(server, "bounds-labels", "bounds-labels-key-6e7f8a9b") as tenant:
        raw = json.dumps({"model_id": tenant.model_id, "seq_id": 1, **body}).replace("Infinity", "1e999")
        async with tenant.http.post(path, data=raw, headers={**_headers(tenant.key),
                                                             "Content-Type": "application/json"}) as answer:
            status, answer = answer.status, await answer.json()
        assert status == 422 and answer["error"]["code"] == code, (status, answer)


async def test_one_keys_asample_calls_hold_a_bounded_number_of_sequences(server):
    """tinker_max_samples_per_key (128): 32 calls of 64 sequences at once; those past it get 429
    too_many_samples at once, the rest are sampled."""
    async with Tenant(server, "bounds-asample", "bounds-asample-key-0c1d2e3f") as tenant:
        sampler = await tenant.call("/api/v1/create_sampling_session", {
            "session_id": tenant.session_id, "sampling_session_seq_id": 0, "base_model": None})
        body = {"sampling_session_id": sampler["sampling_session_id"], "num_samples": 64,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 4, "temperature": 1.0}}
        answers = await asyncio.gather(*(tenant.post("/api/v1/asample", {**body, "seq_id": i}) for i in range(32)))
        refused = [a for s, a, _ in answers if s == 429]
        admitted = [a for s, a, _ in answers if s == 200]
        assert refused and all(a["error"]["code"] == "too_many_samples" for a in refused), answers
        assert 0 < len(admitted) <= 128 // 64
        for answer in admitted:
            assert "protobuf" in await tenant.outcome(answer["request_id"])
        # Once they are done, the key may sample again.
        status, answer, _ = await tenant.post("/api/v1/asample", {**body, "seq_id": 99})
        assert status == 200 and "protobuf" in await tenant.outcome(answer["request_id"])


async def test_a_delete_cancels_the_names_queued_calls_so_none_reaches_its_next_life(server):
    """An admin's Tinker model (its own experiment): a forward_backward waits in the model's seq_id lane (seq_id 3
    after 1; 2 never comes) when the experiment is deleted and its name taken again. The call fails
    model_not_found at once, not after the lane's 120 s gap, and the new life of the name never trained; the
    futures of a deleted experiment's key go with it, so the new key cannot read the old tenant's results."""
    async with Tenant(server, "bounds-lives", "bounds-lives-key-4a5b6c7d") as tenant:
        admin = Tenant(server, tenant.name, ADMIN_KEY)
        admin.http = tenant.http
        admin.session_id = (await admin.call("/api/v1/create_session", {"tags": [], "sdk_version": "0.38.0"}))[
            "session_id"]
        created = await admin.call("/api/v1/create_model", {"session_id": admin.session_id, "model_seq_id": 0,
                                                            "base_model": BASE_MODEL[0], "lora_config": {"rank": RANK}})
        model_id = (await admin.outcome(created["request_id"]))["model_id"]
        name = "tinker-" + admin.session_id.removeprefix("sess-") + "-0"
        status, first, _ = await admin.post("/api/v1/forward_backward", _body(model_id, [_datum()], 1))
        assert "protobuf" in await admin.outcome(first["request_id"])
        status, waiting, _ = await admin.post("/api/v1/forward_backward", _body(model_id, [_datum()], 3))
        status, own, _ = await tenant.post("/api/v1/forward_backward", _body(tenant.model_id, [_datum()], 1))
        assert status == 200, own
        for deleted in (name, tenant.name):
            async with tenant.http.delete(f"/v1/experiments/{deleted}", headers=_headers(ADMIN_KEY)) as answer:
                assert answer.status == 204
        started = time.monotonic()
        failed = await admin.outcome(waiting["request_id"], timeout_s=60)
        assert failed["error"].startswith("model_not_found") and time.monotonic() - started < 10, failed
        next_key = "bounds-lives-next-key-8e9f0a1b"
        for made in (name, tenant.name):
            async with tenant.http.post("/v1/experiments", headers=_headers(ADMIN_KEY), json={
                    "name": made, "api_key": next_key if made == tenant.name else None,
                    "lora": {"r": RANK}}) as answer:
                assert answer.status == 201, await answer.text()
        try:
            async with tenant.http.get(f"/v1/experiments/{name}", headers=_headers(ADMIN_KEY)) as answer:
                status = await answer.json()
            assert status["step"] == 0 and status["policy_version"] == 0, status
            async with tenant.http.post("/api/v1/retrieve_future", json={"request_id": own["request_id"]},
                                        headers=_headers(next_key)) as answer:
                assert answer.status == 410, await answer.text()  # the old key's result is not the new one's
        finally:
            async with tenant.http.delete(f"/v1/experiments/{name}", headers=_headers(ADMIN_KEY)) as answer:
                assert answer.status == 204
