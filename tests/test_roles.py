"""`grpo-server serve --role frontend|sampler|learner`: the processes of a split deployment (docker-compose),
run here as separate processes on loopback with a shared run directory."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from grpo_server import cli
from grpo_server.workers import remote as remote_worker
from grpo_server.client import AsyncClient, GrpoServerError
from grpo_server.protocol.errors import Unavailable
from grpo_server.workers.remote import RemoteWorker
from grpo_server.protocol.verbs import LearnerVerbs
from grpo_server.workers.pool import WorkerConnection
from grpo_server.protocol.codec import unpack
from grpo_server.protocol.worker_auth import SECRET_ENV, auth_headers
from scripts.compose_check import compose_command
from tests.serving import (ADMIN_KEY, STARTUP_TIMEOUT_S, TINY_KV_CACHE_GIB, VERIFY_IDLE_S, WORKER_SECRET,
                           adapter_versions, free_port, train_one_version, wait_for, worker_env)

# --- wrong role for the config: a message that says what to set, before anything starts ----------------

REMOTE = {"sampler": {"urls": ["http://127.0.0.1:8101"]}, "learner": {"url": "http://127.0.0.1:8102"}}


@pytest.mark.parametrize("config, args, message", [
    ({}, ["--role", "frontend"], "set sampler.urls and learner.url"),
    (REMOTE, [], "run the front end with --role frontend"),
    (REMOTE, ["--role", "sampler", "--replica", "1"], "--replica 1, but the config has 1 sampler replica"),
    ({}, ["--role", "sampler"], "set sampler.urls (the front end connects there) or sampler.base_port"),
    ({}, ["--role", "learner"], "set learner.url (the front end connects there) or learner.port"),
    (REMOTE, ["--role", "learner", "--replica", "0"], "--replica is for --role sampler"),
    ({"sampler": {"urls": ["http://127.0.0.1:8101"]}}, ["--role", "frontend"],
     "give both sampler.urls and learner.url"),
    ({"sampler": {"urls": ["http://sampler-0"]}, "learner": {"url": "http://learner:8102"}}, ["--role", "frontend"],
     "sampler.urls[0]: 'http://sampler-0' needs an explicit port"),
    (REMOTE, ["--role", "frontend"], f"must share one worker secret: set {SECRET_ENV}"),
    (REMOTE, ["--role", "sampler"], f"must share one worker secret: set {SECRET_ENV}"),
    (REMOTE, ["--role", "learner"], f"must share one worker secret: set {SECRET_ENV}"),
])
def test_a_config_that_does_not_fit_the_role_is_refused_clearly(tmp_path, capsys, monkeypatch, config, args, message):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **config}))
    assert cli.main(["serve", "--config", str(path), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was written or started


# --- a remote worker: out of rotation while it does not answer, reset and re-synced when it is back ----

HEALTH_ONLY_WORKER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
HTTPServer.allow_reuse_address = True
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def health_only_worker(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HEALTH_ONLY_WORKER, str(port)])


async def test_remote_worker_leaves_rotation_when_down_and_resyncs_when_back(monkeypatch):
    monkeypatch.setattr(remote_worker, "POLL_INTERVAL_S", 0.05)
    monkeypatch.setattr(remote_worker, "MISSES_BEFORE_DOWN", 2)
    port = free_port()
    calls: list[tuple[str, str]] = []

    async def reset():
        calls.append(("reset", worker.state))

    async def on_restart():
        calls.append(("on_restart", worker.state))

    process = health_only_worker(port)
    async with aiohttp.ClientSession() as session:
        worker = RemoteWorker("learner", f"http://127.0.0.1:{port}", session, startup_timeout_s=60,
                              reset=reset, on_restart=on_restart)
        client = WorkerConnection(worker, session, timeout_s=5)
        try:
            await worker.start()
            assert worker.state == "ready"
            assert calls == [("reset", "syncing")]  # what it held from before is dropped before it serves

            process.kill()
            process.wait()
            await wait_for(lambda: state_is(worker, "down"), timeout_s=30, interval_s=0.05)
            with pytest.raises(Unavailable) as info:  # clients get a 503 at once, not a hang
                await client.request(LearnerVerbs.train, {})
            assert info.value.status == 503 and "learner is down" in info.value.message
            assert "unreachable" in worker.last_error

            process = health_only_worker(port)
            await wait_for(lambda: state_is(worker, "ready"), timeout_s=30, interval_s=0.05)
            # Back: reset, then re-synced, both before clients reach it.
            assert calls == [("reset", "syncing"), ("reset", "syncing"), ("on_restart", "syncing")]
        finally:
            await worker.stop()
            process.kill()
            process.wait()
    assert worker.state == "stopped"


async def test_remote_worker_that_never_answers_fails_the_start_with_its_url(monkeypatch):
    monkeypatch.setattr(remote_worker, "POLL_INTERVAL_S", 0.05)
    url = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        worker = RemoteWorker("sampler-0", url, session, startup_timeout_s=0.3)
        with pytest.raises(TimeoutError, match=f"sampler-0 at {url} not healthy"):
            await worker.start()


async def state_is(worker: RemoteWorker, state: str) -> bool:
    return worker.state == state


# --- the three roles as separate processes ------------------------------------------------------------


def spawn(run_dir: Path, config: Path, role: str, *args: str) -> subprocess.Popen:
    """One `grpo-server serve --role` process in its own process group (with what it spawns)."""
    log = open(run_dir / f"{role}{''.join(args)}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_server.cli", "serve", "--role", role, "--config", str(config), *args],
        stdout=log, stderr=subprocess.STDOUT, env=worker_env(), start_new_session=True)  # the secret: each role's


def wait_for_port(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"port {port} not open after {STARTUP_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-4000:]}")


def end(process: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


async def sampler_adapters(url: str) -> list[str]:
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session, \
            session.get(url + "/health") as response:
        return unpack(await response.read())["adapters"]


async def test_frontend_sampler_and_learner_as_separate_processes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "shared-run"  # the compose volume: the learner writes adapters, the sampler reads them
    run_dir.mkdir()
    front_port, sampler_port, learner_port = free_port(), free_port(), free_port()
    sampler_url = f"http://127.0.0.1:{sampler_port}"
    config = run_dir / "server.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tiny_model_dir), "host": "127.0.0.1", "port": front_port, "run_dir": str(run_dir),
        "api_key": ADMIN_KEY, "max_model_len": 512, "startup_timeout_s": STARTUP_TIMEOUT_S, "worker_timeout_s": 120,
        "dtype": "float32", "verify_tolerance": 0.01,  # exact on either CPU generation (auto: bf16 on one)
        "verify_idle_s": VERIFY_IDLE_S,
        "sampler": {"urls": [sampler_url], "engine": "vllm", "kv_cache_gib": TINY_KV_CACHE_GIB, "max_num_seqs": 16,
                    "compile": False},
        "learner": {"url": f"http://127.0.0.1:{learner_port}", "zero_stage": 2},
    }))
    learner = spawn(run_dir, config, "learner")
    sampler = spawn(run_dir, config, "sampler", "--replica", "0")
    frontend = spawn(run_dir, config, "frontend")
    url, name = f"http://127.0.0.1:{front_port}", "split"
    try:
        wait_for_port(front_port, frontend, run_dir / "frontend.log")  # it opens once both workers answered
        async with AsyncClient(url, ADMIN_KEY) as client:
            assert (await client.health()).workers == {"sampler-0": "ready", "learner": "ready"}
            await client.create_experiment({"name": name, "algorithm": {"batch_groups": 1, "learning_rate": 1e-2},
                                            "sampling": {"n": 2, "max_tokens": 4}})

            version = await train_one_version(client, name)
            assert version in adapter_versions(await sampler_adapters(sampler_url), name)

        # The front end restarts on its own (compose restarts one service): the workers run on, and the new
        # front end takes them over; the learner forgets what it held and resumes from its checkpoint.
        assert end(frontend, signal.SIGINT) == 0
        assert learner.poll() is None and sampler.poll() is None
        frontend = spawn(run_dir, config, "frontend")
        wait_for_port(front_port, frontend, run_dir / "frontend.log")
        async with AsyncClient(url, ADMIN_KEY) as client:
            resumed = await client.status(name)
            assert resumed.policy_version >= version
            deadline = time.monotonic() + 60
            while True:  # groups rated before the restart are trained first: a 429 learner_behind meanwhile
                try:
                    group = await client.complete(name, prompt="Hello again")
                    break
                except GrpoServerError as exc:
                    if (exc.status, exc.code) != (429, "learner_behind") or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(exc.retry_after or 1.0)
            # >=: a step queued before the restart may push between the status and this completion.
            assert group.policy_version >= resumed.policy_version and len(group.completions) == 2

            # The sampler dies: a clear 503 while it is gone, and the front end says which worker is down.
            end(sampler, signal.SIGKILL)
            with pytest.raises(GrpoServerError) as info:
                await client.complete(name, prompt="Anyone?")
            assert info.value.status == 503 and "sampler-0" in str(info.value)
            await wait_for(lambda: _worker_state(client, "sampler-0", "down"), timeout_s=60)

            # It comes back (compose's restart policy; here by hand) and is re-synced before it serves.
            sampler = spawn(run_dir, config, "sampler", "--replica", "0")
            await served_again(client, name, sampler_url)
        assert end(frontend, signal.SIGINT) == 0
        # `docker stop` sends each service SIGTERM: a worker that stops cleanly says so with exit code 0 (the
        # sampler's forked engine core once relayed that signal into the sampler's event loop, which then
        # stopped twice and exited 1).
        assert end(sampler) == 0, (run_dir / "sampler--replica0.log").read_text(errors="replace")[-4000:]
        assert end(learner) == 0, (run_dir / "learner.log").read_text(errors="replace")[-4000:]
    finally:
        for process in (frontend, sampler, learner):
            if process.poll() is None:
                end(process)


async def served_again(client: AsyncClient, name: str, sampler_url: str) -> int:
    """After a sampler restart: once sampler-0 is ready, it holds the live version and a completion is served
    at it. Returns that version."""
    await wait_for(lambda: _worker_state(client, "sampler-0", "ready"), timeout_s=STARTUP_TIMEOUT_S)
    served = (await client.status(name)).policy_version
    assert served in adapter_versions(await sampler_adapters(sampler_url), name)
    group = await client.complete(name, prompt="Back?")
    assert group.policy_version == served and len(group.completions) == 2
    return served


async def _worker_state(client: AsyncClient, worker: str, state: str) -> bool:
    return (await client.health()).workers.get(worker) == state


# --- docker-compose.yml: every service runs a valid role with a config that fits it --------------------

REPO = Path(__file__).resolve().parent.parent
ENV_FILES = sorted((REPO / "configs" / "compose").glob("gpus-*.env"))
INTERPOLATION = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}`, as the file uses them."""
    def value(match: re.Match) -> str:
        name, op, arg = match.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name} must be set: {arg}")
        return arg if op == "-" else ""
    return INTERPOLATION.sub(value, text)


