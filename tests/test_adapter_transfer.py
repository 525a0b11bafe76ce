"""Adapter versions over HTTP (grpo_server/protocol/adapter_files.py): the learner's file route, the sampler's
copies (sampler/adapter_copies.py), and bad input failing fast with a clear error. No model: a version is
two small files, served by the learner's real route on a loopback port."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from grpo_server.protocol.adapter_files import (WEIGHTS_FILE, AdapterFetchFailed, VersionPruned, fetch_version,
                                                holds, read_fingerprint)
from grpo_server.protocol.dispatch import worker_app
from grpo_server.protocol.errors import BadRequest, NotFound
from grpo_server.protocol.wire import AdapterRef, LoadAdapterRequest
from grpo_server.protocol.worker_auth import auth_headers
from learner import adapter_io, retention
from learner.app import adapter_file_route
from sampler.adapter_copies import AdapterCopies
from tests.serving import WORKER_SECRET, free_port, serve_app

REF = AdapterRef(name="exp", version=1)
CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def write(run_dir: Path, version: int = 1, value: float = 1.0) -> Path:
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((2, 8), value)}
    return adapter_io.write_version(adapter_io.version_dir(run_dir, "exp", version), CONFIG, tensors, step=3)


@pytest.fixture
async def learner(tmp_path):
    """The learner's adapter route over run directory A; yields (run_dir, url)."""
    run_dir = tmp_path / "host-a"
    app = worker_app([], object(), 1024, secret=WORKER_SECRET)  # as learner.app.create_app, without the verbs
    app.add_routes([adapter_file_route(run_dir)])
    runner, url = await serve_app(app)
    yield run_dir, url
    await runner.cleanup()


def test_each_written_version_has_its_own_fingerprint(tmp_path):
    first, second = write(tmp_path, 1), write(tmp_path, 2)
    assert read_fingerprint(first) and read_fingerprint(second)
    assert read_fingerprint(first) != read_fingerprint(second)
    assert adapter_io.read_version(first)[2] == 3  # the step rides beside it
    assert holds(first, read_fingerprint(first)) and not holds(first, read_fingerprint(second))


async def test_a_version_is_copied_whole_and_checked(learner, tmp_path):
    run_a, url = learner
    folder = write(run_a)
    dest = tmp_path / "host-b" / "copy"
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        await fetch_version(session, url, REF, dest, read_fingerprint(folder), timeout_s=30)
    for name in ("adapter_config.json", WEIGHTS_FILE):
        assert (dest / name).read_bytes() == (folder / name).read_bytes()
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".tmp")]


async def test_a_missing_version_is_a_404_naming_it(learner, tmp_path):
    run_a, url = learner
    write(run_a)
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        with pytest.raises(NotFound, match="no version 7 of 'exp'") as info:
            await fetch_version(session, url, AdapterRef(name="exp", version=7), tmp_path / "c", None, timeout_s=30)
        assert info.value.code == "version_not_found"
        async with session.get(url + "/adapters/exp/1/..%2F..%2Fsecret") as response:  # nothing but a version's files
            assert response.status == 404
    assert not (tmp_path / "c").exists()


async def test_a_pruned_version_is_a_410_and_one_never_written_a_404(learner, tmp_path):
    run_a, url = learner
    for version in (1, 2, 3):
        write(run_a, version)
    # The newest one kept, and v1 (in use); v2 goes: renamed away first, then removed, none left behind.
    assert retention.prune(run_a, "exp", keep_newest=1, in_use={1}, live_version=3) == ([1, 3], [2])
    assert sorted(p.name for p in adapter_io.adapter_root(run_a, "exp").iterdir()) == ["v000001", "v000003"]
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        with pytest.raises(VersionPruned, match="version 2 of 'exp' was pruned") as info:
            await fetch_version(session, url, AdapterRef(name="exp", version=2), tmp_path / "c", None, timeout_s=30)
        assert (info.value.status, info.value.code) == (410, "version_pruned")
        with pytest.raises(NotFound) as info:
            await fetch_version(session, url, AdapterRef(name="exp", version=4), tmp_path / "c", None, timeout_s=30)
        assert info.value.code == "version_not_found"
    # keep_newest 0 keeps everything.
    assert retention.prune(run_a, "exp", keep_newest=0, in_use=set(), live_version=3) == ([1, 3], [])


async def test_a_version_with_another_fingerprint_is_refused(learner, tmp_path):
    run_a, url = learner
    write(run_a)
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        with pytest.raises(AdapterFetchFailed, match="expected 0123"):
            await fetch_version(session, url, REF, tmp_path / "c", "0123", timeout_s=30)
    assert not (tmp_path / "c").exists()


