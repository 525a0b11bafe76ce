"""What else loads the box while a figure runs (load average, other busy processes), and `figure`, which records it.

Every figure's result carries the 1-minute load average at its start and end and the processes outside this
benchmark's tree that were busy when it started: on a shared box, what the figure competed with.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import traceback
from pathlib import Path


def default_sampler_dtype() -> str:
    """The samplers' dtype a server on its defaults picks on this CPU (bfloat16 where it computes bf16 natively,
    else float32): the path whose figures get verdicts (issue 28, item 4)."""
    from grpo_server.config import ServerConfig
    from grpo_server.protocol.cpu_features import read_cpu_features
    from grpo_server.workers.launch import sampler_dtype

    return sampler_dtype(ServerConfig(), read_cpu_features())


def rss_mib(pid: int) -> float | None:
    """A process's resident memory now (VmRSS), in MiB; None once it has ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _cpu_ticks() -> dict[int, int]:
    ticks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            ticks[int(stat.parent.name)] = int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return ticks


def _label(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        args = [a.decode(errors="replace") for a in args if a]
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return f"pid {pid}"
    if name.startswith("python") and "-m" in args[:-1]:
        name = f"python -m {args[args.index('-m') + 1]}"
    elif name.startswith("python") and len(args) > 1:
        name = f"python {Path(args[1]).name}"
    return f"{name} in {cwd}"


def other_processes(window_s: float = 1.0, min_share: float = 0.1) -> dict[str, float]:
    """Processes outside this benchmark's tree using at least `min_share` of a core over `window_s` now:
    on a shared box, what else was running. {label: share of one core}."""
    mine = {os.getpid()}
    before = _cpu_ticks()
    time.sleep(window_s)
    after = _cpu_ticks()
    parents = {}
    for pid in after:
        try:
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    for _ in range(6):  # this process's descendants (server, workers, engines)
        mine |= {pid for pid, parent in parents.items() if parent in mine}
    hz = os.sysconf("SC_CLK_TCK")
    busy: dict[str, float] = {}
    for pid, ticks in after.items():
        share = (ticks - before.get(pid, ticks)) / hz / window_s
        if pid not in mine and share >= min_share:
            label = _label(pid)
            busy[label] = round(busy.get(label, 0.0) + share, 2)
    return dict(sorted(busy.items(), key=lambda kv: -kv[1]))


async def figure(results: dict, name: str, coro) -> None:
    """Run one figure; a failure is recorded as that figure's result, and the others go on."""
    others = await asyncio.to_thread(other_processes)
    load0, t = loadavg(), time.perf_counter()
    print(f"[bench] {name} ...", flush=True)
    try:
        results["figures"][name] = await coro
    except Exception as exc:  # reported in the JSON and the table
        traceback.print_exc()
        results["figures"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    results["figures"][name]["figure_s"] = round(time.perf_counter() - t, 1)
    results["figures"][name]["load"] = [load0, loadavg()]
    results["figures"][name]["others_at_start"] = others
    print(f"[bench] {name}: {json.dumps(results['figures'][name])[:400]}", flush=True)


def print_result(result: dict, out: "Path | None") -> None:
    """A standalone figure's JSON result, printed, and written to `out` when given (its --out)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")

