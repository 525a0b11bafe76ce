"""No code runs from data (issue 25, item 2): the learner's lockstep commands cross the rendezvous store as
msgpack (learner/lockstep.py), and its checkpoints' `.pt` files load with `torch.load(weights_only=True)`
(learner/checkpoint.py). The real multi-rank job: tests/test_learner_multirank.py; a real ZeRO-2 resume:
tests/test_learner_adapters.py. Also the durable-write helpers both sides use (grpo_server/protocol/durable.py).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
import zipfile
from fractions import Fraction

import pytest
import torch

from grpo_server.protocol.durable import publish_folder, write_atomic
from grpo_server.protocol.errors import ApiError
from grpo_server.protocol.wire import AdapterRef, TrainRequest, TrainSample
from grpo_server.protocol.worker_config import AlgorithmConfig, LoraConfig
from learner import checkpoint, plain_data
from learner.lockstep import Outcome, decode_command, encode_command

BATCH = TrainRequest(name="exp", journal_seq=7, num_groups=2, max_tokens=64, samples=[
    TrainSample(prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                sampler_logprobs=[-0.1234567890123457, -math.inf], advantage=1 / 3, reward=0.1, policy_version=2, temperature=0.7, top_p=0.9, loss_mask=[1, 0]),
    TrainSample(prompt_token_ids=[1], completion_token_ids=[6], sampler_logprobs=[-2.5], advantage=-1e-30,
                reward=0.0, policy_version=1, constrained=True),
])


@pytest.mark.parametrize("verb, args", [
    ("add_experiment", ("exp", LoraConfig(r=4, alpha=8, dropout=0.05, target_modules=["q_proj"]),
                        AlgorithmConfig(loss="dapo", learning_rate=1e-3, clip_high=0.3, beta=0.05))),
    ("train", (BATCH,)),
    ("save_adapter", ("exp",)),
    ("checkpoint_all", ()),
    ("stop", ()),
])
def test_commands_cross_the_store_exactly(verb, args):
    decoded_verb, decoded = decode_command(encode_command(verb, args))
    assert decoded_verb == verb and decoded == args  # every float bit for bit, the models validated again
    assert [type(a) for a in decoded] == [type(a) for a in args]


def test_only_plain_values_and_the_protocols_models_cross():
    with pytest.raises(TypeError):
        encode_command("train", (AdapterRef(name="exp", version=1),))  # not a command's model
    marker = []

    class Evil:
        def __reduce__(self):
            return (marker.append, ("ran",))

    for data in (pickle.dumps(("train", (Evil(),))),  # what the store carried before: never unpickled now
                 b"\xc1not msgpack",
                 encode_command("train", ("x",)).replace(b"value", b"model"),  # a model name that is not one
                 encode_command("train", (BATCH,)).replace(b"journal_seq", b"journal_sex")):  # fails validation
        with pytest.raises(ValueError):
            decode_command(data)
    assert marker == []


def test_outcomes_cross_as_plain_fields():
    failed = Outcome.of(1, MemoryError("injected"))
    refused = Outcome.of(2, ApiError("exists", code="exists", status=409))
    for outcome in (Outcome(0), failed, refused):
        assert Outcome.from_wire(outcome.to_wire()) == outcome
    assert refused.api_error == ("exists", "exists", 409) and failed.failure == "MemoryError: injected"


def _zero_state() -> dict:
    """The shape of a DeepSpeed ZeRO-1/2 optimizer's state_dict(), with the classes it holds."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "loss_scaler": LossScaler(scale=1.0), "fp16_scaler": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False),
        "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
        "base_optimizer_state": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(6),
                                               "exp_avg_sq": torch.rand(6)}},
                                 "param_groups": [{"lr": 5e-5, "betas": (0.9, 0.999), "params": [0]}]},
        "single_partition_of_fp32_groups": [torch.randn(6)], "zero_stage": ZeroStageEnum.gradients,
        "group_paddings": [0], "partition_count": [1], "ds_version": "0.19.8",
        "param_slice_mappings": [{"w": fragment_address(numel=6, start=0)}],
    }


