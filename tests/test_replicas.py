"""Sampler replicas as a set: requests spread over them, every version is loaded on all of them before it is
served, and a replica killed -9 is taken out of rotation (requests keep succeeding on the other), restarted
and re-synced with the live version before it serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from grpo_server.client import AsyncClient
from grpo_server.protocol.verbs import SamplerVerbs
from grpo_server.protocol.wire import GenerateRequest
from grpo_server.workers.pool import WorkerConnection, WorkerPool
from grpo_server.protocol.codec import MSGPACK, pack, unpack
from tests.serving import (TINY_KV_CACHE_GIB, adapter_versions, complete_when_admitted, free_port, start_server, stop_server,
                           train_one_version, wait_for)

# --- the balancer on its own: real HTTP, fake workers that only echo -----------------------------------


@dataclass
class Up:
    """A worker handle in a fixed state (the pool reads name, url, state, ready)."""

    name: str
    url: str
    state: str = "ready"
    last_error: str | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"


async def echo_worker(name: str, delay_s: float = 0.0, seen: list | None = None) -> tuple[web.AppRunner, str]:
    """A worker whose `generate` answers its own name (after `delay_s`, to keep requests in flight); the requests
    it got go in `seen`."""
    async def generate(request: web.Request) -> web.Response:
        body = unpack(await request.read())
        if seen is not None:
            seen.append(body)
        await asyncio.sleep(delay_s)
        completion = {"text": name, "token_ids": [], "logprobs": [], "finish_reason": "stop"}
        return web.Response(body=pack({"prompt_token_ids": [], "completions": [completion]}), content_type=MSGPACK)

    app = web.Application()
    app.add_routes([web.post("/generate", generate)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def resetting_worker() -> tuple[asyncio.Server, str]:
    """A worker that dies mid-request: it reads the request, then resets the connection (what a client
    sees when a worker is killed with its connection open)."""
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    port = free_port()
    server = await asyncio.start_server(reset, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}"


async def test_balancer_spreads_requests_and_skips_a_replica_it_cannot_reach():
    runners = []
    async with aiohttp.ClientSession() as session:
        try:
            live = []
            for name in ("a", "b"):
                runner, url = await echo_worker(name, delay_s=0.2)
                runners.append(runner)
                live.append(WorkerConnection(Up(f"sampler-{name}", url), session, 30))
            a, b = live
            dead = WorkerConnection(Up("sampler-dead", f"http://127.0.0.1:{free_port()}"), session, 30)  # nobody listens
            resetter, reset_url = await resetting_worker()
            dying = WorkerConnection(Up("sampler-dying", reset_url), session, 30)
            pool = WorkerPool([a, dead, dying, b], learner=None)

            async def one() -> str:
                async with pool.sampler() as sampler:
                    return (await sampler.transport.request(SamplerVerbs.generate, {})).completions[0].text

            # Eight at once: each goes to a replica with the fewest in flight. The dead and the dying one are
            # "ready" as far as the pool knows (nobody noticed yet), so some land on them and are sent on.
            answers = await asyncio.gather(*(one() for _ in range(8)))
            assert sorted(set(answers)) == ["a", "b"]
            health = pool.replica_health()
            assert health["sampler-dead"].requests > 0 and health["sampler-dying"].requests > 0  # tried ...
            assert health["sampler-a"].requests + health["sampler-b"].requests == 8  # ... and every request served
            assert all(h.outstanding == 0 for h in health.values())

            # One at a time, replicas with nothing in flight take turns.
            dead.process.state = dying.process.state = "restarting"
            sequential = [await one() for _ in range(4)]
            assert sorted(sequential) == ["a", "a", "b", "b"]
            resetter.close()
        finally:
            for runner in runners:
                await runner.cleanup()


async def test_each_request_carries_its_experiments_share_in_flight_as_its_priority():
    """Issue 57: the samplers served in arrival order, so one tenant's flood of sampling queued ahead of every
    other's. Each generate request now carries, as its vLLM priority, the sequences its experiment already has in
    flight (lower goes first among waiting requests): a quiet tenant's request is 0 behind a flood."""
    seen: list[dict] = []
    runner, url = await echo_worker("0", delay_s=0.2, seen=seen)
    try:
        async with aiohttp.ClientSession() as session:
            pool = WorkerPool([WorkerConnection(Up("sampler-0", url), session, 30)], learner=None)

            async def one(experiment: str, n: int) -> None:
                async with pool.sampler(experiment=experiment) as sampler:
                    await sampler.generate(GenerateRequest(prompt_token_ids=[1], n=n, max_tokens=1))

            flood = [asyncio.create_task(one("hostile", 64)) for _ in range(3)]
            await asyncio.sleep(0.05)
            await one("victim", 4)
            await asyncio.gather(*flood)
        assert sorted(r["priority"] for r in seen if r["n"] == 64) == [0, 64, 128]
        assert [r["priority"] for r in seen if r["n"] == 4] == [0]
        assert not pool.sequences_in_flight  # every request's share released
    finally:
        await runner.cleanup()


