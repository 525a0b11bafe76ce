"""Logs that stay bounded, and are read from their tail (issue 25, "Bounded disk"): a worker's output rotates by
size (grpo_server/workers/worker_logs.py), every read of it takes only its end, and an experiment's metrics log
history is read backwards from its end (grpo_server/runtime/metrics_log.py `last_lines`), giving what reading it
whole gave."""

from __future__ import annotations

import json
import sys
from collections import deque
from pathlib import Path

from grpo_server.protocol.listen import free_port
from grpo_server.runtime import metrics_log
from grpo_server.runtime.metrics_log import KINDS, RECENT_PER_KIND, MetricsLog, last_lines
from grpo_server.workers import worker_logs
from grpo_server.workers.processes import WorkerProcess
from grpo_server.workers.worker_logs import RotatingLog, tail_lines
from tests.serving import wait_for


class CountingFile:
    """A binary file that counts the bytes read from it."""

    def __init__(self, file):
        self.file, self.read_bytes = file, 0

    def read(self, size=-1):
        data = self.file.read(size)
        self.read_bytes += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def log_files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.parent.glob(path.name + "*"))}


# --- worker logs ---------------------------------------------------------------------------------


def test_a_log_rotates_by_size_and_keeps_a_few_backups(tmp_path):
    path = tmp_path / "logs" / "w.log"
    log = RotatingLog(path, max_bytes=1000, backups=2)
    for i in range(40):
        log.write(f"{i:04d} ".encode() + b"x" * 95)  # 100 bytes a write
    log.close()
    assert log_files(path) == {"w.log": 1000, "w.log.1": 1000, "w.log.2": 1000}
    assert path.read_bytes().startswith(b"0030 ") and path.read_bytes().endswith(b"0039 " + b"x" * 95)
    assert (tmp_path / "logs" / "w.log.2").read_bytes().startswith(b"0010 ")  # 0000-0009 dropped
    # Another life appends, and rotates on from the size it finds.
    again = RotatingLog(path, max_bytes=1000, backups=2)
    again.write(b"next life\n")
    again.close()
    assert path.read_bytes() == b"next life\n" and log_files(path)["w.log.1"] == 1000


def test_the_tail_of_a_log_is_read_from_its_end_only(tmp_path, monkeypatch):
    path = tmp_path / "big.log"
    with open(path, "wb") as file:
        for i in range(200_000):  # 5 MB
            file.write(f"line {i:06d} of a long run ..........\n".encode())
    counted: list[CountingFile] = []

    def counting_open(*args, **kwargs):
        counted.append(CountingFile(open(*args, **kwargs)))
        return counted[-1]

    monkeypatch.setattr(worker_logs, "open", counting_open, raising=False)
    assert tail_lines(path, 2) == "line 199998 of a long run ..........\nline 199999 of a long run .........."
    assert sum(c.read_bytes for c in counted) <= worker_logs.TAIL_BYTES
    # Just rotated: the newest backup gives the lines the fresh file does not hold yet.
    path.rename(tmp_path / "big.log.1")
    path.write_bytes(b"restarted\n")
    assert tail_lines(path, 3).splitlines() == ["line 199998 of a long run ..........",
                                                "line 199999 of a long run ..........", "restarted"]
    assert tail_lines(tmp_path / "none.log") == ""


# Prints 100 kB (Python, a native write to fd 2, a child process), answers /health, and says when it is ready.
CHATTY_WORKER = """
import os, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
for i in range(2000):
    print(f"line {i:05d} " + "x" * 40)
os.write(2, b"native bytes on stderr\\n")
subprocess.run(["sh", "-c", "echo from a child process"])
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
print("ready", flush=True)
server.serve_forever()
"""


async def test_a_worker_s_output_of_every_kind_goes_to_its_log_which_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_logs, "LOG_MAX_BYTES", 8192)
    port = free_port()
    path = tmp_path / "logs" / "chatty.log"
    worker = WorkerProcess("chatty", [sys.executable, "-c", CHATTY_WORKER, str(port)], f"http://127.0.0.1:{port}",
                           path, startup_timeout_s=60)
    await worker.start()
    try:
        await wait_for(lambda: _async(worker.tail_log(1) == "ready"), timeout_s=30, interval_s=0.05)
        assert worker.tail_log(3).splitlines() == ["native bytes on stderr", "from a child process", "ready"]
    finally:
        await worker.stop()
    sizes = log_files(path)
    # 100 kB written, 8 kB per file: the log and LOG_BACKUPS backups are all that is left.
    assert list(sizes) == ["chatty.log"] + [f"chatty.log.{i}" for i in range(1, worker_logs.LOG_BACKUPS + 1)]
    assert all(size <= 8192 for size in sizes.values()), sizes


async def _async(value):
    return value


# --- the metrics log's history ---------------------------------------------------------------------


def _history_as_before(path: Path) -> dict[str, list[dict]]:
    """The history as `MetricsLog` read it before: the whole file, its newest lines kept."""
    recent = {k: deque(maxlen=RECENT_PER_KIND) for k in KINDS}
    with open(path, encoding="utf-8", errors="replace") as file:
        for line in deque(file, maxlen=RECENT_PER_KIND * len(KINDS)):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") in KINDS and isinstance(record.get("time"), (int, float)):
                recent[record["kind"]].append(record)
    return {k: list(v) for k, v in recent.items()}


def test_the_metrics_history_is_read_from_the_end_of_a_large_log_as_it_was_read_whole(tmp_path):
    path = metrics_log.metrics_log_path(tmp_path, "long")
    path.parent.mkdir(parents=True)
    kinds = ["train", "train", "push", "sampling", "train"]  # uneven: push lines are rare
    with open(path, "w", encoding="utf-8") as file:
        for i in range(60_000):  # ~7 MB
            file.write(json.dumps({"time": 1e9 + i, "kind": kinds[i % 5], "step": i, "loss": 0.5, "pad": "p" * 60})
                       + "\n")
            if i % 7919 == 0:
                file.write("not json\n\n")  # garbage and an empty line count as lines, as before
        file.write('{"time": 2e9, "kind": "tra')  # a line a crash cut short, at the very end
    size = path.stat().st_size
    expected = _history_as_before(path)

    log = MetricsLog(path)
    log.close()
    assert {k: list(log.recent[k]) for k in KINDS} == expected
    assert len(expected["train"]) == RECENT_PER_KIND and 0 < len(expected["push"]) < RECENT_PER_KIND

    with open(path, "rb") as raw:
        counting = CountingFile(raw)
        lines = last_lines(counting, RECENT_PER_KIND * len(KINDS))
    assert len(lines) == RECENT_PER_KIND * len(KINDS) and lines[-1] == b'{"time": 2e9, "kind": "tra'
    wanted = sum(len(line) + 1 for line in lines) - 1  # the last line has no newline
    assert wanted <= counting.read_bytes < wanted + metrics_log.BLOCK_BYTES + 200  # + one line cut at the start
    assert counting.read_bytes < size / 5


def test_last_lines_at_the_edges(tmp_path):
    path = tmp_path / "f"
    for content, count, expected in [
        (b"", 3, []), (b"a\n", 3, [b"a"]), (b"a\nb", 1, [b"b"]), (b"a\nb\n", 1, [b"b"]), (b"\n\n", 5, [b"", b""]),
        (b"a\nbb\nccc\n", 2, [b"bb", b"ccc"]), (b"a\nbb\nccc\n", 0, []),
    ]:
        path.write_bytes(content)
        for block in (1, 2, 3, 64):
            with open(path, "rb") as file:
                assert last_lines(file, count, block=block) == expected, (content, count, block)
