"""A server with tight limits, over TLS: every limit answers with its 4xx/429 and the server keeps going."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import pytest

from grpo_server.client import AsyncClient, GrpoServerError
from tests.serving import start_server, stop_server, wait_for

LIMITS = {"max_experiments": 2, "max_n": 4, "max_tokens": 8, "max_prompt_tokens": 16, "max_pending_groups": 2,
          "max_episode_turns": 2, "max_pending_episodes": 2, "max_episode_tokens": 40, "episode_ttl_s": 3}


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
