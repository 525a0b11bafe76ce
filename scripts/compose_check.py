"""scripts/compose-check: the CPU compose stack (docker-compose.cpu.yml) built and run on this machine.

    scripts/compose-check                 # set-up, build, up, the checks below, down
    scripts/compose-check --no-build      # use the grpo-server:cpu image as it is

Phases, each timed:
  setup    Docker (docker.io + docker-compose from apt where missing, as root), dockerd started where it does not
           answer (niced, `--bridge=none`: all traffic stays on loopback), the local base image made where
           BASE_IMAGE is the default grpo-server-base:bookworm and missing (scripts/make-base-image).
  build    `docker build --network host` of the Dockerfile with EXTRA=cpu; the CPU torch wheel comes from
           pip's local wheel folder, served on 127.0.0.1 for the build (PyPI has only the CUDA torch), or
           from PyTorch's CPU index where there is no such folder.
  up       `compose up -d` (front end, sampler-0, learner, each its own container, host network), until the
           front end reports both workers ready and Docker reports all three containers healthy.
  train    groups sampled and rated through grpo_server.client.Client until a new adapter version is pushed,
           loaded by the sampler and served.
  sampler  the sampler's process killed (SIGKILL, as a crash would; `docker kill` would not do: Docker
           treats it as a manual stop and the restart policy does not apply): the container restarts, the
           front end re-syncs it, and it serves the live version.
  frontend the front end's container restarted: it takes the workers over and the experiment resumes.
  down     `compose down -v`, also after a failure (the containers' last log lines are printed first).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from urllib.request import Request, urlopen

import yaml

from grpo_server.client import Client, GrpoServerError
from grpo_server.protocol.codec import unpack
from grpo_server.protocol.wire import AdapterRef
from grpo_server.protocol.worker_auth import SECRET_ENV, auth_headers

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = "docker-compose.cpu.yml"
CONFIG = yaml.safe_load((REPO / "configs" / "compose" / "cpu.yaml").read_text())
FRONT_URL = f"http://127.0.0.1:{CONFIG['port']}"
SAMPLER_URL = CONFIG["sampler"]["urls"][0]
WHEEL_PORT = 8489  # the build's loopback wheel server (the stack itself uses 8480-8482)
SERVICES = ("frontend", "sampler-0", "learner")
LOCAL_BASE = "grpo-server-base:bookworm"
MIN_FREE_GIB = 8  # the three containers take about 5 GiB; this box is shared
EXPERIMENT = "compose-check"

START = time.monotonic()


def log(message: str) -> None:
    print(f"[compose-check {time.monotonic() - START:6.0f}s] {message}", flush=True)


class Phases:
    """Wall time of each phase, printed as one line at the end (also after a failure)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        log(f"--- {name}")
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - started
            log(f"--- {name}: {self.seconds[name]:.0f} s")

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.0f} s" for name, seconds in self.seconds.items())


def run(*command: str, check: bool = True, capture: bool = False, timeout: float | None = 600,
        env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, check=check, text=True, timeout=timeout, env=env,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)


def works(*command: str) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command() -> list[str] | None:
    """Compose v2 (`docker compose`) where the plugin is installed, else Debian's docker-compose 1.29."""
    if works("docker", "compose", "version"):
        return ["docker", "compose"]
    if works("docker-compose", "version"):
        return ["docker-compose"]
    return None


def wait_until(what: str, check, timeout_s: float, interval_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)


# --- setup and build ------------------------------------------------------------------------------------

