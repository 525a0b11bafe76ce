"""A server with tight limits, over TLS: every limit answers with its 4xx/429 and the server keeps going."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess

import aiohttp

import pytest

from grpo_server.client import AsyncClient, GrpoServerError
from tests.serving import start_server, stop_server, wait_for

LIMITS = {"max_experiments": 2, "max_n": 4, "max_tokens": 8, "max_prompt_tokens": 16, "max_pending_groups": 2,
          "max_episode_turns": 2, "max_pending_episodes": 2, "max_episode_tokens": 40, "episode_ttl_s": 3,
          "tinker_max_saved_per_model": 2, "max_loaded_versions": 2}


@pytest.fixture(scope="module")
def tls_server(tiny_model_dir, tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    handle = start_server(tmp_path_factory.mktemp("limits-run"), tiny_model_dir, tls_certfile=str(cert),
                          tls_keyfile=str(key), **LIMITS)
    yield handle, ssl.create_default_context(cafile=str(cert))
    assert stop_server(handle) == 0, handle.log_tail()


async def expect_error(call, status: int, code: str) -> None:
    with pytest.raises(GrpoServerError) as caught:
        await call
    assert (caught.value.status, caught.value.code) == (status, code), caught.value


async def test_limits_over_tls(tls_server):
    server, trust = tls_server
    assert server.url.startswith("https://")
    with pytest.raises(Exception):  # without trusting the certificate, the client refuses to talk
        async with AsyncClient(server.url, server.api_key, timeout_s=30) as untrusting:
            await untrusting.health()
    async with AsyncClient(server.url, server.api_key, ssl_context=trust) as client:
        assert (await client.health()).status == "ok"
        await client.create_experiment({"name": "one", "sampling": {"n": 2, "max_tokens": 2}})
        await expect_error(client.create_experiment({"name": "big", "sampling": {"n": 5}}), 422, "over_limit")
        await client.create_experiment({"name": "two", "sampling": {"n": 2, "max_tokens": 2}})
        await expect_error(client.create_experiment({"name": "three", "sampling": {"n": 2, "max_tokens": 2}}),
                           422, "over_limit")  # max_experiments
        await expect_error(client.complete("one", prompt="Hi", n=5), 422, "over_limit")
        await expect_error(client.complete("one", prompt="Hi", max_tokens=9), 422, "over_limit")
        await expect_error(client.complete("one", prompt="word " * 20), 400, "prompt_too_long")
        first = await client.complete("one", prompt="Hi")
        await client.complete("one", prompt="Hi")
        await expect_error(client.complete("one", prompt="Hi"), 429, "too_many_pending_groups")
        assert (await client.complete("two", prompt="Hi")).completions  # other experiments are not held up
        await client.feedback("one", first.group_id, [1.0, 0.0])  # feedback frees a slot
        assert (await client.complete("one", prompt="Hi")).completions
        status = await client.status("one")
        assert status.pending_groups == 2 and status.counters.groups_received == 1


async def test_episode_limits_and_expiry(tls_server):
    """Turns per episode, tokens per episode and pending episodes answer 422/429; an episode left without a
    reward expires and is counted, and its late reward is a 404. Runs after test_limits_over_tls (its
    experiments "one" and "two" exist)."""
    server, trust = tls_server
    async with AsyncClient(server.url, server.api_key, ssl_context=trust) as client:
        turn = {"prompt_token_ids": [1, 2, 3], "max_tokens": 2}
        await client.complete("two", episode_id="long", **turn)
        await client.complete("two", episode_id="long", **turn)
        await expect_error(client.complete("two", episode_id="long", **turn), 422, "episode_too_long")  # turns
        await client.complete("two", episode_id="big", prompt_token_ids=[5] * 16, max_tokens=8)
        await expect_error(client.complete("two", episode_id="big", prompt_token_ids=[6] * 16, max_tokens=8),
                           422, "episode_too_long")  # 16 + its completion held, + 16 + 8 > 40 tokens
        await expect_error(client.complete("two", episode_id="third", **turn), 429, "too_many_pending_episodes")
        status = await client.status("two")
        assert status.pending_episodes == 2
        await wait_for(lambda: _expired(client), timeout_s=30)
        with pytest.raises(GrpoServerError) as late:
            await client._request("POST", "/v1/experiments/two/feedback",  # noqa: SLF001
                                  json={"episode_ids": ["long", "big"], "rewards": [1.0, 0.0]})
        assert (late.value.status, late.value.code) == (404, "episode_not_found")
        assert (await client.complete("two", episode_id="third", **turn)).episode_id == "third"


async def _expired(client: AsyncClient) -> bool:
    return (await client.status("two")).counters.episodes_expired == 2


async def test_what_one_tinker_key_pins_is_bounded(tls_server, tiny_model_dir):
    """Issue 57, from outside: unnamed save_weights_for_sampler calls share the model's tinker_max_saved_per_model
    (2 here) with its named saves, so they cannot pin a thousand versions against pruning (the oldest unnamed
    samplers are forgotten: 404); and sampling old versions loads at most max_loaded_versions (2 here) of the
    experiment on the samplers at once (the shared adapter table), 429 `too_many_loaded_versions` beyond. Runs
    after the tests above (it replaces their experiment "one")."""
    server, trust = tls_server
    key = "tinker-bounded-key-5a6b7c8d"
    connector = aiohttp.TCPConnector(ssl=trust)
    async with AsyncClient(server.url, server.api_key, ssl_context=trust) as admin, \
            aiohttp.ClientSession(server.url, connector=connector, headers={"X-API-Key": f"tml-{key}"}) as http:
        await admin.delete_experiment("one")
        await admin.create_experiment({"name": "bounded", "api_key": key, "lora": {"r": 8},
                                       "sampling": {"n": 2, "max_tokens": 2}})

        async def call(path: str, body: dict) -> dict:
            async with http.post(path, json=body) as answer:
                assert answer.status == 200, (path, answer.status, await answer.text())
                return await answer.json()

        async def outcome(answer: dict) -> dict:
            while True:
                async with http.post("/api/v1/retrieve_future", json={"request_id": answer["request_id"]}) as got:
                    if got.status != 408:
                        assert got.status == 200
                        return await got.json() if got.content_type == "application/json" else {"sampled": True}

        session = (await call("/api/v1/create_session", {"sdk_version": "0.38.0"}))["session_id"]
        model = (await outcome(await call("/api/v1/create_model", {
            "session_id": session, "model_seq_id": 0, "base_model": str(tiny_model_dir),
            "lora_config": {"rank": 8}})))["model_id"]
        samplers = [(await outcome(await call("/api/v1/save_weights_for_sampler", {"model_id": model})))[
            "sampling_session_id"] for _ in range(4)]
        kept = []
        for sampler in samplers:
            async with http.get(f"/api/v1/samplers/{sampler}") as answer:
                kept.append(answer.status)
        assert kept == [404, 404, 200, 200], kept  # the newest two of four: the cap of 2
        await outcome(await call("/api/v1/save_weights_for_sampler", {"model_id": model, "path": "newest"}))
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
        # Two old versions at once, beside the one served: over 2 loaded. Whether two calls overlap on the server
        # is up to the scheduler (on a loaded box the first can load, sample and unload before the second is
        # read), so each round sends three calls per version, and rounds go on until one overlaps; an old
        # version is unloaded once no call uses it, so each round starts with the served version alone.
        rounds = []
        for _ in range(10):
            answers = await asyncio.gather(*(call("/api/v1/asample", {
                "sampling_session_id": sampler, "num_samples": 1, "prompt": prompt,
                "sampling_params": {"max_tokens": 2}}) for sampler in samplers[2:] * 3))
            results = [await outcome(answer) for answer in answers]
            rounds.append(results)
            refused = [r for r in results if "error" in r]
            assert all(r["error"].startswith("too_many_loaded_versions") and r["category"] == "user"
                       for r in refused), results
            assert {"sampled": True} in results, results  # the first version in is always served
            if refused:
                break
        assert refused, rounds  # without the bound, no round would refuse one
