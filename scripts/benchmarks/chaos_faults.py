"""The chaos soak's server and its faults (scripts/benchmarks/chaos.py): a real server it can kill and start again
on the same run directory and port, as compose or Kubernetes would restart its container, and the faults one seed
schedules.

Faults (`KINDS`), each followed by a wait until the server says every worker is ready again (its recovery time):
- `kill_sampler`, `kill_learner`: SIGKILL to the worker's process group; the front end restarts it and re-syncs;
- `kill_front_end`: SIGKILL to the front end and every worker at once (a container killed); the harness starts
  the server again on the same run directory;
- `pause_sampler`, `pause_learner`: SIGSTOP for longer than `worker_timeout_s`, then SIGCONT;
- `disk_full`: the run directory's filesystem filled to the last byte for a while, then emptied again. Only where
  the run directory is a small filesystem of the harness's own (`DiskFiller`: a tmpfs, mounted as root); elsewhere
  the kind is left out and the result says so. Filling a shared disk would take other processes down with it;
- `slow_disk`: every fsync of the server's processes delayed by `SLOW_FSYNC_MS` for a while (`SlowDisk`: a shim
  preloaded into them, chaos_slow_fsync.c, built here with the C compiler; without one, left out);
- `partition_learner`, `partition_sampler`: the front end cut off from a worker for longer than `worker_timeout_s`,
  every packet to and from the worker's port dropped (`Partition`: iptables rules on loopback, as root; elsewhere
  left out);
- `partition_between_hosts`, on the two-host topology only (chaos_hosts.py: the sampler on a second host, a
  network namespace), which takes `partition_sampler`'s place: host B's link goes silent for a while.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from .host import rss_mib

KILLS = ("kill_sampler", "kill_learner", "kill_front_end")
PAUSES = ("pause_sampler", "pause_learner")
PARTITIONS = ("partition_sampler", "partition_learner")  # a worker's port cut on loopback (one host)
BETWEEN_HOSTS = "partition_between_hosts"  # host B's link cut (chaos_hosts.py: the two-host topology)
KINDS = KILLS + PAUSES + ("disk_full", "slow_disk") + PARTITIONS  # one host
# Two hosts: the sampler is on host B, cut off by the partition between hosts rather than on loopback.
TWO_HOST_KINDS = KILLS + PAUSES + ("disk_full", "slow_disk", "partition_learner", BETWEEN_HOSTS)
NOT_INJECTED = {BETWEEN_HOSTS: "one host: `scripts/chaos --two-hosts` runs the two-host topology"}
NOT_INJECTED_TWO_HOSTS = {"partition_sampler": f"two hosts: the sampler is on host B, cut off by {BETWEEN_HOSTS}"}
RECOVERY_TIMEOUT_S = 600.0
SLOW_FSYNC_MS = 2000
SHIM = Path(__file__).with_name("chaos_slow_fsync.c")


class HealthChecks:
    """What the soak asks of any topology's server about its health (ChaosServer here, TwoHosts in chaos_hosts.py):
    its `url`, and `log_tail()` for a failure's message."""

    url: str

    def log_tail(self) -> str:
        raise NotImplementedError

    def gone(self) -> str | None:
        """Why waiting for health is pointless (its front end exited), or None."""
        return None

    def healthy(self) -> bool:
        try:
            answer = requests.get(self.url + "/v1/health", timeout=5)
        except requests.RequestException:
            return False
        return answer.status_code == 200 and answer.json().get("status") == "ok"

    def wait_healthy(self, timeout_s: float = RECOVERY_TIMEOUT_S) -> float:
        """Seconds until its health says ok (every worker ready); TimeoutError after `timeout_s`."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.healthy():
                return time.monotonic() - started
            if (why := self.gone()) is not None:
                raise RuntimeError(f"{why}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"the server was not healthy again after {timeout_s:.0f} s:\n{self.log_tail()}")


class ChaosServer(HealthChecks):
    """The real server (tests/serving.py `start_server`), started again after a kill on the same config."""

    def __init__(self, run_dir: Path, model_dir: Path, **overrides) -> None:
        from tests.serving import start_server

        self.handle = start_server(run_dir, model_dir, **overrides)
        self.run_dir = run_dir
        self.url = self.handle.url
        self.config_path = run_dir / "server.yaml"
        self.starts = 1

    def worker_pid(self, role: str) -> int | None:
        """The pid of the worker whose command is `python -m <role>` (sampler or learner), if it runs now."""
        for pid in self.handle.worker_pids():
            try:
                if role.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                    return pid
            except OSError:
                continue
        return None

    def kill_everything(self) -> None:
        for pid in self.handle.worker_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.handle.process.kill()
        self.handle.process.wait()

    def start_again(self) -> None:
        """`grpo-server serve` on the same config (run directory, port), until its port answers."""
        from tests.serving import STARTUP_TIMEOUT_S

        log = open(self.handle.log_path, "ab")
        self.handle.process = subprocess.Popen(
            [sys.executable, "-m", "grpo_server.cli", "serve", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.starts += 1
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.handle.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.handle.process.returncode} on its restart:\n"
                                   f"{self.handle.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.2)
        raise TimeoutError(f"the server did not come back in {STARTUP_TIMEOUT_S} s:\n{self.handle.log_tail()}")

    def log_tail(self) -> str:
        return self.handle.log_tail()

    def running(self) -> bool:
        return self.handle.process.poll() is None

    def stop(self) -> int:
        from tests.serving import stop_server

        return stop_server(self.handle)

    def front_end_rss_mib(self) -> float | None:
        return rss_mib(self.handle.process.pid)


class DiskFiller:
    """The run directory on a tmpfs of `size_mib`, mounted here (as root), so that filling it hurts nothing else."""

    SOURCE = "grpo-server-chaos"  # the mount's source name: what `sweep` knows an earlier soak's mounts by

    def __init__(self, mount: Path, size_mib: int) -> None:
        self.mount = mount
        self.ballast = mount / ".chaos-ballast"
        mount.mkdir(parents=True, exist_ok=True)
        self.sweep()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", self.SOURCE, str(mount)], check=True,
                       capture_output=True)

    @staticmethod
    def available() -> str | None:
        """None where a tmpfs can be mounted here; else why not."""
        if os.geteuid() != 0:
            return "not root: no filesystem of the harness's own can be mounted for the run directory"
        probe = Path(f"/tmp/chaos-mount-probe-{os.getpid()}")
        probe.mkdir(exist_ok=True)
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True)
            if done.returncode != 0:
                return f"mount refused: {done.stderr.decode(errors='replace').strip()[:200]}"
            subprocess.run(["umount", str(probe)], check=False)
            return None
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    def fill(self) -> None:
        with open(self.ballast, "wb") as f:
            chunk = b"\0" * 2**20
            try:
                while True:
                    f.write(chunk)
            except OSError:  # ENOSPC: full
                pass
            try:
                f.flush()
            except OSError:
                pass

    def empty(self) -> None:
        self.ballast.unlink(missing_ok=True)

    @classmethod
    def sweep(cls) -> None:
        """Unmount the tmpfs of earlier soaks killed before they unmounted theirs (a timeout's SIGTERM runs no
        `finally`): each holds up to its size of memory. One soak runs on a machine at a time."""
        for line in Path("/proc/mounts").read_text().splitlines():
            source, target, *_ = line.split()
            if source == cls.SOURCE:
                subprocess.run(["umount", "-l", target.encode().decode("unicode_escape")], check=False,
                               capture_output=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], check=False, capture_output=True)


class SlowDisk:
    """Every fsync of the server's processes made slow on demand: the shim (chaos_slow_fsync.c) built into
    `work_dir` and preloaded into the server through `env` (its workers inherit it); `slow` and `fast` write the
    delay it reads."""

    def __init__(self, work_dir: Path) -> None:
        self.library = work_dir / "slow_fsync.so"
        self.delay_file = work_dir / "fsync_delay_ms"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(self.library), str(SHIM), "-ldl"], check=True,
                       capture_output=True)
        self.fast()

    @staticmethod
    def available() -> str | None:
        return None if shutil.which("cc") else "no C compiler here to build the fsync shim (chaos_slow_fsync.c)"

    def env(self) -> dict[str, str]:
        preload = " ".join(p for p in (str(self.library), os.environ.get("LD_PRELOAD", "")) if p)
        return {"LD_PRELOAD": preload, "CHAOS_FSYNC_DELAY_FILE": str(self.delay_file)}

    def slow(self, ms: int = SLOW_FSYNC_MS) -> None:
        self.delay_file.write_text(str(ms))

    def fast(self) -> None:
        self.delay_file.write_text("0")


class Partition:
    """The front end cut off from a worker: iptables rules on loopback dropping every packet to and from its port.
    Each rule carries a comment (TAG), so that those of a soak that was killed before it healed (a timeout's
    SIGTERM runs no `finally`) are swept away by the next one: left, they would drop a later server's port. One
    soak runs on a machine at a time."""

    TAG = "grpo-server-chaos"

    def __init__(self) -> None:
        self._rules: list[list[str]] = []
        self.sweep()

    @classmethod
    def sweep(cls) -> None:
        listed = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            if cls.TAG in line and line.startswith("-A "):
                subprocess.run(["iptables", "-D", *shlex.split(line)[1:]], check=False, capture_output=True)

    @staticmethod
    def available() -> str | None:
        if os.geteuid() != 0 or shutil.which("iptables") is None:
            return "not root, or no iptables: a worker's port cannot be cut off here"
        probe = subprocess.run(["iptables", "-L", "INPUT", "-n"], capture_output=True)
        return None if probe.returncode == 0 else f"iptables refused: {probe.stderr.decode(errors='replace')[:200]}"

    def cut(self, port: int) -> None:
        tag = ["-m", "comment", "--comment", self.TAG]
        self._rules = [["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), *tag, "-j", "DROP"],
                       ["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(port), *tag, "-j", "DROP"]]
        for rule in self._rules:
            subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)

    def heal(self) -> None:
        for rule in self._rules:
            subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)
        self._rules = []


def worker_port(run_dir: Path, role: str) -> int | None:
    """The port a worker listens on, from the config it resolved at start (config/<role>.resolved.yaml)."""
    import yaml

    name = "learner" if role == "learner" else "sampler-0"
    try:
        return int(yaml.safe_load((run_dir / "config" / f"{name}.resolved.yaml").read_text())["port"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


@dataclass
class Fault:
    kind: str
    at_s: float  # seconds since the soak began, when it was injected
    held_s: float = 0.0  # how long a pause or a full disk lasted
    recovered_s: float | None = None  # from the fault's end until every worker was ready again
    error: str | None = None


class Injector:
    """One seed's schedule of faults: a fault every `gap_s` (uniform in the range), kinds in a shuffled cycle so
    that every kind comes up as often as the others."""

    def __init__(self, server: ChaosServer, seed: int, kinds: tuple[str, ...], gap_s: tuple[float, float],
                 pause_s: float, disk: DiskFiller | None, full_s: float, slow_disk: SlowDisk | None = None,
                 partition: Partition | None = None) -> None:
        self.server, self.kinds, self.gap_s = server, kinds, gap_s
        self.pause_s, self.disk, self.full_s = pause_s, disk, full_s
        self.slow_disk, self.partition = slow_disk, partition
        self.rng = random.Random(seed)
        self._cycle: list[str] = []

    def next_gap(self) -> float:
        return self.rng.uniform(*self.gap_s)

    def next_kind(self) -> str:
        if not self._cycle:
            self._cycle = list(self.kinds)
            self.rng.shuffle(self._cycle)
        return self._cycle.pop()

    def _until_noticed(self, timeout_s: float = 15.0) -> None:
        """After a kill, until the front end's health says so (at once for a worker it supervises; a remote one
        is noticed after a few missed polls), so that the recovery measured after it is the restart's."""
        deadline = time.monotonic() + timeout_s
        time.sleep(0.5)
        while time.monotonic() < deadline and self.server.healthy():
            time.sleep(0.2)

    def inject(self, kind: str, at_s: float) -> Fault:
        """The fault, then the wait for recovery (blocking: call it on a thread)."""
        fault = Fault(kind, at_s)
        server = self.server
        try:
            if kind == "kill_front_end":
                server.kill_everything()
                started = time.monotonic()
                server.start_again()
                fault.recovered_s = time.monotonic() - started
                return fault
            if kind in ("kill_sampler", "kill_learner", "pause_sampler", "pause_learner"):
                role = kind.split("_")[1]
                pid = server.worker_pid(role)
                if pid is None:
                    fault.error = f"no {role} running"
                    return fault
                if kind.startswith("kill"):
                    os.killpg(pid, signal.SIGKILL)
                    self._until_noticed()
                else:
                    os.killpg(pid, signal.SIGSTOP)
                    time.sleep(self.pause_s)
                    os.killpg(pid, signal.SIGCONT)
                    fault.held_s = self.pause_s
            elif kind == "disk_full":
                self.disk.fill()
                time.sleep(self.full_s)
                self.disk.empty()
                fault.held_s = self.full_s
            elif kind == "slow_disk":
                self.slow_disk.slow()
                time.sleep(self.full_s * 2)
                self.slow_disk.fast()
                fault.held_s = self.full_s * 2
            elif kind == BETWEEN_HOSTS:
                server.partition(self.pause_s)
                fault.held_s = self.pause_s
            elif kind in PARTITIONS:
                port = worker_port(server.run_dir, kind.split("_")[1])
                if port is None:
                    fault.error = f"no port found for {kind}"
                    return fault
                self.partition.cut(port)
                try:
                    time.sleep(self.pause_s)
                finally:
                    self.partition.heal()
                fault.held_s = self.pause_s
            fault.recovered_s = server.wait_healthy()
        except Exception as exc:  # noqa: BLE001 - said in the result; the soak's checks judge what followed
            fault.error = f"{type(exc).__name__}: {exc}"[:500]
        return fault