def setup(base_image: str) -> None:
    if not shutil.which("dockerd") or compose_command() is None:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            sys.exit("compose-check: Docker or compose is missing; install docker.io and docker-compose (as root)")
        log("installing docker.io and docker-compose with apt-get")
        run("apt-get", "update", "-qq")
        run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker.io", "docker-compose",
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if not works("docker", "info"):
        if os.geteuid() != 0:
            sys.exit("compose-check: dockerd does not answer and this is not root to start it")
        # Niced: the containers and builds are its children and so niced too. No bridge: containers use
        # the host's network, on loopback ports (configs/compose/cpu.yaml).
        log("starting dockerd (nice 19, --bridge=none; log in /tmp/dockerd.log)")
        with open("/tmp/dockerd.log", "ab") as out:
            subprocess.Popen(["nice", "-n", "19", "dockerd", "--bridge=none"], stdout=out, stderr=out,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until("dockerd answering", lambda: works("docker", "info"), timeout_s=120)
    if base_image == LOCAL_BASE and not works("docker", "image", "inspect", base_image):
        run("scripts/make-base-image", env={**os.environ, "BASE_IMAGE": base_image}, timeout=1800)


def local_wheel_folder() -> Path | None:
    """pip's local find-links folder (it holds the CPU torch wheel on this kind of box), if any."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            values += value.strip("'\"").split()
    folders = [Path(v.removeprefix("file://")) for v in values if not v.startswith(("http:", "https:"))]
    return next((f for f in folders if f.is_dir() and any(f.glob("torch-*+cpu-*.whl"))), None)


@contextmanager
def wheel_server(folder: Path):
    """The folder as a find-links page on 127.0.0.1 for the build's pip (`--network host`), for the build only."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{WHEEL_PORT}/"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def build(image: str, base_image: str, log_dir: Path) -> None:
    command = ["nice", "-n", "19", "docker", "build", "--network", "host", "-t", image,
               "--build-arg", f"BASE_IMAGE={base_image}", "--build-arg", "EXTRA=cpu"]
    folder = local_wheel_folder()
    build_log = log_dir / "build.log"
    with (wheel_server(folder) if folder else nullcontext()) as links:
        if links:
            log(f"CPU torch from {folder}, served at {links} for the build")
            command += ["--build-arg", f"PIP_FIND_LINKS={links}"]
        else:
            command += ["--build-arg", "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"]
        log(f"{' '.join(command)} . (log: {build_log})")
        with build_log.open("w") as out:
            result = subprocess.run([*command, "."], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
    if result.returncode != 0:
        print("".join(build_log.read_text().splitlines(keepends=True)[-30:]))
        raise RuntimeError(f"docker build failed (exit {result.returncode}); the whole log: {build_log}")


# --- the stack ------------------------------------------------------------------------------------------

class Stack:
    def __init__(self, compose: list[str], image: str, project: str) -> None:
        self.base = [*compose, "-f", COMPOSE_FILE, "-p", project]
        self.api_key = secrets.token_urlsafe(16)
        # The workers' secret, as an operator gives it: in the environment compose hands every service.
        self.worker_secret = secrets.token_urlsafe(32)
        self.env = {**os.environ, "GRPO_SERVER_API_KEY": self.api_key, SECRET_ENV: self.worker_secret,
                    "GRPO_IMAGE": image}
        self.env.pop("GRPO_CONFIG", None)  # the CPU config, whatever the shell has

    def compose(self, *args: str, capture: bool = False, check: bool = True) -> subprocess.CompletedProcess:
        return run(*self.base, *args, capture=capture, check=check, env=self.env)

    def container(self, service: str) -> str:
        container_id = self.compose("ps", "-q", service, capture=True).stdout.strip()
        if not container_id:
            raise RuntimeError(f"no container for {service}")
        return container_id

    def inspect(self, service: str, template: str) -> str:
        return run("docker", "inspect", "-f", template, self.container(service), capture=True).stdout.strip()

    def healthy(self) -> bool:
        states = {s: self.inspect(s, "{{.State.Health.Status}}") for s in SERVICES}
        return all(state == "healthy" for state in states.values())

    def client(self) -> Client:
        return Client(FRONT_URL, self.api_key, timeout_s=600)

    def workers_ready(self) -> bool:
        try:
            with self.client() as client:
                health = client.health()
        except (OSError, GrpoServerError):
            return False
        return health.status == "ok" and all(state == "ready" for state in health.workers.values())

    def worker_state(self, worker: str) -> str | None:
        try:
            with self.client() as client:
                return client.health().workers.get(worker)
        except (OSError, GrpoServerError):
            return None

    def last_logs(self) -> None:
        self.compose("logs", "--no-color", "--tail", "25", check=False)


def free_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def sampler_versions(secret: str) -> list[int]:
    """The experiment's adapter versions the sampler holds (its /health lists `name@vN` to the secret's holders)."""
    with urlopen(Request(SAMPLER_URL + "/health", headers=auth_headers(secret)), timeout=10) as response:
        adapters = unpack(response.read())["adapters"]
    refs = [AdapterRef.from_key(a) for a in adapters]  # `name@vN.<life>`
    return sorted(r.version for r in refs if r.name == EXPERIMENT)


def check_loaded(version: int, secret: str) -> list[int]:
    """The sampler holds `version` or a newer one (rated groups still queued may push more; the old go)."""
    loaded = sampler_versions(secret)
    assert loaded and loaded[-1] >= version, (loaded, version)
    return loaded


def complete(client: Client, **kwargs):
    """client.complete, waiting out 429s (back-pressure while the learner catches up)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            return client.complete(EXPERIMENT, **kwargs)
        except GrpoServerError as exc:
            if exc.status != 429 or time.monotonic() > deadline:
                raise
            time.sleep(exc.retry_after or 0.5)


def serves(client: Client, version: int, prompt: str) -> int:
    """A completion at `version` (the front end serves a version once every sampler has loaded it)."""
    def at_version():
        return complete(client, prompt=prompt).policy_version >= version
    wait_until(f"a completion at v{version}", at_version, timeout_s=300, interval_s=0.5)
    return version


def train(stack: Stack) -> int:
    with stack.client() as client:
        client.create_experiment({"name": EXPERIMENT, "algorithm": {"batch_groups": 1, "learning_rate": 1e-2},
                                  "sampling": {"n": 2, "max_tokens": 8}})
        groups = 0

        def pushed():
            nonlocal groups
            group = complete(client, prompt="Pick a number")
            client.feedback(EXPERIMENT, group.group_id, [1.0, 0.0])
            groups += 1
            return client.status(EXPERIMENT).policy_version >= 1

        wait_until("a new adapter version", pushed, timeout_s=900, interval_s=0.2)
        version = client.status(EXPERIMENT).policy_version
        serves(client, version, "Pick a number")
    loaded = check_loaded(version, stack.worker_secret)
    log(f"v{version} pushed after {groups} rated groups and served; the sampler holds versions {loaded}")
    return version


def crash_sampler(stack: Stack, version: int) -> None:
    restarts = int(stack.inspect("sampler-0", "{{.RestartCount}}"))
    init_pid = stack.inspect("sampler-0", "{{.State.Pid}}")  # the container's init (`init: true`)
    children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    log(f"SIGKILL to the sampler's process ({', '.join(children)}; container init {init_pid})")
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
    wait_until("the sampler container restarted",
               lambda: int(stack.inspect("sampler-0", "{{.RestartCount}}")) > restarts, timeout_s=120, interval_s=0.5)
    log(f"restarted by Docker (RestartCount {restarts} -> {stack.inspect('sampler-0', '{{.RestartCount}}')})")
    wait_until("the front end seeing sampler-0 down", lambda: stack.worker_state("sampler-0") == "down",
               timeout_s=120, interval_s=0.5)
    log("the front end reports sampler-0 down")
    wait_until("sampler-0 re-synced", lambda: stack.worker_state("sampler-0") == "ready", timeout_s=900)
    with stack.client() as client:
        live = client.status(EXPERIMENT).policy_version
        loaded = check_loaded(live, stack.worker_secret)  # re-synced: the live version is back in the restarted sampler
        group = complete(client, prompt="Back?")
    assert group.policy_version >= live >= version, (group.policy_version, live, version)
    log(f"sampler-0 ready again, holding versions {loaded}, serving v{group.policy_version}")


def restart_frontend(stack: Stack, version: int) -> None:
    stack.compose("restart", "frontend")
    wait_until("the front end ready again", stack.workers_ready, timeout_s=600)
    with stack.client() as client:
        resumed = client.status(EXPERIMENT)
        assert resumed.policy_version >= version, (resumed.policy_version, version)
        group = complete(client, prompt="Hello again")
        assert group.policy_version >= resumed.policy_version, (group.policy_version, resumed.policy_version)
    log(f"the experiment resumed at v{resumed.policy_version} and is served")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-build", action="store_true", help="use the image as it is")
    parser.add_argument("--image", default=os.environ.get("GRPO_IMAGE", "grpo-server:cpu"))
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE", LOCAL_BASE),
                        help="the Dockerfile's BASE_IMAGE (e.g. python:3.11-slim where a registry is reachable)")
    parser.add_argument("--project", default="grpo-compose-check", help="the compose project name")
    args = parser.parse_args(argv)
    # SIGTERM (a test runner's timeout) unwinds like Ctrl-C, so the stack still goes down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = REPO / "runs" / "compose-check"
    log_dir.mkdir(parents=True, exist_ok=True)
    phases, stack, passed = Phases(), None, False
    try:
        with phases("setup"):
            setup(args.base_image)
        if not args.no_build:
            with phases("build"):
                build(args.image, args.base_image, log_dir)
        stack = Stack(compose_command(), args.image, args.project)
        with phases("up"):
            stack.compose("down", "-v", "--remove-orphans", capture=True)  # what an interrupted run left
            wait_until(f"{MIN_FREE_GIB} GiB of memory available (now {free_gib():.1f})",
                       lambda: free_gib() >= MIN_FREE_GIB, timeout_s=1800, interval_s=10)
            stack.compose("up", "-d")
            wait_until("the front end with both workers ready", stack.workers_ready, timeout_s=900)
            wait_until("Docker's health checks", stack.healthy, timeout_s=120)
        with phases("train"):
            version = train(stack)
        with phases("sampler crash"):
            crash_sampler(stack, version)
        with phases("front-end restart"):
            restart_frontend(stack, version)
        passed = True
    except BaseException as exc:
        log(f"FAILED: {type(exc).__name__}: {exc}")
        if stack is not None:
            stack.last_logs()
        if not isinstance(exc, Exception):
            raise
    finally:
        if stack is not None:
            with phases("down"):
                stack.compose("down", "-v", "--remove-orphans", check=False)
        log(f"phases: {phases.summary()}")
    total = time.monotonic() - START
    print(f"compose-check: {'passed' if passed else 'FAILED'} in {total:.0f} s ({phases.summary()})", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
