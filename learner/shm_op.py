"""DeepSpeed's CPU shared-memory comm op, which the learner never calls: marked unavailable so it is not built.

On CPU, `deepspeed.init_distributed` JIT-compiles a shared-memory all-reduce op with g++ the first time a process
starts it (~50 s on a fresh machine, 72 s beside other work here; a build killed midway also left a lock that hung
every later learner). Its one caller is `inference_all_reduce`, the all-reduce of DeepSpeed's tensor-parallel
inference layers (deepspeed/module_inject). The learner trains data-parallel: ZeRO's reductions go through
`dist.all_reduce` and friends, which DeepSpeed's TorchBackend hands to torch.distributed (gloo on CPU), with or
without the op. So the op is marked incompatible before `init_distributed`, at any number of ranks, and DeepSpeed's
own `build_shm_op` then returns None without running a compiler (tests/test_shm_op.py; test_learner_multirank
checks that two ranks still train exactly like one).
"""

from __future__ import annotations


def skip_shm_op() -> None:
    """Tell DeepSpeed the op is unavailable on this CPU, so `init_distributed` neither builds nor loads it."""
    import torch

    if torch.cuda.is_available():
        return  # NCCL: DeepSpeed has no shared-memory op there
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
