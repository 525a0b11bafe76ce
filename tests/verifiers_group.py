"""Run by tests/test_verifiers_env.py in the verifiers client environment (.venv-verifiers: verifiers 0.4.0):
one group of examples/verifiers_env.py's rollouts against a real server, rated there; prints what came back
as one JSON line. Arguments: URL EXPERIMENT SIZE MAX_TOKENS (the key in GRPO_SERVER_API_KEY)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import verifiers_env  # noqa: E402
from grpo_server.client import AsyncClient  # noqa: E402


async def main(url: str, name: str, size: int, max_tokens: int) -> dict:
    import verifiers

    env = verifiers_env.load_environment(size=8)
    task = next(iter(env.taskset))
    sampling = verifiers_env.sampling_args({"sampling": {"max_tokens": max_tokens}})
    async with AsyncClient(url, os.environ[verifiers_env.API_KEY_VAR]) as client, env.serving():
        rewards, traces = await verifiers_env.rate_group(env, client, url, name, task, size, sampling)
    return {"verifiers": verifiers.__version__, "env": type(env).__name__, "prompt": task.data.prompt,
            "answer": task.data.answer, "other": task.data.other, "rewards": rewards,
            "traces": [{"ok": t.ok, "reward": t.reward, "reply": t.last_reply, "turns": t.num_turns,
                        "rewards": {k: r.model_dump() for k, r in t.rewards.items()},
                        "calls": [c.model_dump(mode="json", include={"model", "sampling", "endpoint", "error"})
                                  for c in t.calls],
                        "tokens": t.info["tokens"]} for t in traces]}


if __name__ == "__main__":
    url, name, size, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(asyncio.run(main(url, name, size, max_tokens))))
