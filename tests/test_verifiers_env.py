"""examples/verifiers_env.py on verifiers 0.4.0: verifiers' own rollouts (`SingleAgentEnv.run_episode`, its
interception and eval client on the server's /v1) as episodes of the real server on the tiny model, scored by
the taskset's `@vf.reward`s and rated as one group.

verifiers 0.4.0 wants openai<3 and the dev tools openai 3.57, so it lives in its own environment,
.venv-verifiers (scripts/setup makes it); the group runs there, as a subprocess (tests/verifiers_group.py),
against the server this test session started. The rewards are plain functions, checked here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from examples import verifiers_env

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"


def test_rewards():
    assert verifiers_env.right_word("Apple.", "apple", "zebra") == 1.0
    assert verifiers_env.right_word("apple comes before zebra", "apple", "zebra") == 0.3
    assert verifiers_env.right_word("zebra, then apple", "apple", "zebra") == 0.0
    assert verifiers_env.right_word("I do not know", "apple", "zebra") == 0.0
    assert verifiers_env.one_word("apple") == 1.0
    assert 0 < verifiers_env.one_word("it is apple") < 1.0
    assert verifiers_env.one_word("") == 0.0
    rows = verifiers_env.word_pairs()
    assert len(rows) == verifiers_env.DATASET_SIZE and rows == verifiers_env.word_pairs()  # the same every run
    assert all(r["answer"] < r["other"] and r["answer"] in r["question"] for r in rows)


def test_verifiers_venv_has_its_pins():
    """.venv-verifiers holds exactly the `verifiers` extra's verifiers and a consistent set (pip check)."""
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/setup (it makes the verifiers client environment)")
    version = subprocess.run([str(VENV_PYTHON), "-c", "import verifiers; print(verifiers.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "0.4.0"
    check = subprocess.run([str(VENV_PYTHON), "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


async def test_one_group_of_rollouts_is_recorded_and_rated(server, client, tokenizer):
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run scripts/setup (it makes the verifiers client environment)")
    name = "verifiers-env-test"
    await client.create_experiment({"name": name, "sampling": {"n": 4, "max_tokens": 4}})
    try:
        proc = subprocess.run(
            [str(VENV_PYTHON), str(ROOT / "tests" / "verifiers_group.py"), server.url, name, "4", "4"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={**os.environ, verifiers_env.API_KEY_VAR: server.api_key})
        assert proc.returncode == 0, proc.stderr[-4000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["verifiers"] == "0.4.0" and out["env"] == "SingleAgentEnv"
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": out["prompt"]}],
                                                   add_generation_prompt=True, tokenize=True)["input_ids"]
        rewards = out["rewards"]
        assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)
        for trace, reward in zip(out["traces"], rewards):
            assert trace["ok"] and trace["turns"] == 1 and trace["reward"] == reward
            # verifiers' weighted sum of the taskset's rewards, each the example's plain function of the reply
            assert trace["rewards"] == {
                "right_word": {"score": verifiers_env.right_word(trace["reply"], out["answer"], out["other"]),
                               "weight": verifiers_env.WEIGHTS["right_word"]},
                "one_word": {"score": verifiers_env.one_word(trace["reply"]),
                             "weight": verifiers_env.WEIGHTS["one_word"]}}
            # what verifiers sent upstream: the experiment as the model, the rollout's sampling (a call the
            # server pushed back, 429, is in `calls` with its error, and the harness's SDK asked again)
            (call,) = [c for c in trace["calls"] if c["error"] is None]
            assert call["model"] == name and call["endpoint"] == "/chat/completions"
            assert call["sampling"]["max_tokens"] == 4 and call["sampling"]["n"] == 1
            # the server's vLLM token fields, through verifiers' relay to the harness
            tokens = trace["tokens"]
            assert tokens["prompt_ids"] == prompt_ids
            assert 1 <= len(tokens["completion_ids"]) <= 4
            assert len(tokens["completion_logprobs"]) == len(tokens["completion_ids"])
            assert all(lp <= 0 for lp in tokens["completion_logprobs"])
        counters = (await client.status(name)).counters
        assert (counters.episodes_started, counters.episode_turns, counters.episodes_rated) == (4, 4, 4)
    finally:
        await client.delete_experiment(name)
