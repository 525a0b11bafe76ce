"""Memory: peak RSS (VmHWM, MiB) of the front end, the sampler and the learner, each with its child processes.

The server figures take a snapshot after 1, 4 (and 8) experiments have each sampled and trained one step
(experiments.py's `curve`); read from /proc, so nothing here calls the server.
"""

from __future__ import annotations

from pathlib import Path

from .host import loadavg

MEMORY_AT = (1, 4, 8)  # snapshots after this many experiments (those of a mode's levels)


def _proc_status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def tree_rss(pid: int) -> tuple[int, float]:
    """How many processes `pid` and its descendants are, and their resident memory now (VmRSS, MiB)."""
    pids = _tree(pid)
    return len(pids), round(sum(int(_proc_status(p).get("VmRSS", "0 kB").split()[0]) for p in pids) / 1024, 1)


def peak_rss(front_end_pid: int) -> dict:
    """VmHWM (peak RSS since the process started) and VmRSS of the front end, the sampler and the learner,
    each with its child processes (vLLM's engine core and worker run under the sampler). MiB."""
    roles: dict[str, list[int]] = {"front_end": [front_end_pid]}
    for child in _children(front_end_pid):
        cmd = _cmdline(child)
        role = "sampler" if " -m sampler" in cmd else "learner" if " -m learner" in cmd else f"other:{child}"
        roles.setdefault(role, []).extend(_tree(child))
    result = {}
    for role, pids in roles.items():
        processes = []
        for pid in pids:
            try:
                status = _proc_status(pid)
            except OSError:
                continue
            processes.append({"pid": pid, "name": status.get("Name"),
                              "hwm_mib": round(int(status.get("VmHWM", "0 kB").split()[0]) / 1024, 1),
                              "rss_mib": round(int(status.get("VmRSS", "0 kB").split()[0]) / 1024, 1)})
        result[role] = {"hwm_mib": round(sum(p["hwm_mib"] for p in processes), 1),
                        "rss_mib": round(sum(p["rss_mib"] for p in processes), 1), "processes": processes}
    return result


def snapshot(snapshots: dict, level: int, front_end_pid: int) -> None:
    """`peak_rss` into `snapshots[str(level)]` when `level` is one of MEMORY_AT."""
    if level in MEMORY_AT:
        snapshots[str(level)] = peak_rss(front_end_pid)


def memory_figure(snapshots: dict, trained: dict, levels: list[dict]) -> dict:
    return {"snapshots": snapshots, "first_train_steps": trained,
            "load": [levels[0]["load"][0], loadavg()] if levels else None}
