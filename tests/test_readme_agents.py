"""The agents guide's code runs as written (docs/guides/agents.md, once the README's Agents section): its first
block (an Agents SDK agent per episode, rated as a group) and its streaming block, against the real server on the
tiny model."""

from __future__ import annotations

import re
import textwrap
import uuid
from pathlib import Path

from grpo_server.client import AsyncClient

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "agents.md"


def agents_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)


async def test_the_readme_agent_block_runs_a_group_of_episodes(server):
    name = f"readme-{uuid.uuid4().hex[:6]}"
    async with AsyncClient(server.url, server.api_key) as grpo:
        await grpo.create_experiment({"name": name, "sampling": {"max_tokens": 8, "temperature": 1.0}})
        try:
            code = agents_blocks()[0].replace('"calc"', repr(name))
            scope: dict = {}
            exec(compile(code, "docs/guides/agents.md", "exec"), scope)  # noqa: S102 - the guide's own code
            await scope["group"](grpo, "What is 17 + 25?", 42, size=2)
            status = await grpo.status(name)
            assert status.counters.episodes_started == 2 and status.counters.episodes_rated == 2, status
        finally:
            await grpo.delete_experiment(name)


async def test_the_readme_streaming_block_runs(server):
    name = f"readme-s-{uuid.uuid4().hex[:6]}"
    async with AsyncClient(server.url, server.api_key) as grpo:
        await grpo.create_experiment({"name": name, "sampling": {"n": 1, "max_tokens": 4}})
        try:
            from openai import AsyncOpenAI

            llm = AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key)
            body = textwrap.indent(agents_blocks()[1].replace('"calc"', repr(name)), "    ")
            scope: dict = {}
            exec(compile(f"async def run(llm, history, tools):\n{body}\n    return chunk\n", "docs/guides/agents.md", "exec"),
                 scope)  # noqa: S102
            tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
            last = await scope["run"](llm, [{"role": "user", "content": "Hi"}], tools)
            assert last.usage is not None and last.usage.completion_tokens > 0
        finally:
            await grpo.delete_experiment(name)
