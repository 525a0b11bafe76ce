"""`grpo-server serve`: the front end with its workers on one machine."""

from __future__ import annotations

import logging
import os
import secrets
import ssl

from aiohttp import web

from grpo_server.config import ServerConfig

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


def serve(config: ServerConfig) -> int:
    from grpo_server.app import create_app

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config.run_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(config, admin_key(config))
    web.run_app(app, host=config.host, port=config.port, print=lambda msg: log.info(msg),
                access_log=None, shutdown_timeout=10, ssl_context=tls_context(config))
    return 0