# --- two real vLLM replicas behind the real server -----------------------------------------------------


def sampler_url(run_dir: Path, replica: int) -> str:
    config = yaml.safe_load((run_dir / "config" / f"sampler-{replica}.yaml").read_text())
    return f"http://127.0.0.1:{config['port']}"


async def loaded_adapters(session: aiohttp.ClientSession, url: str) -> list[str]:
    """The replica's own answer (its internal health verb, in full to the workers' secret, which `session`
    sends), not the front end's view of it."""
    async with session.get(url + "/health") as response:
        assert response.status == 200
        return unpack(await response.read())["adapters"]


def replica_pid(server, replica: int) -> int:
    marker = f"sampler-{replica}.yaml".encode()
    for pid in server.worker_pids():
        if any(arg.endswith(marker) for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")):
            return pid
    raise LookupError(f"no process of sampler-{replica} among {server.worker_pids()}")


async def test_two_replicas_balance_load_every_version_and_survive_a_kill(tiny_model_dir, tmp_path):
    # max_queued_batches: room for 6 requests at once with batch_groups 1 (else 429s, the learner's back-pressure)
    server = start_server(tmp_path / "run", tiny_model_dir, max_queued_batches=6, sampler={
        "replicas": 2, "engine": "vllm", "kv_cache_gib": TINY_KV_CACHE_GIB, "max_num_seqs": 16, "max_lora_rank": 16})
    name = "replicas"
    try:
        async with AsyncClient(server.url, server.api_key) as client, \
                aiohttp.ClientSession(headers=server.worker_headers()) as session:
            health = await client.health()
            assert set(health.replicas) == {"sampler-0", "sampler-1"}
            assert all(r.state == "ready" for r in health.replicas.values())
            await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1, "learning_rate": 1e-2},
                                            "sampling": {"n": 2, "max_tokens": 4}})
            urls = [sampler_url(server.run_dir, i) for i in (0, 1)]

            # Completions come from both replicas.
            groups = await asyncio.gather(*(client.complete(name, prompt=f"Count to {i}") for i in range(6)))
            assert all(len(g.completions) == 2 for g in groups)
            served = {n: r.requests for n, r in (await client.health()).replicas.items()}
            assert served["sampler-0"] > 0 and served["sampler-1"] > 0, served

            # A training step and push: the new version is loaded on both replicas before it is served.
            version = await train_one_version(client, name)
            for url in urls:
                assert version in adapter_versions(await loaded_adapters(session, url), name)

            # Kill -9 replica 1: requests keep succeeding (on replica 0) until it is back.
            old_pid = replica_pid(server, 1)
            os.kill(old_pid, signal.SIGKILL)
            states_seen: list[str] = []

            async def back_in_rotation() -> bool:
                group = await complete_when_admitted(client, name, prompt="Still there?")  # a 503 fails the test
                assert len(group.completions) == 2
                states_seen.append((await client.health()).replicas["sampler-1"].state)
                return states_seen[-1] == "ready" and any(s != "ready" for s in states_seen)

            # A request every few seconds, not back to back: the restarting replica's vLLM start-up shares the
            # cores with them (with a request every 0.5 s this test took 301 s here).
            await wait_for(back_in_rotation, timeout_s=300, interval_s=4.0)
            assert {"restarting", "starting"} & set(states_seen), states_seen  # out of rotation meanwhile
            assert replica_pid(server, 1) != old_pid  # restarted ...
            served_version = (await client.status(name)).policy_version
            assert served_version in adapter_versions(await loaded_adapters(session, urls[1]), name)  # re-synced

            # Back in rotation: it takes requests again.
            before = (await client.health()).replicas["sampler-1"].requests
            await asyncio.gather(*(complete_when_admitted(client, name, prompt=f"Again {i}") for i in range(4)))
            assert (await client.health()).replicas["sampler-1"].requests > before
    finally:
        assert stop_server(server) == 0, server.log_tail()
