"""Ports (grpo_server/protocol/listen.py): the front end hands out each picked port once, and a worker binds its
port before its heavy imports, so nothing it starts (vLLM's engine, torch's store) can take it first. The front
end binds its own before it starts the workers."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from grpo_server.protocol import listen
from grpo_server.protocol.listen import bind_early, free_port
from tests.serving import start_server, worker_env

ROOT = Path(__file__).resolve().parents[1]


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    # The kernel's next pick repeats the port just handed out; free_port asks again.
    picks = iter([41001, 41001, 41001, 41002])
    monkeypatch.setattr(listen, "_handed_out", set())
    monkeypatch.setattr(listen, "_kernels_pick", lambda host: next(picks))
    assert [free_port(), free_port()] == [41001, 41002]


def test_free_port_gives_distinct_bindable_ports():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


async def test_a_bound_port_is_held_refused_until_served_then_served():
    port = free_port()
    held = bind_early("127.0.0.1", port)
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        with pytest.raises(aiohttp.ClientConnectionError):  # bound, not listening: a health probe is refused
            await session.get(f"http://127.0.0.1:{port}/health")
        app = web.Application()

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, held).start()
        try:
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                assert response.status == 200
        finally:
            await runner.cleanup()


def test_bind_early_reports_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        with pytest.raises(OSError):
            bind_early("127.0.0.1", taken.getsockname()[1])


@pytest.mark.parametrize("role", ["sampler", "learner"])
def test_a_worker_whose_port_is_taken_says_so_before_loading_anything(role, tmp_path):
    """Exit code 2 and the port in the message: the bind comes before vLLM / torch load anything."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        config = tmp_path / f"{role}.yaml"
        config.write_text(yaml.safe_dump({"model_path": str(tmp_path / "no-model"), "run_dir": str(tmp_path / "run"),
                                          "port": port}))
        done = subprocess.run([sys.executable, "-m", role, "--config", str(config)], cwd=ROOT, env=worker_env(),
                              capture_output=True, text=True, timeout=120)
    # The model path does not exist: a worker that loaded anything before binding would fail on that instead.
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{port}" in done.stderr


def test_a_front_end_whose_port_is_taken_says_so_before_starting_a_worker(tmp_path):
    """Exit code 2 at once: the port is bound before the workers start (their ports, vLLM's and torch's sockets
    cannot take it meanwhile), and the model path does not exist, so a worker started first would fail on that."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        config = tmp_path / "server.yaml"
        config.write_text(yaml.safe_dump({"model": str(tmp_path / "no-model"), "run_dir": str(tmp_path / "run"),
                                          "host": "127.0.0.1", "port": port}))
        done = subprocess.run([sys.executable, "-m", "grpo_server.cli", "serve", "--config", str(config)], cwd=ROOT,
                              env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{port}" in done.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no worker was started


def test_a_server_whose_sampler_port_is_taken_stops_and_says_why(tiny_model_dir, tmp_path):
    """The whole server: its start fails with the sampler's reason in its log, and the tokenizers it loaded on a
    thread meanwhile (grpo_server/api/app.py) do not keep it from exiting."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="server exited with") as failed:
            start_server(tmp_path / "run", tiny_model_dir, sampler={"base_port": port})
    assert f"cannot bind 127.0.0.1:{port}" in str(failed.value)
    assert "a worker failed to start" in str(failed.value)
