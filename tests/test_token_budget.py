"""grpo_server/runtime/token_budget.py and the stores' token counts it reads: every way a group or an episode
enters or leaves its store moves the count by its tokens, and the budget answers 429 token_budget past either
bound, reservations included. (tests/test_budgets.py floods a real server.)"""

from __future__ import annotations

import pytest

from grpo_server.protocol.errors import TooManyRequests
from grpo_server.protocol.wire import Completion
from grpo_server.runtime.episodes import EpisodeStore
from grpo_server.runtime.groups import Group, GroupStore
from grpo_server.runtime.token_budget import TokenBudget


def group(group_id: str, experiment: str = "a", prompt: int = 3, lengths: tuple[int, ...] = (2, 5)) -> Group:
    completions = [Completion(text="x", token_ids=[7] * n, logprobs=[-0.1] * n, finish_reason="stop")
                   for n in lengths]
    return Group(group_id=group_id, experiment=experiment, prompt_token_ids=[1] * prompt, completions=completions,
                 policy_version=0, temperature=1.0, max_tokens=8, created_at=0.0)


def test_group_store_counts_tokens_through_every_change():
    store = GroupStore(ttl_s=10)
    store.add(group("g1"))  # 3 + 2 + 5
    store.add(group("g2", lengths=(1,)))
    store.add(group("g3", experiment="b"))
    assert (store.tokens("a"), store.tokens("b"), store.tokens()) == (14, 10, 24)
    taken = store.take("a", "g1")
    assert store.tokens("a") == 4
    store.put_back(taken)
    assert store.tokens("a") == 14
    assert store.discard("a", "g2") and store.tokens("a") == 10
    assert store.expire(now=100.0) == {"a": 1, "b": 1} and store.tokens() == 0
    store.add(group("g4", experiment="b"))
    store.drop_experiment("b")
    assert store.tokens("b") == 0 and store.tokens() == 0


def test_episode_store_counts_each_turn_and_forgets_on_take_and_expiry():
    store = EpisodeStore(ttl_s=10)
    episode = store.open("a", "e1", max_pending=4, max_turns=4)
    episode.add_turn([1, 2, 3], Completion(text="x", token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="stop"),
                     0, None, (1.0, 1.0))
    store.done(episode)
    assert store.tokens("a") == 5 == episode.tokens
    store.undo_turn("a", "e1")  # its only turn undone: the episode goes
    assert store.tokens("a") == 0
    episode = store.open("a", "e2", max_pending=4, max_turns=4)
    episode.add_turn([1], Completion(text="x", token_ids=[5], logprobs=[-1.0], finish_reason="stop"), 0, None,
                     (1.0, 1.0))
    store.done(episode)
    taken = store.take("a", ["e2"])
    assert store.tokens() == 0
    store.put_back("a", taken)
    assert store.tokens("a") == 2
    assert store.expire(now=episode.touched_at + 11) == {"a": 1} and store.tokens() == 0


def test_the_budget_refuses_past_either_bound_and_reservations_count_until_they_end():
    held = {"a": 50, "b": 20}
    budget = TokenBudget(per_experiment=100, total=120, held=lambda name: sum(held.values()) if name is None
                         else held.get(name, 0))
    budget.check("a", 50)  # exactly at the experiment's bound
    with pytest.raises(TooManyRequests) as over:
        budget.check("a", 51)
    assert over.value.code == "token_budget" and over.value.retry_after > 0 and "max_held_tokens_per_experiment" in \
        over.value.message
    with budget.reserve("b", 40):
        assert budget.in_use("b") == 60 and budget.in_use() == 110
        with pytest.raises(TooManyRequests) as server_full:  # b's own bound has room; the server's has not
            budget.check("b", 11)
        assert "max_held_tokens (" in server_full.value.message
    assert budget.in_use("b") == 20 and budget.in_use() == 70
    with pytest.raises(TooManyRequests):
        with budget.reserve("a", 60):
            pass
    assert budget.in_use("a") == 50  # a refused reservation holds nothing
