"""The example tasks' prompts and rewards (the client side of the demo)."""

import random

from examples import alphabetize, uppercase


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
