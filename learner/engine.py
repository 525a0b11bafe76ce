"""One DeepSpeed engine per experiment, all over the same peft model.

Each engine is given only its adapter's parameters and its own torch AdamW (a DeepSpeed optimizer
config would JIT-build the CPU fused Adam, ~90 s; a torch optimizer needs no build). ZeRO flattens just
those parameters, so stepping one engine cannot move another experiment's adapter.

Gradient accumulation is owned by the trainer, not by DeepSpeed's micro-step counter, because the number
of micro-batches changes from batch to batch:
  * `gradient_accumulation_steps` is 1 and `backward(loss, scale_wrt_gas=False)`: DeepSpeed never
    divides the loss; each micro-batch loss is already its exact share of the batch loss (policy_loss.py's
    BatchNormalizer), so the accumulated gradient is the whole-batch gradient.
  * `set_gradient_accumulation_boundary(False)` before every micro-batch but the last, `True` before the
    last, then one `step()`: ZeRO keeps adding gradients into its partition until the boundary, then
    clips the *summed* gradient by its global norm (`gradient_clipping`) and takes one AdamW step.
tests/test_learner.py checks the result against a plain torch loop and against one big micro-batch.
With N ranks, DeepSpeed averages the ranks' summed gradients at the boundary (ZeRO-2: at every backward);
learner/sharding.py says how each rank's share and loss scale make that average the whole-batch gradient.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from grpo_server.protocol.cpu_features import read_cpu_features
from grpo_server.protocol.worker_config import AlgorithmConfig

log = logging.getLogger(__name__)


def ds_config(algorithm: AlgorithmConfig, zero_stage: int, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": algorithm.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": algorithm.max_grad_norm,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        # DeepSpeed's own progress lines every N steps would interleave with ours; we log each step.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def uses_autocast(setting: str, device: torch.device, dtype: torch.dtype, dtype_setting: str = "auto") -> bool:
    """Whether train steps run under bf16 autocast: LearnerOptions.autocast on a float32 CPU learner; `auto` only
    where the CPU computes bf16 natively and the configured `dtype` (`dtype_setting`) is auto, not float32."""
    if setting == "off" or device.type != "cpu" or dtype != torch.float32:
        return False
    return setting == "bfloat16" or (dtype_setting == "auto" and read_cpu_features().bf16_native)


def make_engine(model: torch.nn.Module, params: list[torch.nn.Parameter], algorithm: AlgorithmConfig,
                zero_stage: int, dtype: torch.dtype) -> Any:
    import deepspeed

    # ZeRO keeps only parameters that require grad at initialize time.
    for param in params:
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=algorithm.learning_rate, weight_decay=algorithm.weight_decay)
    with _initialize_shortcuts():
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer,
            config=ds_config(algorithm, zero_stage, dtype),
        )
    return engine


@contextlib.contextmanager
def _initialize_shortcuts() -> Iterator[None]:
    """Walks `deepspeed.initialize` makes over every parameter of the shared model (the base's and every resident
    experiment's adapter), skipped or made linear. They made an experiment's engine, at each create and each page-in
    (learner/paging.py), cost more with every experiment held: 1.2 of a 1.9 s engine with 8 of SmolLM2's r=16 adapters
    resident, and a page-in took 5 s with 32.
      * its duplicate check, replaced by a linear one (`_check_for_duplicates` below);
      * with one rank, `_broadcast_model` (a broadcast of each parameter to itself) and the names kept for DeepSpeed's
        debug messages (which then say "unknown"). With several ranks both are kept."""
    import torch.distributed as dist
    from deepspeed.runtime import engine as ds_engine

    engine = ds_engine.DeepSpeedEngine
    saved = engine._broadcast_model, engine._check_for_duplicates, ds_engine.debug_extract_module_and_param_names
    engine._check_for_duplicates = _check_for_duplicates
    if dist.get_world_size() == 1:
        engine._broadcast_model = lambda self: None
        ds_engine.debug_extract_module_and_param_names = lambda model: None
    try:
        yield
    finally:
        engine._broadcast_model, engine._check_for_duplicates, ds_engine.debug_extract_module_and_param_names = saved


def _check_for_duplicates(engine: Any, optimizer: Any) -> None:
    """DeepSpeed's check that no parameter is in the optimizer twice, in one pass over the optimizer's parameters. Its
    own walks the shared model's every parameter and lists each group's ids for each: 0.3 s of a page-in with 32 of
    SmolLM2's r=16 adapters resident, growing with them."""
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert id(param) not in seen, "a parameter occurs more than once in optimizer.param_groups"
            seen.add(id(param))


def release_engine(engine: Any) -> None:
    """Drop an engine without touching the shared model's other adapters.

    `destroy()` removes ZeRO's gradient hooks but not the forward hooks the engine put on the shared
    module; left there, they would keep the dead engine (and its optimizer state) alive and run on
    every later forward of the other experiments.
    """
    try:
        engine.destroy()
    finally:
        for attr in ("module_forward_pre_hook", "module_forward_post_hook"):
            handle = getattr(engine, attr, None)
            if handle is not None:
                handle.remove()
                setattr(engine, attr, None)


def optimizer_step(engine: Any, params: list[torch.nn.Parameter]) -> float:
    """The optimizer step at the accumulation boundary; returns the summed gradient's global norm
    (before clipping).

    ZeRO computes that norm itself. At stage 0 the torch optimizer runs alone and DeepSpeed keeps no
    norm, so it is taken here from the gradients, which the boundary backward has already all-reduced.
    """
    own_norm = None
    if not engine.zero_optimization():
        norms = [torch.linalg.vector_norm(p.grad.float()) for p in params if p.grad is not None]
        own_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    # At stage 0 DeepSpeed's step clips, then sets to None, the .grad of EVERY parameter of the shared module
    # (clip_fp32_gradients, zero_grad over engine.module): other experiments' gradients, which they hold between
    # their forward_backward calls and their optim_step (learner/steps.py), would be scaled by this experiment's
    # clip and then dropped. They are set aside for the step and put back.
    own = {id(p) for p in params}
    others = [(p, p.grad) for p in engine.module.parameters() if p.grad is not None and id(p) not in own]
    for param, _ in others:
        param.grad = None
    try:
        engine.step()
    finally:
        for param, grad in others:
            param.grad = grad
    value = engine.get_global_grad_norm()
    if value is not None:
        return float(value)
    return own_norm if own_norm is not None else float("nan")
