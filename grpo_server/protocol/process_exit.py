"""How a worker process ends: flush what it printed and logged, then `os._exit`, without the interpreter's teardown.

Two reasons, one exit:
- a learner rank whose peer died may have a thread blocked in a collective for good, and a normal exit joins it;
- a sampler or learner that has shut down cleanly (HTTP closed, vLLM's engine core stopped, checkpoints written)
  still spent about a second in the interpreter's final garbage collection over torch's, vLLM's and
  transformers' object graphs (faulthandler stacks taken while a test server stopped: "Garbage-collecting", in
  both workers, for 1-1.5 s). Every test's server stop, and every restart of a worker, waited for it.
Nothing that matters is left to `atexit` in these processes: their apps close their own resources first.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End this process with `code` once its output is flushed; threads are not joined, nothing else runs."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    logging.shutdown()
    os._exit(code)
