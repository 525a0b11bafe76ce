"""learner/shm_op.py: the learner tells DeepSpeed its CPU shm comm op is unavailable, so starting the process
group runs no compiler, at any number of ranks. (That training then reduces over gloo exactly as before is
test_learner_multirank's: two ranks train like one.)"""

from __future__ import annotations

import importlib

from learner import shm_op


def test_deepspeed_goes_without_the_op_and_runs_no_build(monkeypatch):
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, builder.NAME, True)  # as a fresh process has it; restored
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)

    def no_compiler(self, *args, **kwargs):
        raise AssertionError("DeepSpeed tried to build or load its shm op")

    monkeypatch.setattr(type(builder), "load", no_compiler)
    monkeypatch.setattr(type(builder), "jit_load", no_compiler)
    shm_op.skip_shm_op()
    assert deepspeed.ops.__compatible_ops__[builder.NAME] is False
    # What deepspeed.init_distributed calls: DeepSpeed's own, which now returns None without a compiler run.
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None


def test_the_op_is_called_only_by_tensor_parallel_inference():
    """The reason it may go: in this DeepSpeed, the op's one use is `inference_all_reduce`. If a new release
    routes training's all_reduce through it, this fails and the skip must be looked at again."""
    import inspect

    backend = importlib.import_module("deepspeed.comm.torch").TorchBackend
    users = [name for name, member in inspect.getmembers(backend, inspect.isfunction)
             if "inference_all_reduce_" in inspect.getsource(member) or "shm_comm_op" in inspect.getsource(member)]
    assert sorted(users) == ["__init__", "inference_all_reduce"], users  # __init__ builds it, the other calls it
