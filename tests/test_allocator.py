"""The workers' allocator (grpo_server/workers/allocator.py): tcmalloc preloaded where the system has it, into the
sampler, vLLM's engine core under it, and the learner; a choice of the environment otherwise."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from grpo_server.workers.allocator import ALLOCATOR_ENV, allocator_env, describe, find_tcmalloc

LIB = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def found():
    return LIB


def missing():
    return None


def test_tcmalloc_is_preloaded_when_found_and_kept_first():
    assert allocator_env({}, found) == {"LD_PRELOAD": LIB}
    assert allocator_env({"LD_PRELOAD": "/opt/libiomp5.so"}, found) == {"LD_PRELOAD": f"{LIB}:/opt/libiomp5.so"}
    assert "tcmalloc" in describe(allocator_env({}, found), {})


def test_nothing_is_added_when_absent_chosen_away_or_already_there():
    assert allocator_env({}, missing) == {}
    assert "glibc's, as no libtcmalloc" in describe({}, {})
    assert allocator_env({ALLOCATOR_ENV: "system"}, found) == {}
    assert "=system" in describe({}, {ALLOCATOR_ENV: "system"})
    mine = {"LD_PRELOAD": "/opt/gperftools/lib/libtcmalloc.so"}
    assert allocator_env(mine, found) == {}
    assert "from LD_PRELOAD" in describe({}, mine)


def test_an_unknown_choice_is_refused_by_name():
    with pytest.raises(ValueError, match=f"{ALLOCATOR_ENV}='jemalloc'"):
        allocator_env({ALLOCATOR_ENV: "jemalloc"}, found)


def _mapped(pid: int) -> bool:
    return "libtcmalloc" in Path(f"/proc/{pid}/maps").read_text()


def _settled(pids: list[int], expected: bool) -> dict[int, bool]:
    """Each long-lived process's answer. A process caught as it starts (exec'd, its preloads not mapped yet) or a
    short-lived helper a worker runs (a command, maybe with an environment of its own) is asked again for up to
    3 s; one that has exited by then is left out. On a loaded box (two test workers) one such was seen once."""
    answers = {}
    for pid in pids:
        deadline = time.monotonic() + 3
        try:
            while (answer := _mapped(pid)) != expected and time.monotonic() < deadline:
                time.sleep(0.1)
        except FileNotFoundError:
            continue  # it ended: a short-lived child (a helper the worker ran), not a worker
        answers[pid] = answer
    return answers


def _described(pid: int) -> str:
    """What a process is, for a failure's message: its command line and state."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return "(gone)"
    return f"{cmdline[:200]!r} {state}"


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in children] + [d for c in children for d in _descendants(int(c))]


def test_the_servers_workers_and_their_children_run_on_what_was_found(server):
    """The real server's sampler (with vLLM's engine core under it) and learner: tcmalloc mapped in every one of
    them where this machine has the library (scripts/setup installs it as root), in none otherwise."""
    workers = server.worker_pids()
    everyone = workers + [d for w in workers for d in _descendants(w)]
    assert len(workers) >= 2 and len(everyone) > len(workers)  # the engine core is a child of the sampler
    given = "libtcmalloc" in os.environ.get("LD_PRELOAD", "")  # preloaded into this test run by its user
    expected = given or (os.environ.get(ALLOCATOR_ENV) != "system" and find_tcmalloc() is not None)
    answers = _settled(everyone, expected)
    wrong = {pid: _described(pid) for pid, answer in answers.items() if answer != expected}
    assert len(answers) > len(workers) and not wrong, f"expected tcmalloc mapped: {expected}; not so in {wrong}"
    assert _mapped(server.process.pid) == given  # the front end itself keeps the allocator it was started with
    helpers = server.helper_pids()  # and so do its own helpers (the body decoder's processes)
    assert helpers and {pid: _mapped(pid) for pid in helpers} == {pid: given for pid in helpers}