async def test_a_cut_off_transfer_fails_clearly(tmp_path):
    """A body that ends before its Content-Length, and a whole body that holds a truncated file."""
    folder = write(tmp_path / "src")
    weights = (folder / WEIGHTS_FILE).read_bytes()

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": str(len(weights))})
        await response.prepare(request)
        await response.write(weights[: len(weights) // 2])
        request.transport.close()  # the connection drops mid-file
        return response

    async def short(request: web.Request) -> web.Response:
        if request.match_info["file"] == WEIGHTS_FILE:
            return web.Response(body=weights[:-16])
        return web.Response(body=json.dumps(CONFIG).encode())

    for handler, message in ((cut, "ClientPayloadError"), (short, "truncated")):
        app = web.Application()
        app.router.add_get("/adapters/{name}/{version}/{file}", handler)
        runner, url = await serve_app(app)
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(AdapterFetchFailed, match=message):
                    await asyncio.wait_for(fetch_version(session, url, REF, tmp_path / "c", None, timeout_s=30), 30)
        finally:
            await runner.cleanup()
        assert not (tmp_path / "c").exists()


async def test_an_unreachable_learner_fails_at_once(tmp_path):
    async with aiohttp.ClientSession() as session:
        with pytest.raises(AdapterFetchFailed, match="ClientConnectorError"):
            await asyncio.wait_for(fetch_version(session, f"http://127.0.0.1:{free_port()}", REF, tmp_path / "c",
                                                 None, timeout_s=30), 10)


async def test_the_sampler_uses_a_visible_path_and_copies_otherwise(learner, tmp_path):
    run_a, url = learner
    folder = write(run_a)
    fingerprint = read_fingerprint(folder)
    copies = AdapterCopies(tmp_path / "host-b", replica=0, learner_url=url, secret=WORKER_SECRET)
    try:
        # A shared run directory: the learner's path as is, nothing copied.
        same = LoadAdapterRequest(adapter=REF, path=str(folder), source_url=url, fingerprint=fingerprint)
        assert await copies.local_path(same) == str(folder) and not copies.root.exists()
        # Another URL than the learner the sampler was started with: refused, never fetched from.
        foreign = LoadAdapterRequest(adapter=REF, path="/nowhere/exp/v000001", source_url=f"{url}0",
                                     fingerprint=fingerprint)
        with pytest.raises(BadRequest, match="not this sampler's learner") as info:
            await copies.local_path(foreign)
        assert info.value.code == "foreign_source_url" and not copies.root.exists()
        # Not readable here: copied from the learner into this replica's own folder.
        elsewhere = LoadAdapterRequest(adapter=REF, path="/nowhere/exp/v000001", source_url=url,
                                       fingerprint=fingerprint)
        copy = Path(await copies.local_path(elsewhere))
        assert copy == copies.copy_dir(REF) and copy.is_relative_to(tmp_path / "host-b") and holds(copy, fingerprint)
        # An earlier run's folder at the same path (same shape, other weights): not taken for this version.
        stale = write(tmp_path / "old-run", value=2.0)
        moved = LoadAdapterRequest(adapter=REF, path=str(stale), source_url=url, fingerprint=fingerprint)
        assert await copies.local_path(moved) == str(copy)
        copies.forget(REF)
        assert not copy.exists()
    finally:
        await copies.close()
    # A replica (re)starting drops an earlier life's copies.
    leftover = copies.copy_dir(AdapterRef(name="exp", version=9))
    leftover.mkdir(parents=True)
    AdapterCopies(tmp_path / "host-b", replica=0, learner_url=None, secret=WORKER_SECRET)
    assert not leftover.exists()
    assert os.listdir(tmp_path / "host-b" / "adapter-copies") == []


async def test_copies_of_versions_the_engine_no_longer_holds_are_swept(learner, tmp_path):
    """The front end's unloads are best effort: a copy whose unload never arrived goes at the next load."""
    run_a, url = learner
    copies = AdapterCopies(tmp_path / "host-b", replica=0, learner_url=url, secret=WORKER_SECRET)
    try:
        requests = {}
        for version in (1, 2, 3):
            folder = write(run_a, version)
            requests[version] = LoadAdapterRequest(adapter=AdapterRef(name="exp", version=version),
                                                   path="/nowhere/exp", source_url=url,
                                                   fingerprint=read_fingerprint(folder))
            await copies.local_path(requests[version])
        async with copies.loading(requests[3]) as path:  # v3 is being loaded: kept though not loaded yet
            assert copies.sweep(loaded=["exp@v2", "other@v1"]) == ["exp@v1"]
            assert Path(path).is_dir()
        assert [p.name for p in sorted((copies.root / "exp").iterdir())] == ["v000002", "v000003"]
        assert copies.sweep(loaded=["exp@v3"]) == ["exp@v2"]
    finally:
        await copies.close()


async def test_the_adapter_files_need_the_workers_secret(learner, tmp_path):
    run_a, url = learner
    folder = write(run_a)
    for headers in ({}, auth_headers("another-secret-0123456789"), {"Authorization": "Basic eDp5"}):
        async with aiohttp.ClientSession(headers=headers) as session:
            with pytest.raises(AdapterFetchFailed, match="401") as info:
                await fetch_version(session, url, REF, tmp_path / "c", read_fingerprint(folder), timeout_s=30)
            assert "worker secret" in str(info.value)
    assert not (tmp_path / "c").exists()


def test_each_life_of_a_name_has_its_own_adapter_key_and_copy(tmp_path):
    """Issue 57: LoRA names repeated across an experiment's lives (`name@vN`), and vLLM keys prefix-cache blocks by
    LoRA name, so a new tenant of a deleted name could reuse KV computed under the old tenant's adapter. The life
    is in the key (the LoRA name on the samplers) and in a copy's folder; a key reads back as the same ref."""
    old, new = AdapterRef(name="exp", version=3, life="0a1b2c3d"), AdapterRef(name="exp", version=3, life="4e5f6a7b")
    assert old.key != new.key and {old.key, new.key} == {"exp@v3.0a1b2c3d", "exp@v3.4e5f6a7b"}
    assert AdapterRef.from_key(old.key) == old and AdapterRef.from_key("exp@v3") == AdapterRef(name="exp", version=3)
    copies = AdapterCopies(tmp_path, replica=0, learner_url=None, secret=WORKER_SECRET)
    assert copies.copy_dir(old) != copies.copy_dir(new)
    for ref in (old, new, AdapterRef(name="exp", version=4, life="4e5f6a7b")):
        copies.copy_dir(ref).mkdir(parents=True)
    assert copies.sweep(loaded=[new.key]) == ["exp@v3.0a1b2c3d", "exp@v4.4e5f6a7b"]
