"""`grpo-server serve --role ...`: the front end with its workers on one machine (`all`), or one process of a
split deployment (docker-compose: `frontend` connects to the workers named in the config, `sampler` and
`learner` run one worker in the foreground)."""

from __future__ import annotations

import logging
import os
import secrets
import ssl
import sys
from typing import NoReturn
from urllib.parse import urlsplit

from aiohttp import web

from grpo_server.config import ServerConfig
from grpo_server.protocol.cpu_features import read_cpu_features

log = logging.getLogger(__name__)


def admin_key(config: ServerConfig) -> str:
    """The configured key; else the one an earlier run generated into this run directory (a restart
    resumes its experiments, and its clients keep their key); else a fresh one, printed once."""
    if config.api_key is not None:
        return config.api_key.get_secret_value()
    key_file = config.run_dir / "admin_key"
    if key_file.is_file() and key_file.read_text().strip():
        print(f"[grpo-server] no api_key configured; using this run directory's admin key ({key_file})", flush=True)
        return key_file.read_text().strip()
    key = "gs-" + secrets.token_urlsafe(24)
    print(f"[grpo-server] no api_key configured; this run's admin key: {key}", flush=True)
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text(key + "\n")
    os.chmod(key_file, 0o600)
    print(f"[grpo-server] (also written to {key_file})", flush=True)
    return key


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


def serve(config: ServerConfig, role: str = "all", replica: int | None = None) -> int:
    # The kernels this host's workers will run (each worker logs its own too): AVX2 machines are 2-3x slower.
    log.info("%s", read_cpu_features().describe())
    check_role(config, role, replica)
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
    from grpo_server.api.app import create_app

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config.run_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(config, admin_key(config))
    web.run_app(app, host=config.host, port=config.port, print=lambda msg: log.info(msg),
                access_log=None, shutdown_timeout=10, ssl_context=tls_context(config))
    return 0
