"""No pickle between the learner's ranks (issue 25, item 2): a rank's checkpoint shard crosses to rank 0 as
bytes (learner/rank_transfer.py) read back as data (learner/checkpoint.py's `decode_shard`:
`torch.load(weights_only=True)` and the DeepSpeed allow-list), so bytes that would run code when unpickled
are refused. The real 2-rank job checkpoints and resumes through it: tests/test_learner_multirank.py.
"""

from __future__ import annotations

import io
import multiprocessing
import pickle
from pathlib import Path

import pytest
import torch

from learner import adapter_io, checkpoint, rank_transfer
from tests.serving import free_port
from tests.test_safe_loading import _zero_state


def _assert_same(a, b) -> None:
    """Equal to the bit, and of the same types, all the way down."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif hasattr(a, "__dict__"):  # the allow-listed DeepSpeed classes: data in their fields
        _assert_same(vars(a), vars(b))
    else:
        assert a == b or (a != a and b != b), (a, b)  # a NaN field stays a NaN


def test_a_shard_crosses_exactly():
    optimizer = _zero_state()
    optimizer["base_optimizer_state"]["state"][0]["exp_avg_bf16"] = torch.randn(5, dtype=torch.bfloat16)
    optimizer["extremes"] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])
    shard = checkpoint.RankShard(optimizer, torch.get_rng_state())
    back = checkpoint.decode_shard(checkpoint.encode_shard(shard))
    assert isinstance(back, checkpoint.RankShard)
    _assert_same(back.rng, shard.rng)
    assert set(back.optimizer) == set(shard.optimizer)
    for key in shard.optimizer:
        if key != "extremes":
            _assert_same(back.optimizer[key], shard.optimizer[key])
    # NaN != NaN: compared as bits
    assert torch.equal(back.optimizer["extremes"].view(torch.int32), optimizer["extremes"].view(torch.int32))
    torch.set_rng_state(back.rng)  # usable as it is


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the raw pickle below: refused all the same
def test_bytes_that_would_run_code_are_refused(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buffer = io.BytesIO()
    torch.save({"optimizer": {"state": Evil()}, "rng": torch.get_rng_state()}, buffer)
    for data in (buffer.getvalue(),  # torch.save's format, with a callable inside
                 pickle.dumps(checkpoint.RankShard({"x": Evil()}, torch.get_rng_state()))):  # gather_object's
        with pytest.raises(pickle.UnpicklingError):
            checkpoint.decode_shard(data)
    assert not marker.exists()


def test_other_data_is_not_a_shard():
    for value in ([1, 2], {"optimizer": {}}, {"optimizer": [], "rng": torch.zeros(1)}):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        with pytest.raises(ValueError):
            checkpoint.decode_shard(buffer.getvalue())


# --- the collectives, on two real gloo ranks ------------------------------------------------------------------

PAYLOADS = [b"", b"\x00" * 3 + bytes(range(256)) * 5, b"rank two \xff"]


def _rank(rank: int, world_size: int, port: int, results: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        gathered = rank_transfer.gather_to_first(PAYLOADS[rank], rank, world_size, None)
        scattered = rank_transfer.scatter_from_first(PAYLOADS[::-1] if rank == 0 else None, rank, world_size, None)
        empty = rank_transfer.gather_to_first(b"", rank, world_size, None)
        (results / f"rank{rank}").write_bytes(pickle.dumps((gathered, scattered, empty)))  # the test's own data
    finally:
        dist.destroy_process_group()


def test_gather_and_scatter_move_bytes_of_any_length(tmp_path):
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_rank, args=(rank, 3, port, tmp_path)) for rank in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    results = [pickle.loads((tmp_path / f"rank{rank}").read_bytes()) for rank in range(3)]
    assert results[0] == (PAYLOADS, PAYLOADS[2], [b"", b"", b""])
    assert results[1] == ([], PAYLOADS[1], [])
    assert results[2] == ([], PAYLOADS[0], [])


def test_a_resumed_experiment_crosses_to_the_other_ranks_as_data(tmp_path):
    """learner/resume.py's share of rank 0's reading: the checkpoint and the newest version exactly, rank 0's
    error as its code and message, and bytes that would run code refused."""
    from grpo_server.protocol.errors import ApiError
    from learner import resume

    state = checkpoint.CheckpointState(step=3, version=2, journal_seq=9, groups_trained=5, lora={"r": 4},
                                       algorithm={"loss": "grpo"}, ranks=2)
    weights = {"w": torch.randn(2, 3)}
    saved = adapter_io.SavedVersion({"r": 4, "target_modules": ["q_proj"]}, weights, 3, journal_seq=8,
                                    groups_trained=4)
    found = resume.OnDisk(2, saved, checkpoint.Checkpoint(state, weights, _zero_state(), torch.get_rng_state()))
    back = resume._share_from_bytes(resume._share_bytes(found))
    assert back.latest == 2 and back.saved.config == saved.config and back.saved.step == 3
    assert (back.saved.journal_seq, back.saved.groups_trained) == (8, 4)
    assert back.resumed.state == state and torch.equal(back.resumed.rng, found.resumed.rng)
    _assert_same(back.resumed.optimizer, found.resumed.optimizer)
    assert torch.equal(back.saved.tensors["w"], weights["w"]) and torch.equal(back.resumed.weights["w"], weights["w"])
    assert resume._share_from_bytes(resume._share_bytes(resume.OnDisk(None, None, None))) == resume.OnDisk(None, None,
                                                                                                             None)
    with pytest.raises(ApiError) as err:
        resume._share_from_bytes(resume._share_bytes(None, ApiError("other shape", code="adapter_mismatch",
                                                                    status=409)))
    assert (err.value.code, err.value.status, err.value.message) == ("adapter_mismatch", 409, "other shape")
    with pytest.raises(RuntimeError, match="OSError: disk gone"):
        resume._share_from_bytes(resume._share_bytes(None, OSError("disk gone")))

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buffer = io.BytesIO()
    torch.save({"error": None, "latest": Evil(), "saved": None, "resumed": None}, buffer)
    with pytest.raises(pickle.UnpicklingError):
        resume._share_from_bytes(buffer.getvalue())
    assert not marker.exists()