def test_a_checkpoint_loads_without_unpickling_code(tmp_path):
    state = checkpoint.CheckpointState(step=3, version=2, journal_seq=9, groups_trained=5, lora={}, algorithm={})
    optimizer, rng = _zero_state(), torch.get_rng_state()
    folder = checkpoint.write(tmp_path, "exp", state, {"w": torch.randn(2, 3)}, [checkpoint.RankShard(optimizer, rng)])
    assert not any(p.name.startswith(".tmp") for p in folder.parent.iterdir())
    back = checkpoint.read_latest(tmp_path, "exp")
    assert back.state == state and torch.equal(back.rng, rng)
    assert back.optimizer["zero_stage"] == optimizer["zero_stage"] and back.optimizer["ds_version"] == "0.19.8"
    assert vars(back.optimizer["loss_scaler"]) == vars(optimizer["loss_scaler"])
    assert vars(back.optimizer["fp16_scaler"]) == vars(optimizer["fp16_scaler"])
    assert back.optimizer["param_slice_mappings"] == optimizer["param_slice_mappings"]
    assert torch.equal(back.optimizer["base_optimizer_state"]["state"][0]["exp_avg"],
                       optimizer["base_optimizer_state"]["state"][0]["exp_avg"])

    # A file placed in the run directory that would run code when unpickled: refused, nothing ran.
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"state": Evil()}, folder / checkpoint.OPTIMIZER_FILE)
    with pytest.raises(checkpoint.CheckpointUnreadable, match=str(folder / checkpoint.OPTIMIZER_FILE)) as refused:
        checkpoint.read_latest(tmp_path, "exp")
    assert isinstance(refused.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()


def _globals_in(path) -> set[str]:
    """The globals a torch.save file's pickle names."""
    with zipfile.ZipFile(path) as archive:
        pickled = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        return torch._weights_only_unpickler.get_globals_in_pkl(io.BytesIO(archive.read(pickled)))


def test_checkpoints_hold_plain_values_only(tmp_path):
    """Issue 50: the optimizer's DeepSpeed objects are written as plain values, so the file's bytes do not
    depend on how the Python that wrote it pickles an Enum, and it reads back with no class allowed."""
    state = checkpoint.CheckpointState(step=1, version=1, journal_seq=0, groups_trained=0, lora={}, algorithm={})
    folder = checkpoint.write(tmp_path, "exp", state, {"w": torch.zeros(1)},
                              [checkpoint.RankShard(_zero_state(), torch.get_rng_state())])
    names = _globals_in(folder / checkpoint.OPTIMIZER_FILE)
    assert not any(n.startswith(("deepspeed", "builtins", "__builtin__", "enum")) for n in names), names
    torch.load(folder / checkpoint.OPTIMIZER_FILE, weights_only=True)  # no safe_globals needed
    with pytest.raises(TypeError, match="not one of its known classes"):  # never written to be unreadable
        checkpoint.write(tmp_path, "exp", state, {"w": torch.zeros(1)},
                         [checkpoint.RankShard({"odd": Fraction(1, 3)}, torch.get_rng_state())])


@pytest.mark.parametrize("python", ["3.11.2", "3.11.7"])
def test_checkpoints_written_before_read_back(tmp_path, monkeypatch, python):
    """Files written by the earlier format, which pickled the objects as they were: on CPython 3.11.7 an Enum
    member as `ZeroStageEnum(2)`, on 3.11.2 (Debian 12's, the image's) as `getattr(ZeroStageEnum, 'gradients')`."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    if python == "3.11.2":  # what Enum.__reduce_ex__ returned there
        monkeypatch.setattr(ZeroStageEnum, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self._name_)))
    state = checkpoint.CheckpointState(step=4, version=2, journal_seq=3, groups_trained=2, lora={}, algorithm={})
    folder = checkpoint.write(tmp_path, "exp", state, {"w": torch.zeros(1)},
                              [checkpoint.RankShard({}, torch.get_rng_state())])
    optimizer = _zero_state()
    torch.save(optimizer, folder / checkpoint.OPTIMIZER_FILE)  # the earlier writer: the objects as they are
    monkeypatch.undo()
    names = _globals_in(folder / checkpoint.OPTIMIZER_FILE)
    assert ("builtins.getattr" in names) == (python == "3.11.2"), names
    back = checkpoint.read_latest(tmp_path, "exp").optimizer
    assert back["zero_stage"] is ZeroStageEnum.gradients
    assert vars(back["fp16_scaler"]) == vars(optimizer["fp16_scaler"])
    assert back["param_slice_mappings"] == optimizer["param_slice_mappings"]


@pytest.mark.parametrize("target, name", [("zero_stage", "__class__"), ("zero_stage", "_value2member_map_"),
                                          ("a string", "upper"), ("loss_scaler", "__init__")])
def test_the_enum_lookup_reaches_nothing_else(tmp_path, target, name):
    """`getattr` in a file is read as an enum member's name in an allowed enum, and nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    holder = {"zero_stage": ZeroStageEnum, "a string": "abc", "loss_scaler": LossScaler}[target]

    class Reach:
        def __reduce__(self):
            return (getattr, (holder, name))

    path = tmp_path / "optimizer.pt"
    torch.save({"x": Reach()}, path)
    with pytest.raises(pickle.UnpicklingError):
        plain_data.load_data(path)


def test_durable_writes_replace_whole_and_keep_their_mode(tmp_path):
    path = tmp_path / "secret.json"
    write_atomic(path, b"old")
    write_atomic(path, b"new", mode=0o600)
    assert path.read_bytes() == b"new" and not (tmp_path / "secret.json.tmp").exists()
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0  # created 0600: readable by its owner only
    tmp, final = tmp_path / ".tmp-v1", tmp_path / "v1"
    tmp.mkdir()
    (tmp / "a").write_text("a")
    publish_folder(tmp, final)
    assert (final / "a").read_text() == "a" and not tmp.exists()
