"""The chaos soak's two-host topology (`scripts/chaos --two-hosts`, and the benchmark's soak where the machine
allows it): the server split as docker-compose runs it, one `grpo-server serve --role` process per service, on two
hosts. The front end and the learner run on this one; the sampler runs on host B, a network namespace of its own
joined to this one by a veth pair (`HostB`), and is reached at host B's address as a remote worker is. The run
directory is shared, as compose's volume is. The harness restarts a role that exits, as compose's restart policy
does (the front end restarts no remote worker).

Its own fault, `partition_between_hosts`: every packet on host B's end of the link dropped (iptables inside host
B's namespace), for longer than `worker_timeout_s`, then let through again. Connections are not refused, they go
silent: what a switch that fails or a cable pulled looks like to both sides. Its other faults act on the roles:
killing the front end kills its process alone (the workers run on and the new front end takes them over), killing
a worker kills its process, which the harness starts again a second later.

`TwoHosts` answers what the injector and the soak ask of `ChaosServer` (chaos_faults.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from .chaos_faults import HealthChecks
from .host import rss_mib

NETNS = "grpo-chaos-b"
LINK_A, LINK_B = "grpochaos-a", "grpochaos-b"  # this host's end and host B's (interface names: 15 characters)
ADDRESS_A, ADDRESS_B = "10.231.0.1", "10.231.0.2"
RESTART_AFTER_S = 1.0  # a role that exited is started again after this long (compose: restart unless-stopped)
ROLES = ("learner", "sampler", "frontend")  # in start order: the front end opens once both workers answer


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class HostB:
    """A second host: a network namespace with a veth pair to this one (10.231.0.1 here, 10.231.0.2 there)."""

    @staticmethod
    def available() -> str | None:
        """None where network namespaces can be made here (root, `ip`, `iptables`); else why not."""
        if os.geteuid() != 0:
            return "not root: no network namespace can be made for a second host"
        for tool in ("ip", "iptables"):
            if subprocess.run(["which", tool], capture_output=True).returncode != 0:
                return f"no `{tool}` here: no second host in a network namespace"
        probe = f"grpo-chaos-probe-{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns refused: {made.stderr.strip()[:200]}"
        _ip("netns", "del", probe, check=False)
        return None

    def __init__(self) -> None:
        self.sweep()
        _ip("netns", "add", NETNS)
        _ip("link", "add", LINK_A, "type", "veth", "peer", "name", LINK_B)
        _ip("link", "set", LINK_B, "netns", NETNS)
        _ip("addr", "add", f"{ADDRESS_A}/30", "dev", LINK_A)
        _ip("link", "set", LINK_A, "up")
        for args in (("addr", "add", f"{ADDRESS_B}/30", "dev", LINK_B), ("link", "set", LINK_B, "up"),
                     ("link", "set", "lo", "up")):  # vLLM's engine core talks to its server over loopback
            _ip("netns", "exec", NETNS, "ip", *args)
        self._cut = False

    @staticmethod
    def sweep() -> None:
        """What an earlier soak killed before it closed left (a timeout's SIGTERM runs no `finally`). One soak runs
        on a machine at a time."""
        _ip("netns", "del", NETNS, check=False)  # its end of the link and its rules go with it
        _ip("link", "del", LINK_A, check=False)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on host B."""
        return ["ip", "netns", "exec", NETNS, *argv]

    def _rules(self, action: str) -> None:
        for chain, direction in (("INPUT", "-i"), ("OUTPUT", "-o")):
            subprocess.run(["ip", "netns", "exec", NETNS, "iptables", action, chain, direction, LINK_B, "-j", "DROP"],
                           check=action == "-I", capture_output=True)

    def cut(self) -> None:
        """Drop every packet on host B's link, both ways."""
        self._rules("-I")
        self._cut = True

    def heal(self) -> None:
        if self._cut:
            self._rules("-D")
            self._cut = False

    def close(self) -> None:
        self.sweep()


class Role:
    """One `grpo-server serve --role` process (with what it spawns, in its own process group), and its log."""

    def __init__(self, role: str, config_path: Path, log_path: Path, env: dict[str, str],
                 wrap=lambda argv: argv, host: str | None = None) -> None:
        extra = ["--replica", "0"] if role == "sampler" else []
        extra += ["--host", host] if host is not None else []
        self.argv = wrap([sys.executable, "-m", "grpo_server.cli", "serve", "--role", role, "--config",
                          str(config_path), *extra])
        self.role, self.log_path, self.env = role, log_path, env
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        self.starts += 1

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, AttributeError):
            pass

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int | None:
        if self.process is None:
            return None
        self.send(sig)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            return self.process.wait()


