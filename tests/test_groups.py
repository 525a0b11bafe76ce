import time

import pytest

from grpo_server.protocol.errors import Conflict, NotFound
from grpo_server.runtime.groups import Group, GroupStore
from grpo_server.protocol.wire import Completion


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


def test_pending_counts_follow_add_take_expire_and_drop():
    store = GroupStore(ttl_s=10)
    taken, _, _ = make_group(store, "a", 5.0), make_group(store, "a", 0.0), make_group(store, "b", 5.0)
    assert (store.pending_count("a"), store.pending_count("b")) == (2, 1)
    store.take("a", taken.group_id)
    assert store.pending_count("a") == 1
    store.expire(now=11.0)  # the group created at 0 expires
    assert store.pending_count("a") == 0
    store.drop_experiment("b")
    assert store.pending_count("b") == 0


def test_journal_replays_after_a_position_and_compacts(tmp_path):
    from grpo_server.runtime.journal import FeedbackJournal

    journal = FeedbackJournal(tmp_path / "j.jsonl")
    groups = [make_group(GroupStore(ttl_s=10)) for _ in range(3)]
    for group in groups:
        group.rewards, group.advantages = [1.0], [0.0]
        journal.append(group)
    assert [g.journal_seq for g in groups] == [1, 2, 3]
    journal.compact(through_seq=1)
    with open(tmp_path / "j.jsonl", "ab") as handle:
        handle.write(b'{"seq": 4, "group_id": "torn')  # a crash mid-append: that group never got its 202
    reopened = FeedbackJournal(tmp_path / "j.jsonl")
    replayed = reopened.pending(after_seq=2)
    assert [g.group_id for g in replayed] == [groups[2].group_id]
    assert replayed[0].completions == groups[2].completions and replayed[0].rewards == [1.0]
    assert reopened.last_seq == 3  # numbering continues after the torn line
    later = make_group(GroupStore(ttl_s=10))
    later.rewards, later.advantages = [0.5], [0.0]
    assert reopened.append(later) == 4
    assert [g.journal_seq for g in FeedbackJournal(tmp_path / "j.jsonl").pending(after_seq=0)] == [2, 3, 4]
