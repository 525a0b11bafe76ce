"""Ports: the front end picks a free one for each worker it starts, and the worker takes it first thing.

A port picked with bind(0) and closed again is free only until someone else binds it. The workers used to bind
theirs when their app started, after vLLM's engine or DeepSpeed was up, tens of seconds later; meanwhile vLLM's
ZMQ sockets and torch's TCPStore bind ports of their own, and once in a while took the picked one (a restarted
sampler failed with EADDRINUSE in CI). So a worker binds its port before its heavy imports (`bind_early`) and
hands the bound socket to aiohttp; the window left is the interpreter's start, and `free_port` never hands out
one port twice within a front end's process. The front end binds its own port the same way, before it starts the
workers (grpo_server/serve.py): a test's server listens on a port the kernel picked, and a worker took it once.
"""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def _kernels_pick(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that this process has not handed out before."""
    while True:
        port = _kernels_pick(host)
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def bind_early(host: str, port: int) -> socket.socket:
    """The worker's listening socket, bound but not yet listening: until aiohttp listens on it, a health probe
    is refused exactly as before. Not inherited by the processes vLLM and DeepSpeed start (PEP 446; vLLM's engine
    core is spawned, not forked), so a dead worker's children cannot hold its port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted worker rebinds through TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
