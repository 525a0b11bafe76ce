"""Episodes in the front end's memory (grpo_server/runtime/episodes.py): sequences and masks, the history
recognised across turns, the store's limits, errors and expiry. The server-level tests are in
tests/test_episodes_server.py."""

from __future__ import annotations

import pytest

from grpo_server.api_models import ChatMessage
from grpo_server.protocol.errors import BadRequest, Conflict, NotFound, TooManyRequests, Unprocessable
from grpo_server.protocol.wire import Completion, ToolCall
from grpo_server.runtime.episodes import EpisodeStore, trajectory_group
from grpo_server.runtime.training import train_samples
from grpo_server.runtime.verification import probe_of


def completion(ids: list[int], text: str = "answer", **extra) -> Completion:
    return Completion(text=text, token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", **extra)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def open_turn(store: EpisodeStore, episode_id: str = "ep", experiment: str = "exp"):
    return store.open(experiment, episode_id, max_pending=8, max_turns=4)


def test_turns_that_extend_each_other_make_one_sequence_with_the_model_spans_masked_in():
    store = EpisodeStore(ttl_s=60)
    episode = open_turn(store)
    episode.add_turn([1, 2, 3], completion([10, 11]), version=3, messages=None, decoding=(1.0, 1.0))
    store.done(episode)
    episode = open_turn(store)
    episode.add_turn([1, 2, 3, 10, 11, 4, 5], completion([12]), version=4, messages=None, decoding=(1.0, 1.0))
    store.done(episode)
    [sequence] = episode.sequences
    assert sequence.prompt_token_ids == [1, 2, 3]
    assert sequence.token_ids == [10, 11, 4, 5, 12]
    assert sequence.mask == [1, 1, 0, 0, 1]
    assert sequence.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert episode.turns == 2 and episode.oldest_version == 3


def test_a_turn_that_does_not_extend_the_last_starts_a_new_sequence():
    store = EpisodeStore(ttl_s=60)
    episode = open_turn(store)
    episode.add_turn([1, 2, 3], completion([10, 11]), version=0, messages=None, decoding=(1.0, 1.0))
    store.done(episode)
    episode = open_turn(store)
    episode.add_turn([1, 2, 9], completion([12]), version=0, messages=None, decoding=(1.0, 1.0))
    assert [s.prompt_token_ids for s in episode.sequences] == [[1, 2, 3], [1, 2, 9]]
    assert [s.mask for s in episode.sequences] == [[1, 1], [1]]


def test_the_previous_turn_is_recognised_in_the_history_despite_the_framework_reformatting_it():
    store = EpisodeStore(ttl_s=60)
    episode = open_turn(store)
    first = [ChatMessage(role="system", content="Be brief."), user("2+3?")]
    call = ToolCall(id="call_1", name="add", arguments='{"a":2,"b":3}')
    episode.add_turn([1, 2], completion([10], text='<tool_call>{"name": "add"}</tool_call>', tool_calls=[call],
                                       content=None), version=0, messages=first, decoding=(1.0, 1.0))
    store.done(episode)
    echoed = ChatMessage(role="assistant", content="", tool_calls=[
        {"id": "call_1", "function": {"name": "add", "arguments": '{\n "a": 2,\n "b": 3\n}'}}])
    result = ChatMessage(role="tool", tool_call_id="call_1", content="5")
    ids, new_turns = episode.continuation(first + [echoed, result])
    assert ids == [1, 2, 10] and new_turns == [result]
    # An edited history (other arguments, or an earlier turn changed) is not a continuation.
    edited = ChatMessage(role="assistant", tool_calls=[
        {"id": "call_1", "function": {"name": "add", "arguments": '{"a": 2, "b": 4}'}}])
    assert episode.continuation(first + [edited, result]) is None
    assert episode.continuation([first[0], user("2+4?"), echoed, result]) is None
    assert episode.continuation(first) is None  # nothing new
    stray = ChatMessage(role="tool", tool_call_id="call_9", content="5")
    with pytest.raises(BadRequest) as unknown:  # the new turns answer a call the history does not hold
        episode.continuation(first + [echoed, stray])
    assert unknown.value.code == "unknown_tool_call_id"


def test_the_store_refuses_what_it_cannot_take_and_takes_nothing_on_an_error():
    store = EpisodeStore(ttl_s=60)
    episode = open_turn(store, "a")
    with pytest.raises(Conflict) as busy:
        open_turn(store, "a")
    assert busy.value.code == "episode_busy"
    episode.add_turn([1], completion([2]), version=0, messages=None, decoding=(1.0, 1.0))
    store.done(episode)
    for turn in range(3):
        store.done(open_turn(store, "a"))
        store._pending[("exp", "a")].turns += 1  # noqa: SLF001 - only the count matters here
    with pytest.raises(Unprocessable) as long:
        open_turn(store, "a")
    assert long.value.code == "episode_too_long"
    with pytest.raises(NotFound):
        store.take("exp", ["a", "nope"])
    assert store.pending_count("exp") == 1  # "a" was not taken by the failed call
    with pytest.raises(NotFound):
        store.take("other-exp", ["a"])  # another experiment's episode ids are not this one's
    store.take("exp", ["a"])
    with pytest.raises(Conflict) as rated:
        store.take("exp", ["a"])
    assert rated.value.code == "duplicate_feedback"
    with pytest.raises(Conflict):
        open_turn(store, "a")  # a rated episode takes no more turns


def test_pending_episodes_are_bounded_and_an_episode_whose_first_turn_failed_is_forgotten():
    store = EpisodeStore(ttl_s=60)
    for i in range(8):
        episode = open_turn(store, f"e{i}")
        episode.add_turn([1], completion([2]), version=0, messages=None, decoding=(1.0, 1.0))
        store.done(episode)
    with pytest.raises(TooManyRequests):
        open_turn(store, "e8")
    store.take("exp", ["e0", "e1"])
    failed = open_turn(store, "e8")
    store.done(failed)  # no turn added: the sampler failed
    assert store.pending_count("exp") == 6


def test_idle_episodes_expire_and_are_counted_but_not_while_a_turn_runs():
    store = EpisodeStore(ttl_s=10)
    idle = open_turn(store, "idle")
    idle.add_turn([1], completion([2]), version=0, messages=None, decoding=(1.0, 1.0))
    store.done(idle)
    running = open_turn(store, "running")
    assert store.expire(now=idle.touched_at + 11) == {"exp": 1}
    assert store.pending_count("exp") == 1 and running.busy
    with pytest.raises(NotFound):
        store.peek("exp", ["idle"])


def test_a_group_of_episodes_trains_each_sequence_with_its_episodes_advantage_and_mask():
    store = EpisodeStore(ttl_s=60)
    episodes = []
    for name, prompt in (("good", [1, 2]), ("bad", [1, 3])):
        episode = open_turn(store, name)
        episode.add_turn(prompt, completion([10, 11]), version=2, messages=None, decoding=(0.8, 0.9))
        store.done(episode)
        episode = open_turn(store, name)
        with pytest.raises(Unprocessable, match="top_p 0.9"):  # its turns keep one distribution
            episode.check_decoding(0.8, 1.0)
        episode.add_turn(prompt + [10, 11, 5], completion([12]), version=3, messages=None, decoding=(0.8, 0.9))
        store.done(episode)
        episodes.append(episode)
    group = trajectory_group("grp_x", "exp", store.take("exp", ["good", "bad"]))
    group.rewards, group.advantages = [1.0, 0.0], [0.7, -0.7]
    samples = train_samples([group])
    assert [s.prompt_token_ids for s in samples] == [[1, 2], [1, 3]]
    assert [s.completion_token_ids for s in samples] == [[10, 11, 5, 12]] * 2
    assert [s.loss_mask for s in samples] == [[1, 1, 0, 1]] * 2
    assert [s.advantage for s in samples] == [0.7, -0.7] and [s.reward for s in samples] == [1.0, 0.0]
    assert all(s.temperature == 0.8 and s.top_p == 0.9 and s.policy_version == 2 for s in samples)
    assert group.max_tokens == 4


def test_a_turn_its_client_never_received_is_undone():
    store = EpisodeStore(ttl_s=60)
    episode = open_turn(store)
    episode.add_turn([1, 2], completion([10]), version=0, messages=[user("hi")], decoding=(1.0, 1.0))
    store.done(episode)
    before = [(s.token_ids[:], s.mask[:]) for s in episode.sequences], episode.last_messages
    for prompt in ([1, 2, 10, 3], [7, 8]):  # extending the sequence, then starting a new one
        episode = open_turn(store)
        episode.add_turn(prompt, completion([11, 12]), version=1, messages=[user("again")], decoding=(1.0, 1.0))
        store.done(episode)
        store.undo_turn("exp", "ep")
        assert ([(s.token_ids, s.mask) for s in episode.sequences], episode.last_messages) == before
        assert episode.turns == 1 and episode.oldest_version == 0
    store.undo_turn("exp", "ep")  # only the newest turn can be undone
    assert episode.turns == 1
    lone = open_turn(store, "lone")
    lone.add_turn([1], completion([2]), version=0, messages=None, decoding=(1.0, 1.0))
    store.done(lone)
    store.undo_turn("exp", "lone")  # its only turn: the episode is gone
    assert store.pending_count("exp") == 1


def test_a_group_of_episodes_gives_the_version_check_its_probe():
    store = EpisodeStore(ttl_s=60)
    for name, prompt in (("a", [1, 2]), ("b", [1, 2]), ("c", [9])):
        episode = open_turn(store, name)
        episode.add_turn(prompt, completion([10 + len(name)]), version=0, messages=None, decoding=(0.7, 1.0))
        store.done(episode)
    group = trajectory_group("grp_p", "exp", store.take("exp", ["a", "b", "c"]))
    probe = probe_of(group)
    assert probe.prompt_token_ids == [1, 2] and probe.completions_token_ids == [[11], [11]]
    assert probe.temperature == 0.7
