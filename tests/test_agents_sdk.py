"""The OpenAI Agents SDK (`openai-agents`) on the real server, through the client's `Episode` helper: agent
runs of examples/tool_agent.py as episodes (the first turn's tool call forced with tool_choice "required",
the SDK running the tool, the next turn), their turns counted by the server, the group rated once with
`rate_episodes` (a second rating is a 409). The tiny random model writes garbage unless constrained, so only
the forced call is meaningful. And the example's reward, pure."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from examples import tool_agent
from examples.tool_agent import Turn, score
from grpo_server.client import AsyncClient, Client, Episode, GrpoServerError

CALL = ("add", '{"a": 17, "b": 25}')


# --- the reward, pure --------------------------------------------------------------------------------------


@pytest.mark.parametrize("turns, expected", [
    ([Turn(calls=[CALL]), Turn(text="17 + 25 = 42")], 1.0),  # the call, its arguments, the answer
    ([Turn(calls=[("add", '{"b": 17, "a": 25}')]), Turn(text="42")], 1.0),  # either order
    ([Turn(calls=[CALL]), Turn(text="It is 43.")], 0.6),  # a wrong answer
    ([Turn(calls=[("add", '{"a": 17, "b": 3}')]), Turn(text="20")], 0.45),  # one number right
    ([Turn(calls=[("add", '{"a": 17, "b": 17}')]), Turn(text="34")], 0.45),  # a number counts once
    ([Turn(calls=[("add", '{"a": "17", "b": 25.0}')]), Turn(text="42")], 0.85),  # a string is not 17
    ([Turn(calls=[("add", "not json")]), Turn(text="42")], 0.7),
    ([Turn(calls=[("sum", '{"a": 17, "b": 25}')])], 0.15),  # another function, no answer
    ([Turn(calls=[CALL]), Turn(calls=[CALL])], 0.6),  # still calling when the turns ran out: no answer
    ([Turn(text='<tool_call>\n{"name": "add", "arguments": {"a": 17}')], 0.1),  # a call the parser could not read
    ([Turn(text="The answer is 42.")], 0.4),  # right, without the tool
    ([Turn(text="The answer is 420.")], 0.0),
    ([], 0.0),
])
def test_score(turns, expected):
    assert score(turns, 17, 25) == pytest.approx(expected)


def test_every_reward_is_within_0_and_1():
    rewards = {score(turns, 17, 25) for turns in (
        [Turn(text="<tool_call>", calls=[CALL, CALL]), Turn(text="42 42 -42")], [Turn(text="<tool_call> 42")])}
    assert all(0.0 <= r <= 1.0 for r in rewards)


def test_episode_helper_offline():
    with Client("http://127.0.0.1:9/", "key") as client:
        episode = client.episode("exp")
        named = client.episode("exp", "task7-ep3")
    assert len(episode.id) == 32 and episode.id != client.episode("exp").id
    assert named.id == "task7-ep3" == str(named)
    assert named.headers == {"X-Episode-Id": "task7-ep3"} and named.extra_body == {"episode_id": "task7-ep3"}
    assert named.base_url == "http://127.0.0.1:9/v1" and "key" not in repr(named)
    llm = named.openai_client(max_retries=1, default_headers={"X-Other": "1"})
    assert str(llm.base_url).rstrip("/") == named.base_url and llm.api_key == "key"
    assert llm.default_headers["X-Episode-Id"] == "task7-ep3" and llm.default_headers["X-Other"] == "1"
    sync = named.openai_client(sync=True)
    assert type(sync).__name__ == "OpenAI" and sync.default_headers["X-Episode-Id"] == "task7-ep3"
    sync.close()


# --- through the server ------------------------------------------------------------------------------------


@pytest.fixture
async def agent_experiment(client: AsyncClient):
    name = f"agents-sdk-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1},
                                    "sampling": {"n": 4, "max_tokens": 24, "temperature": 1.0}})
    yield name
    await client.delete_experiment(name)


@pytest.fixture
def no_openai_traces(monkeypatch):
    """The SDK's exporter to OpenAI's tracing backend must never be asked to send anything."""
    from agents.tracing import processors

    def export(self, items):
        raise AssertionError(f"the Agents SDK tried to export {len(items)} trace items to OpenAI")

    monkeypatch.setattr(processors.BackendSpanExporter, "export", export)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


async def test_agent_runs_are_episodes_rated_once(client: AsyncClient, agent_experiment: str, no_openai_traces):
    name = agent_experiment
    before = (await client.status(name)).counters
    settings = tool_agent.sampling_settings({"sampling": {"temperature": 1.0, "max_tokens": 96}},
                                            tool_choice="required")  # room for the random model's long numbers
    episodes = [client.episode(name) for _ in range(4)]
    transcripts = await asyncio.wait_for(
        asyncio.gather(*(tool_agent.run_once(e, settings, 17, 25) for e in episodes)), timeout=120)

    for transcript in transcripts:  # the forced first turn is a call to add (unparsed only if cut at max_tokens)
        first = transcript.turns[0]
        assert first.calls[0][0] == "add" if first.calls else first.text.startswith("<tool_call>"), transcript.__dict__
    executed = [t for t in transcripts if t.tool_results]
    assert executed, [t.__dict__ for t in transcripts]
    assert all(isinstance(r, int) for t in executed for r in t.tool_results)

    turns = sum(len(t.turns) for t in transcripts)
    status = await client.status(name)
    assert status.counters.episodes_started - before.episodes_started == len(episodes)
    assert status.counters.episode_turns - before.episode_turns == turns
    assert status.pending_episodes == len(episodes)

    rewards = [score(t.turns, 17, 25) for t in transcripts]
    rewards[0] += 0.5  # a spread to train on, whatever the random model wrote
    answer = await client.rate_episodes(name, episodes, rewards)
    assert answer.accepted and answer.skipped is None, answer
    status = await client.status(name)
    assert status.counters.episodes_rated - before.episodes_rated == len(episodes)
    assert status.pending_episodes == 0

    with pytest.raises(GrpoServerError) as again:
        await client.rate_episodes(name, [e.id for e in episodes], rewards)
    assert again.value.status == 409, again.value


async def test_native_and_blocking_openai_turns_share_the_episode_helpers(server, client: AsyncClient,
                                                                         agent_experiment: str):
    """`complete(..., episode_id=Episode)` and a blocking openai client from `Episode.openai_client(sync=True)`
    are turns of their episodes too; `rate_episodes` takes Episode objects and ids alike."""
    name = agent_experiment
    native, blocking = client.episode(name), client.episode(name, f"sync-{uuid.uuid4().hex[:8]}")
    turn = await client.complete(name, messages=[{"role": "user", "content": "Hi"}], episode_id=native)
    assert turn.episode_id == native.id and turn.group_id is None and len(turn.completions) == 1

    def sync_turn(episode: Episode) -> dict:
        llm = episode.openai_client(sync=True)
        try:
            return llm.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4).model_extra
        finally:
            llm.close()

    extra = await asyncio.to_thread(sync_turn, blocking)
    assert extra["episode_id"] == blocking.id and extra["group_id"] is None

    with Client(server.url, server.api_key) as sync_client:
        answer = await asyncio.to_thread(sync_client.rate_episodes, name, [native, blocking.id], [1.0, 0.0])
    assert answer.accepted
    assert (await client.status(name)).pending_episodes == 0
