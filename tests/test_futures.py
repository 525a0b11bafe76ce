"""grpo_server/api/tinker/futures.py on its own: calls run in seq_id order whatever order they arrive in, a gap
that stays open fails its waiter and lets the rest go on, results are owned, polled, and expire."""

from __future__ import annotations

import asyncio

import pytest

from grpo_server.protocol.errors import ApiError
from grpo_server.api.tinker.futures import FutureStore, Pending, SeqLane


async def test_calls_run_in_seq_id_order_whatever_order_they_arrive_in():
    lane, ran = SeqLane(gap_timeout_s=5), []

    async def call(seq_id: int) -> None:
        async with lane.turn(seq_id):
            ran.append(seq_id)
            await asyncio.sleep(0)

    await call(1)  # the first id names where the lane starts
    await asyncio.gather(*(call(i) for i in (5, 3, 2, 4)))
    assert ran == [1, 2, 3, 4, 5]
    with pytest.raises(ApiError) as caught:
        lane.check(3)
    assert caught.value.code == "seq_id_out_of_order"


async def test_a_gap_fails_its_waiter_and_the_lane_goes_on():
    lane, ran = SeqLane(gap_timeout_s=0.2), []
    async with lane.turn(1):
        ran.append(1)
    with pytest.raises(ApiError) as caught:
        async with lane.turn(3):  # 2 never comes
            ran.append(3)
    assert caught.value.code == "seq_id_gap"
    async with lane.turn(4):  # not another wait: the lane moved past the gap
        ran.append(4)
    assert ran == [1, 4]


async def test_results_are_polled_owned_and_expire():
    store = FutureStore(ttl_s=0.3)
    release = asyncio.Event()

    async def slow() -> str:
        await release.wait()
        return "done"

    async def failing() -> str:
        raise ApiError("no", code="bad", status=400)

    request_id = store.submit("alice", slow)
    with pytest.raises(Pending):
        await store.retrieve(request_id, "alice", wait_s=0.05)
    with pytest.raises(ApiError) as caught:  # another key's id is unknown to it
        await store.retrieve(request_id, "bob", wait_s=0.05)
    assert caught.value.code == "future_expired"
    release.set()
    assert (await store.retrieve(request_id, "alice", wait_s=1)).value == "done"
    assert (await store.retrieve(request_id, "admin", wait_s=1)).value == "done"
    failed = await store.retrieve(store.submit("alice", failing), "alice", wait_s=1)
    assert failed.error is not None and failed.error.code == "bad"
    await asyncio.sleep(0.4)
    with pytest.raises(ApiError):
        await store.retrieve(request_id, "alice", wait_s=0.05)
    await store.close()


async def test_one_owner_cannot_pile_up_results():
    store = FutureStore(max_unread_per_owner=2)

    async def quick() -> int:
        return 1

    store.submit("alice", quick)
    store.submit("alice", quick)
    with pytest.raises(ApiError) as caught:
        store.submit("alice", quick)
    assert caught.value.status == 429
    store.submit("bob", quick)  # others are not held back
    await store.close()


async def test_a_client_that_reads_its_results_is_never_held_back():
    """Issue 46: the 4097th call within an hour was refused although every result had been read. A read result
    stays for the grace of a retried poll, then goes; only unread results count, and the store stays small."""
    store = FutureStore(max_unread_per_owner=4, read_grace_s=0.2)

    async def quick() -> int:
        return 7

    for _ in range(5000):
        request_id = store.submit("alice", quick)
        assert (await store.retrieve(request_id, "alice", wait_s=1)).value == 7
    assert store.unread("alice") == 0
    assert (await store.retrieve(request_id, "alice", wait_s=1)).value == 7  # a retried poll, within the grace
    await asyncio.sleep(0.25)
    store.submit("bob", quick)  # any call drops what is past its deadline
    assert len(store) == 1
    with pytest.raises(ApiError):
        await store.retrieve(request_id, "alice", wait_s=0.05)
    await store.close()


async def test_one_key_has_a_bounded_number_of_calls_running():
    store = FutureStore(max_running_per_owner=2)
    release = asyncio.Event()

    async def held() -> int:
        await release.wait()
        return 1

    first = store.submit("alice", held)
    store.submit("alice", held)
    with pytest.raises(ApiError) as caught:
        store.submit("alice", held)
    assert caught.value.status == 429 and caught.value.code == "too_many_calls"
    store.submit("bob", held)  # others are not held back
    release.set()
    assert (await store.retrieve(first, "alice", wait_s=1)).value == 1
    store.submit("alice", held)  # finished calls free their places, read or not
    await store.close()


async def test_the_bytes_one_key_holds_in_results_are_bounded():
    """Issue 46: the store bounds the bytes held. Results count from when they finish until they go (read ones after
    their grace); a key over its bytes is refused new calls (429) until its results go, and others are not."""
    store = FutureStore(max_bytes_per_owner=1_000_000, read_grace_s=0.2)

    async def big() -> dict:
        return {"logprobs": [0.5] * 50_000}  # about 1.6 MB in Python

    first = store.submit("alice", big)
    assert (await store.retrieve(first, "alice", wait_s=1)).value["logprobs"][0] == 0.5
    assert store.held_bytes("alice") > 1_000_000  # read, but held for a retried poll
    with pytest.raises(ApiError) as caught:
        store.submit("alice", big)
    assert caught.value.status == 429 and caught.value.code == "too_many_futures"
    store.submit("bob", big)  # others are not held back
    await asyncio.sleep(0.25)  # the read result's grace passes
    again = store.submit("alice", big)
    assert store.held_bytes("alice") == 0 and (await store.retrieve(again, "alice", wait_s=1)).value
    await store.close()


def test_payload_bytes_costs_a_list_of_numbers_by_its_length():
    from grpo_server.api.tinker.futures import payload_bytes

    small, large = payload_bytes([1.0] * 10), payload_bytes([1.0] * 1_000_000)
    assert 30_000_000 <= large <= 40_000_000 and small < 1_000
    assert payload_bytes({"rows": [[1] * 1000, [2] * 10]}) > payload_bytes({"rows": [[1] * 10, [2] * 10]})
