"""The supervisor with real processes: a crashing worker is restarted with its re-sync, a crash loop ends in a
`failed` state that says why, instead of restarting forever, and a worker ends with its front end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_server.protocol.errors import Unavailable
from grpo_server.protocol.listen import free_port
from grpo_server.protocol.process_exit import SUPERVISOR_PID_ENV
from grpo_server.workers import processes as supervisor
from grpo_server.workers.processes import WorkerProcess

# A worker that answers /health, then dies with code 3 after `lifetime` seconds.
CRASHING_WORKER = """
import sys, threading, os
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
threading.Timer(float(sys.argv[2]), lambda: os._exit(3)).start()
server.serve_forever()
"""


@pytest.mark.parametrize("max_crashes", [1, 2, 3])
async def test_crash_loop_restarts_with_resync_then_gives_up(tmp_path, monkeypatch, max_crashes):
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.05,))
    monkeypatch.setattr(supervisor, "MAX_CRASHES", max_crashes)
    port = free_port()
    resyncs = []

    async def on_restart():
        resyncs.append(worker.state)

    worker = WorkerProcess("flaky", [sys.executable, "-c", CRASHING_WORKER, str(port), "0.5"],
                           f"http://127.0.0.1:{port}", tmp_path / "flaky.log", startup_timeout_s=30,
                           on_restart=on_restart)
    await worker.start()
    assert worker.state == "ready"
    for _ in range(200):
        if worker.state == "failed":
            break
        await asyncio.sleep(0.1)
    assert worker.state == "failed"
    assert worker.last_error == "exited with code 3"
    # Started once, restarted after each crash before the MAX_CRASHES-th (each re-synced while clients still
    # wait: "syncing"); that one is not restarted (docs/operations/durability.md: it gives up after 5 crashes
    # in 10 minutes, not 6).
    assert resyncs == ["syncing"] * (max_crashes - 1)
    await worker.stop()
    assert worker.state == "stopped"


# A worker as the real ones start (sampler/__main__.py, learner/__main__.py): die_with_supervisor() first.
HEALTHY_WORKER = """
import sys
from grpo_server.protocol.process_exit import die_with_supervisor
die_with_supervisor()
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

# A front end in miniature: supervises HEALTHY_WORKER, prints its pid, and waits to be killed.
SUPERVISOR = """
import asyncio, sys
from pathlib import Path
from grpo_server.workers.processes import WorkerProcess
async def main():
    worker = WorkerProcess("w", [sys.executable, "-c", sys.argv[1], sys.argv[2]], f"http://127.0.0.1:{sys.argv[2]}",
                           Path(sys.argv[3]), startup_timeout_s=60)
    await worker.start()
    print(worker._proc.pid, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "zombie" not in status.lower()


def test_a_worker_ends_when_its_front_end_is_killed_outright(tmp_path):
    """SIGKILL to the front end runs none of its code, yet its worker stops (PR_SET_PDEATHSIG, asked for by the
    worker itself: grpo_server/protocol/process_exit.py)."""
    front_end = subprocess.Popen([sys.executable, "-c", SUPERVISOR, HEALTHY_WORKER, str(free_port()),
                                  str(tmp_path / "w.log")], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(front_end.stdout.readline())
        assert _running(worker)
        os.kill(front_end.pid, signal.SIGKILL)
        front_end.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker), "the worker outlived its front end"
    finally:
        front_end.kill()


def test_a_worker_whose_front_end_died_before_it_asked_exits_at_once():
    """The window before the worker's first line: its parent is already someone else, so it exits."""
    ended = subprocess.run([sys.executable, "-c", HEALTHY_WORKER, str(free_port())], timeout=30,
                           env={**os.environ, SUPERVISOR_PID_ENV: "1"}, capture_output=True, text=True)
    assert ended.returncode == 1 and "the front end (pid 1) is gone" in ended.stderr


# A worker that dies once (its first life, which leaves a marker), then lives on.
ONCE_CRASHING_WORKER = """
import os, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
if not os.path.exists(sys.argv[2]):
    open(sys.argv[2], "w").close()
    threading.Timer(0.5, lambda: os._exit(3)).start()
server.serve_forever()
"""


async def test_a_resync_that_fails_for_a_passing_reason_is_tried_again_on_the_same_worker(tmp_path, monkeypatch):
    """The restarted worker is healthy but its re-sync is refused for now (503: its disk is full): the re-sync is
    tried again on the same process, which is not killed and started over until the supervisor gives up."""
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.05,))
    monkeypatch.setattr(supervisor, "RESYNC_RETRY_S", 0.05)
    port, tries = free_port(), []

    async def on_restart():
        tries.append(worker._proc.pid)
        if len(tries) < 4:
            raise Unavailable("learner: the run directory's disk is full", code="disk_full")

    worker = WorkerProcess("once", [sys.executable, "-c", ONCE_CRASHING_WORKER, str(port), str(tmp_path / "died")],
                           f"http://127.0.0.1:{port}", tmp_path / "once.log", startup_timeout_s=30,
                           on_restart=on_restart)
    await worker.start()
    first = worker._proc.pid
    for _ in range(200):
        if worker.state == "ready" and tries:
            break
        await asyncio.sleep(0.05)
    assert worker.state == "ready" and len(tries) == 4, (worker.state, tries, worker.last_error)
    assert len(set(tries)) == 1 and tries[0] != first  # every try on the one restarted process
    await worker.stop()