def active_services(env: dict[str, str]) -> dict[str, dict]:
    compose = yaml.safe_load(interpolate((REPO / "docker-compose.yml").read_text(), env))
    profiles = set(filter(None, env.get("COMPOSE_PROFILES", "").split(",")))
    return {name: service for name, service in compose["services"].items()
            if not service.get("profiles") or profiles & set(service["profiles"])}


def option(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_compose_needs_the_admin_key_and_the_worker_secret():
    with pytest.raises(KeyError, match="GRPO_SERVER_API_KEY"):
        active_services({SECRET_ENV: "y"})
    with pytest.raises(KeyError, match=SECRET_ENV):
        active_services({"GRPO_SERVER_API_KEY": "x"})


def test_a_secret_on_the_command_line_is_refused_without_being_echoed(capsys):
    """The workers' secret goes in the environment; typed as an option it is refused, and the error names the
    option, never its value (which would land in a container's log)."""
    from grpo_server.cli import main

    for argv in (["serve", "--role", "sampler", "--worker-secret", "s3cret-value-123"],
                 ["serve", "--worker-secret=s3cret-value-123"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--worker-secret" in err and "s3cret-value-123" not in err, err


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.stem)
def test_compose_layout_runs_valid_roles_on_distinct_gpus(env_file, monkeypatch):
    from grpo_server.config import load_server_config
    from grpo_server.serve import ROLES, check_role

    env = {**read_env_file(env_file), "GRPO_SERVER_API_KEY": "x", SECRET_ENV: WORKER_SECRET}
    monkeypatch.setenv(SECRET_ENV, WORKER_SECRET)  # as compose gives it to every service (checked below)
    gpus = int(env_file.stem.removeprefix("gpus-"))
    services = active_services(env)
    roles: dict[str, list[str]] = {}
    gpu_ids: list[str] = []
    for name, service in services.items():
        command = service["command"]
        assert command[:2] == ["grpo-server", "serve"], name
        role, replica = option(command, "--role"), option(command, "--replica")
        assert role in ROLES, (name, role)
        config_path = REPO / option(command, "--config")  # the image's /app/configs is the repo's configs/
        config = load_server_config(config_path)
        check_role(config, role, None if replica is None else int(replica))  # raises if they do not fit
        roles.setdefault(role, []).append(name)
        assert service["environment"][SECRET_ENV] == WORKER_SECRET, name  # every role, the same one
        if role == "frontend":
            assert service["ports"] == [f"127.0.0.1:8000:{config.port}"]  # loopback unless GRPO_SERVER_BIND says
            continue
        # The front end finds each worker by its service name, on the port the worker listens on.
        url = config.learner.url if role == "learner" else config.sampler.urls[int(replica)]
        assert url == f"http://{name}:{urlsplit(url).port}"
        assert service["healthcheck"]["test"][-1] == f"http://127.0.0.1:{urlsplit(url).port}/health"
        for device in service["deploy"]["resources"]["reservations"]["devices"]:
            gpu_ids += device["device_ids"]
    assert len(roles["frontend"]) == 1 and len(roles["learner"]) == 1
    assert sorted(roles["sampler"]) == [f"sampler-{i}" for i in range(len(config.sampler.urls))]
    assert sorted(gpu_ids, key=int) == [str(i) for i in range(gpus)]  # every GPU used, none twice


# Compose v2 (`docker compose`) where the plugin is installed, else Debian's docker-compose 1.29 (what apt
# installs on this kind of machine); the file keeps to what both accept.
COMPOSE = compose_command()


@pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor docker-compose is installed here")
@pytest.mark.parametrize("env_file", [None, *ENV_FILES], ids=lambda p: p.stem if p else "defaults")
def test_docker_compose_accepts_the_file(env_file):
    args = ["--env-file", str(env_file)] if env_file else []
    result = subprocess.run([*COMPOSE, *args, "config", "-q"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "GRPO_SERVER_API_KEY": "x", SECRET_ENV: WORKER_SECRET}, timeout=60)
    assert result.returncode == 0, result.stderr
