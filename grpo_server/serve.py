"""`grpo-server serve --role ...`: the front end with its workers on one machine (`all`), or one process of a
split deployment (docker-compose: `frontend` connects to the workers named in the config, `sampler` and
`learner` run one worker in the foreground)."""

from __future__ import annotations

import logging
import os
import secrets
import ssl
import sys
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

from aiohttp import web

from grpo_server.config import ServerConfig
from grpo_server.protocol.cpu_features import read_cpu_features
from grpo_server.protocol.durable import restrict_umask
from grpo_server.protocol.listen import bind_early
from grpo_server.protocol.worker_auth import SECRET_ENV

log = logging.getLogger(__name__)


def admin_key(config: ServerConfig) -> str:
    """The configured key; else the one an earlier run generated into this run directory (a restart
    resumes its experiments, and its clients keep their key); else a fresh one, written there (0600). Never
    printed: a log is read by more people, and kept longer, than the key should be."""
    if config.api_key is not None:
        return config.api_key.get_secret_value()
    key_file = config.run_dir / "admin_key"
    if key_file.is_file() and key_file.read_text().strip():
        print(f"[grpo-server] no api_key configured; using this run directory's admin key ({key_file})", flush=True)
        return key_file.read_text().strip()
    key = "gs-" + secrets.token_urlsafe(24)
    write_private(key_file, key + "\n")
    print(f"[grpo-server] no api_key configured; this run's admin key is in {key_file} (mode 0600)", flush=True)
    return key


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by this user alone from its first byte (created 0600, then renamed into
    place: never a moment at the umask's mode, as a write and a chmod after it would leave)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)
    os.replace(tmp, path)


def worker_secret(config: ServerConfig) -> str:
    """The workers' secret (grpo_server/protocol/worker_auth.py), left in `config.worker_secret` for the
    workers' launch: the configured one, else one made for this start. Not reused from an earlier start,
    unlike the admin key: the workers it guards start and stop with this front end. Written to
    <run_dir>/worker_secret (0600) for the operator's own calls to them; never printed."""
    if config.worker_secret is not None:
        return config.worker_secret.get_secret_value()
    secret = secrets.token_urlsafe(32)
    path = config.run_dir / "worker_secret"
    write_private(path, secret + "\n")
    config.worker_secret = secret  # validate_assignment makes it a SecretStr
    log.info("the workers' secret for this start is in %s", path)
    return secret


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    if config.tls_certfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_certfile, config.tls_keyfile)  # fails at start, not at first client
    return context


ROLES = ("all", "frontend", "sampler", "learner")


class RoleError(ValueError):
    """The config does not fit the role asked for; the message says what to set."""


def check_role(config: ServerConfig, role: str, replica: int | None) -> None:
    """Fail before anything starts when the config and the role disagree."""
    if role not in ROLES:
        raise RoleError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    if replica is not None and role != "sampler":
        raise RoleError("--replica is for --role sampler")
    if replica is not None and replica < 0:
        raise RoleError(f"--replica must be 0 or more, got {replica}")
    if role == "frontend" and not config.remote_workers:
        raise RoleError("--role frontend connects to workers it does not start: set sampler.urls and learner.url "
                        "in the config")
    if role == "all" and config.remote_workers:
        raise RoleError("sampler.urls / learner.url name remote workers: run the front end with --role frontend "
                        "(--role all starts its own workers)")
    if role == "sampler":
        replica = replica or 0
        s = config.sampler
        count = len(s.urls) if s.urls else s.replicas
        if replica >= count:
            raise RoleError(f"--replica {replica}, but the config has {count} sampler replica(s) "
                            f"({'sampler.urls' if s.urls else 'sampler.replicas'})")
        if not s.urls and not s.base_port:
            raise RoleError("--role sampler needs a known port: set sampler.urls (the front end connects there) "
                            "or sampler.base_port")
    if role == "learner" and config.learner.url is None and not config.learner.port:
        raise RoleError("--role learner needs a known port: set learner.url (the front end connects there) "
                        "or learner.port")
    if role != "all" and config.worker_secret is None:
        raise RoleError(f"--role {role} is one process of a split deployment, whose processes must share one "
                        f"worker secret: set {SECRET_ENV} (the same in every process's environment; e.g. from "
                        "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`) or worker_secret in the "
                        "config")


def serve(config: ServerConfig, role: str = "all", replica: int | None = None) -> int:
    # Every file the run directory gets (journal, registries, metrics, logs, configs, checkpoints, adapter
    # versions) is 0640 and every folder 0750, never world-readable: the workers started here, or exec'd for a
    # split role, inherit this umask.
    restrict_umask()
    # The kernels this host's workers will run (each worker logs its own too): AVX2 machines are 2-3x slower.
    log.info("%s", read_cpu_features().describe())
    check_role(config, role, replica)
    worker_secret(config)
    if role in ("sampler", "learner"):
        return run_worker(config, role, replica or 0)
    return serve_front_end(config)


def run_worker(config: ServerConfig, role: str, replica: int) -> NoReturn:
    """Become the worker process (exec): the same command, config file and environment the front end of
    `--role all` would use, so signals (docker stop) and the exit code are the worker's own."""
    from grpo_server.workers.launch import WorkerSet

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if role == "learner" and config.learner.url is not None:
        config.learner.port = urlsplit(config.learner.url).port  # listen where the front end connects
    # The worker listens on `host` (0.0.0.0 in a container, so the front end's container reaches it).
    spec = WorkerSet(config, worker_host=config.host).worker_spec(role, replica)
    log.info("%s: exec %s", spec.name, " ".join(spec.argv))
    sys.stdout.flush()
    sys.stderr.flush()
    # Unbuffered, as under the front end: the worker's prints reach `docker logs` at once.
    os.execvpe(spec.argv[0], spec.argv, {**os.environ, "PYTHONUNBUFFERED": "1", **(spec.env or {})})


def serve_front_end(config: ServerConfig) -> int:
    # The port is bound now and listened on once the workers are healthy (a probe is refused until then). Bound
    # only then, it was free for tens of seconds while the workers' ports, vLLM's ZMQ sockets and torch's store
    # took ports of their own, and one of them could take it (the suite's servers listen on ports the kernel
    # picked). A port in use now fails at once, not after the workers' start.
    try:
        listening = bind_early(config.host, config.port)
    except OSError as exc:
        print(f"grpo-server serve: cannot bind {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 2
    from grpo_server.api.app import create_app

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config.run_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(config, admin_key(config))
    web.run_app(app, sock=listening, print=lambda msg: log.info(msg),
                access_log=None, shutdown_timeout=10, ssl_context=tls_context(config))
    return 0
