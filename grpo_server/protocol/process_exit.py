"""How a worker process ends: flush what it printed and logged, then `os._exit`, without the interpreter's teardown.

Two reasons, one exit:
- a learner rank whose peer died may have a thread blocked in a collective for good, and a normal exit joins it;
- a sampler or learner that has shut down cleanly (HTTP closed, vLLM's engine core stopped, checkpoints written)
  still spent about a second in the interpreter's final garbage collection over torch's, vLLM's and
  transformers' object graphs (faulthandler stacks taken while a test server stopped: "Garbage-collecting", in
  both workers, for 1-1.5 s). Every test's server stop, and every restart of a worker, waited for it.
Nothing that matters is left to `atexit` in these processes: their apps close their own resources first.

And when: with the process that started it. A worker asks the kernel for a signal when its parent dies
(PR_SET_PDEATHSIG), first thing, in its own `main`, then checks that the parent is still the one that started it
(it may have died before the request). Not between fork and exec in the parent (`preexec_fn`): Python documents that
as unsafe in a process with threads, and the front end has several (a child that forked while another thread held a
lock of the loader's or the allocator's can hang there for good, before it is even a worker).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

SUPERVISOR_PID_ENV = "GRPO_SERVER_SUPERVISOR_PID"  # set by the front end for the workers it starts
_PR_SET_PDEATHSIG = 1


def exit_now(code: int) -> NoReturn:
    """End this process with `code` once its output is flushed; threads are not joined, nothing else runs."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    logging.shutdown()
    os._exit(code)


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM, who: str = "the parent") -> None:
    """First thing in a child: `sig` when `parent_pid` dies, and exit now if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:  # not Linux: the check below still catches a parent that is already gone
        pass
    if os.getppid() != parent_pid:
        logging.getLogger(__name__).error("%s (pid %d) is gone; exiting", who, parent_pid)
        exit_now(1)


def die_with_supervisor() -> None:
    """In a worker the front end started: SIGTERM (a clean stop) when the front end dies, even by SIGKILL, so it
    leaves no orphans. Started by hand (no variable), it is nobody's worker. The variable is taken out of the
    environment, so what the worker starts in turn (vLLM's engine core, learner ranks) does not see it."""
    supervisor = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if supervisor is not None:
        die_with_parent(int(supervisor), signal.SIGTERM, "the front end")
