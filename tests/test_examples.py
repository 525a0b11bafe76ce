"""The example tasks' prompts and rewards (the client side of the demo)."""

import random

from examples import alphabetize, arithmetic_agent, uppercase


def test_alphabetize_prompt_has_3_to_6_distinct_words():
    rng = random.Random(0)
    for _ in range(50):
        messages, words = alphabetize.make_prompt(rng)
        assert 3 <= len(words) <= 6 and len(set(words)) == len(words)
        assert all(w in messages[0]["content"] for w in words)


def test_alphabetize_reward_partial_credit():
    words = ["cherry", "apple", "banana"]
    assert alphabetize.score("apple\nbanana\ncherry", words) == 1.0
    assert alphabetize.score("apple\nbanana\ncherry\nThat's it!", words) < 1.0  # nothing else allowed
    reversed_answer = alphabetize.score("cherry\nbanana\napple", words)
    assert 0 < reversed_answer < alphabetize.score("apple, banana, cherry", words) < 1.0
    assert alphabetize.score("I like fruit.", words) == 0.0


def test_uppercase_reward_partial_credit():
    assert uppercase.score("GOOSE", "goose") == 1.0
    assert uppercase.score("goose", "goose") < uppercase.score("Goose", "goose") < uppercase.score("GOOSE!", "goose")
    assert uppercase.score("The word is GOOSE", "goose") < uppercase.score("GOOSE", "goose")
    assert uppercase.score("duck", "goose") == 0.0


def test_arithmetic_agent_reward():
    assert arithmetic_agent.score("12", 12) == 1.0
    assert arithmetic_agent.score("12.", 12) == 1.0
    assert arithmetic_agent.score("The answer is 12", 12) == 0.8
    assert arithmetic_agent.score("5 + 7 is 12", 12) == 0.5
    assert arithmetic_agent.score("13", 12) == 0.0
    assert arithmetic_agent.score("twelve", 12) == 0.0


async def test_arithmetic_agent_episode_rates_both_steps(client):
    """One real episode against the tiny-model server: two groups, the second continuing the first."""
    name = "agent-episode"
    await client.create_experiment({"name": name, "sampling": {"n": 2, "max_tokens": 4}})
    rows = await arithmetic_agent.episode(client, name, random.Random(0))
    assert [r["turn"] for r in rows] == [1, 2] and all(0.0 <= r["reward"] <= 1.0 for r in rows)
    status = await client.status(name)
    assert status.counters.groups_sampled == 2 and status.counters.groups_received == 2
    await client.delete_experiment(name)
