import time

import pytest

from grpo_server.errors import Conflict, NotFound
from grpo_server.groups import Group, GroupStore
from grpo_server.wire import Completion


def make_group(store, experiment="a", created_at=0.0):
    completion = Completion(text="x", token_ids=[5], logprobs=[-0.1], finish_reason="length")
    group = Group(group_id=store.new_id(), experiment=experiment, prompt_token_ids=[1], completions=[completion],
                  policy_version=0, temperature=1.0, max_tokens=4, created_at=created_at)
    store.add(group)
    return group


def test_feedback_once_then_409():
    store = GroupStore(ttl_s=10)
    group = make_group(store)
    assert store.peek("a", group.group_id) is group  # peeking does not consume
    assert store.take("a", group.group_id) is group
    with pytest.raises(Conflict):
        store.take("a", group.group_id)
    with pytest.raises(NotFound):
        store.take("a", "grp_nope")


def test_other_experiments_groups_are_not_found():
    store = GroupStore(ttl_s=10)
    group = make_group(store, experiment="a")
    with pytest.raises(NotFound):
        store.take("b", group.group_id)


def test_expiry_counts_per_experiment_and_frees_memory():
    store = GroupStore(ttl_s=10)
    old_a, old_b = make_group(store, "a", 0.0), make_group(store, "b", 1.0)
    young = make_group(store, "a", 8.0)
    assert store.expire(now=12.0) == {"a": 1, "b": 1}
    assert store.pending_count("a") == 1 and store.pending_count("b") == 0
    with pytest.raises(NotFound):
        store.take("a", old_a.group_id)
    assert store.take("a", young.group_id) is young
    assert store.expire(now=time.monotonic() + 11) == {}
    with pytest.raises(NotFound):  # consumed ids are forgotten after a TTL too
        store.take("a", young.group_id)
