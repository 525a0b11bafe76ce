"""What a client sees when a worker fails (README, "Security model"): the front end's code and a fixed message
with an incident id, never the worker's exception text, a server path or a worker's URL; the front end's log has
the full text under the same incident id.

The worker is a real process serving the real worker side (`protocol/dispatch.py`, with the workers' secret)
under the real supervisor (`workers/processes.py`); the front end's side is its real connection
(`workers/pool.py`) behind its real error middleware (`api/edge.py`), called over HTTP.
"""

from __future__ import annotations

import logging
import re
import sys

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from grpo_server.api.edge import error_middleware
from grpo_server.protocol.errors import public_message
from grpo_server.protocol.listen import free_port
from grpo_server.protocol.verbs import LearnerVerbs
from grpo_server.protocol.wire import RemoveExperimentRequest
from grpo_server.protocol.worker_auth import SECRET_ENV, auth_headers
from grpo_server.workers.pool import WorkerConnection
from grpo_server.workers.processes import WorkerProcess
from tests.serving import WORKER_SECRET, worker_env

WORKER_PATH = "/srv/private-run/checkpoints/exp/state.pt"  # a path of the worker's disk, for no client's eyes

# A learner whose `status` fails inside (an OSError naming a file, as a full disk or a lost checkpoint would)
# and whose `remove_experiment` refuses what it was sent with a message that names a path.
FAILING_WORKER = f"""
import errno, os, sys
from aiohttp import web
from grpo_server.protocol.dispatch import worker_app
from grpo_server.protocol.errors import BadRequest
from grpo_server.protocol.verbs import LearnerVerbs

class Failing:
    async def health(self):
        return {{"status": "ok"}}

    async def status(self):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", {WORKER_PATH!r})

    async def remove_experiment(self, request):
        raise BadRequest(f"{{request.name}} has no files at {WORKER_PATH}", code="not_here")

verbs = [LearnerVerbs.health, LearnerVerbs.status, LearnerVerbs.remove_experiment]
app = worker_app(verbs, Failing(), 1 << 20, secret=os.environ[{SECRET_ENV!r}])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""

INCIDENT = re.compile(r"incident ([0-9a-f]{8})")


@pytest.fixture
async def worker(tmp_path):
    port = free_port()
    process = WorkerProcess("learner", [sys.executable, "-c", FAILING_WORKER, str(port)], f"http://127.0.0.1:{port}",
                            tmp_path / "learner.log", env=worker_env(), startup_timeout_s=60)
    await process.start()
    yield process
    await process.stop()


async def front_end(connection: WorkerConnection) -> TestClient:
    """The front end's error mapping around one call to the worker per route, as a client reaches it."""
    async def status(request: web.Request) -> web.Response:
        await connection.request(LearnerVerbs.status, None)
        return web.json_response({})

    async def remove(request: web.Request) -> web.Response:
        await connection.request(LearnerVerbs.remove_experiment, RemoveExperimentRequest(name="exp"))
        return web.json_response({})

    app = web.Application(middlewares=[error_middleware])
    app.add_routes([web.get("/status", status), web.post("/remove", remove)])
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def call(connection: WorkerConnection, method: str, path: str) -> tuple[int, dict]:
    client = await front_end(connection)
    try:
        response = await client.request(method, path)
        return response.status, (await response.json())["error"]
    finally:
        await client.close()


def assert_nothing_of_the_worker(message: str, worker_url: str) -> None:
    for secret in (WORKER_PATH, "/srv", "FileNotFoundError", "Errno", "Traceback", worker_url, "127.0.0.1"):
        assert secret not in message, (secret, message)


async def test_a_worker_failure_reaches_the_client_as_a_fixed_message(worker, caplog):
    caplog.set_level(logging.INFO, logger="grpo_server.workers.pool")
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        status, error = await call(WorkerConnection(worker, session, 30), "GET", "/status")
    assert (status, error["code"]) == (502, "worker_error")
    incident = INCIDENT.search(error["message"]).group(1)
    assert error["message"] == f"learner failed on status; see the server log (incident {incident})"
    assert_nothing_of_the_worker(error["message"], worker.url)
    # The operator's side: the worker's whole text, at ERROR, under the incident the client was given.
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert WORKER_PATH in logged[0].getMessage() and "FileNotFoundError" in logged[0].getMessage()


async def test_a_worker_refusal_keeps_its_code_without_the_path(worker, caplog):
    caplog.set_level(logging.INFO, logger="grpo_server.workers.pool")
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        status, error = await call(WorkerConnection(worker, session, 30), "POST", "/remove")
    assert (status, error["code"], error["message"]) == (400, "not_here", "learner: exp has no files at <path>")
    assert any(WORKER_PATH in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


async def test_a_worker_refusing_the_front_ends_secret_is_a_worker_error(worker):
    # A 401 from a worker is the server's misconfiguration: passed on, a client would think its own key wrong.
    async with aiohttp.ClientSession(headers=auth_headers("another-secret-0123456789")) as session:
        status, error = await call(WorkerConnection(worker, session, 30), "GET", "/status")
    assert (status, error["code"]) == (502, "worker_error") and INCIDENT.search(error["message"])


async def test_an_unreachable_worker_is_named_not_located(worker, caplog):
    caplog.set_level(logging.INFO, logger="grpo_server.workers.pool")
    await worker.stop()
    worker.state = "ready"  # as the front end sees a worker that died a moment ago, before its supervisor does
    async with aiohttp.ClientSession(headers=auth_headers(WORKER_SECRET)) as session:
        status, error = await call(WorkerConnection(worker, session, 30), "GET", "/status")
    assert (status, error["code"]) == (503, "worker_unavailable")
    incident = INCIDENT.search(error["message"]).group(1)
    assert error["message"] == f"learner is unreachable; retry shortly (incident {incident})"
    assert_nothing_of_the_worker(error["message"], worker.url)
    assert any(incident in r.getMessage() and worker.url.split("//")[1] in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("text, shown", [
    ("/tmp/run/adapters/x/v000001: no adapter_config.json", "<path>: no adapter_config.json"),
    ("peft could not load /a/b: FileNotFoundError: [Errno 2] No such file: '/a/b/c.json'",
     "peft could not load <path>: FileNotFoundError: [Errno 2] No such file: '<path>'"),
    ("source_url 'http://10.0.0.5:8102' is not this sampler's learner (http://learner:8102)",
     "source_url '<url>' is not this sampler's learner (<url>)"),
    ("bad request\nTraceback (most recent call last):\n  File \"/app/x.py\", line 1", "bad request"),
    ("12 tok/s, 1/2 done, lora.r: Input should be less than or equal to 256", None),  # nothing to hide
])
def test_public_message(text, shown):
    assert public_message(text) == (text if shown is None else shown)