class TwoHosts(HealthChecks):
    """The server on two hosts (the module docstring): `ChaosServer`'s interface over three roles."""

    def __init__(self, run_dir: Path, model_dir: Path, **overrides) -> None:
        from tests.serving import ADMIN_KEY, free_port, server_config, worker_env

        self.host_b = HostB()
        self.run_dir = run_dir
        self.config_path = run_dir / "server.yaml"
        sampler_port, learner_port = free_port(), free_port()
        config = server_config(run_dir, model_dir, **overrides)
        config["host"] = "127.0.0.1"  # the front end's; the workers listen on their host's address on the link
        config["sampler"]["urls"] = [f"http://{ADDRESS_B}:{sampler_port}"]
        # Host A's address on the link, which host B reaches (a sampler that cannot see a version's folder copies
        # it from the learner). The front end's calls to it still go over loopback: partition_learner cuts them.
        config["learner"]["url"] = f"http://{ADDRESS_A}:{learner_port}"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{config['port']}"
        self.api_key = ADMIN_KEY
        self.log_path = run_dir / "server.log"  # the front end's, as one-host's server.log
        env = {**worker_env(), "HF_HUB_OFFLINE": "1"}
        logs = run_dir / "logs"
        logs.mkdir(exist_ok=True)
        self.roles = {
            "learner": Role("learner", self.config_path, logs / "learner-role.log", env, host=ADDRESS_A),
            "sampler": Role("sampler", self.config_path, logs / "sampler-role.log", env, self.host_b.command,
                            host=ADDRESS_B),
            "frontend": Role("frontend", self.config_path, self.log_path, env),
        }
        self._stopping = False
        self._restarter = threading.Thread(target=self._restart_forever, name="chaos-restarter", daemon=True)
        try:
            for role in ROLES:
                self.roles[role].start()
            self._restarter.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.starts = 1

    # --- compose's restart policy, for the workers (the front end's restart is `start_again`) ---------------

    def _restart_forever(self) -> None:
        while not self._stopping:
            for name in ("learner", "sampler"):
                role = self.roles[name]
                if not role.running() and not self._stopping:
                    time.sleep(RESTART_AFTER_S)
                    if not self._stopping:
                        role.start()
            time.sleep(0.2)

    # --- what the injector and the soak ask ------------------------------------------------------------------

    def worker_pid(self, role: str) -> int | None:
        worker = self.roles.get(role)
        return worker.process.pid if worker is not None and worker.running() else None

    def kill_everything(self) -> None:
        """The front end's container killed: its process alone (the workers, on their hosts, run on)."""
        self.roles["frontend"].send(signal.SIGKILL)
        self.roles["frontend"].process.wait()

    def start_again(self) -> None:
        self.roles["frontend"].start()
        self.starts += 1
        self.wait_healthy()

    def partition(self, held_s: float) -> None:
        """`partition_between_hosts`: host B cut off for `held_s`, then let through."""
        self.host_b.cut()
        try:
            time.sleep(held_s)
        finally:
            self.host_b.heal()

    def gone(self) -> str | None:
        frontend = self.roles["frontend"]
        return None if frontend.running() else f"the front end exited with {frontend.process.returncode}"

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def running(self) -> bool:
        return not self._stopping

    def stop(self) -> int:
        """Every role stopped as `docker compose down` would (SIGTERM); the front end's exit code."""
        self._stopping = True
        if self._restarter.is_alive():
            self._restarter.join(timeout=10)
        code = self.roles["frontend"].stop(signal.SIGINT)
        for name in ("sampler", "learner"):
            self.roles[name].stop()
        self.host_b.close()
        return code if code is not None else -1

    def front_end_rss_mib(self) -> float | None:
        frontend = self.roles["frontend"]
        return rss_mib(frontend.process.pid) if frontend.running() else None
