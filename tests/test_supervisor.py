"""The supervisor with real processes: a crashing worker is restarted with its re-sync, and a crash loop
ends in a `failed` state that says why, instead of restarting forever."""

from __future__ import annotations

import asyncio
import sys

import pytest

from grpo_server.protocol.listen import free_port
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
