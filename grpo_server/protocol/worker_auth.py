"""The workers' shared secret: a sampler's or the learner's port answers only callers that send
`Authorization: Bearer <secret>`, i.e. the front end (and the samplers, which fetch adapter files from the
learner).

Without it, whoever reaches a worker's port could train, add or remove experiments, load adapters or read
every adapter version. There is one secret per deployment: made by the front end for the workers it starts,
or given by the operator to every process of a split one (grpo_server/serve.py `worker_secret`). It reaches a
worker through its environment only, never its command line (which every user of the host can read), and
the worker takes it out of its environment at start, so that nothing it starts (vLLM's engine core, the
learner's other ranks) holds it. It also blanks it where the kernel keeps the environment the process
started with, which /proc/PID/environ shows and a forked child (the sampler's engine core) inherits.

The check itself is `protocol/dispatch.py`'s: every route needs the secret, except `GET /health` asked
without any credentials (docker healthchecks, the front end's start-up polls), which then answers only
`{"status": "ok"}`.
"""

from __future__ import annotations

import ctypes
import hmac
import os
from pathlib import Path
from typing import MutableMapping

SECRET_ENV = "GRPO_SERVER_WORKER_SECRET"
HEADER = "Authorization"
MIN_SECRET_CHARS = 16  # secrets.token_urlsafe(32), what the front end makes, is 43


class MissingSecret(RuntimeError):
    """A worker started without a usable secret in its environment."""


def check_secret(secret: str, where: str = SECRET_ENV) -> str:
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise MissingSecret(
            f"{where} must hold the worker secret, at least {MIN_SECRET_CHARS} characters (it is "
            f"{'unset' if not secret else f'{len(secret)} characters'}): the front end sets it for the workers it "
            "starts; a worker run on its own (--role sampler / learner) needs the same one as its front end")
    return secret


def take_secret(environ: MutableMapping[str, str] = os.environ) -> str:
    """The worker's secret, removed from `environ` (so that no process the worker starts inherits it)."""
    secret = environ.pop(SECRET_ENV, "")
    if environ is os.environ and secret:
        blank_start_environment(f"{SECRET_ENV}={secret}".encode())
    return check_secret(secret)


def blank_start_environment(entry: bytes) -> bool:
    """Overwrite `entry` with NULs in this process's starting environment: the block at the top of its stack
    that /proc/self/environ reads (between stat's env_start and env_end, fields 50 and 51). Unsetting a
    variable only drops the pointer to it. Linux only; whether it was found and blanked."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # fields 3 onwards
        start, end = int(after_name[47]), int(after_name[48])
    except (OSError, IndexError, ValueError):
        return False
    at = ctypes.string_at(start, end - start).find(entry) if 0 < start < end else -1
    if at < 0:
        return False
    ctypes.memset(start + at, 0, len(entry))
    return True


def auth_headers(secret: str) -> dict[str, str]:
    """What a caller of a worker sends with every request."""
    return {HEADER: f"Bearer {secret}"}


def presented(header: str | None, secret: str) -> bool | None:
    """None: no credentials at all; True: the right secret; False: anything else (another secret, another
    scheme). Compared in constant time, so the answer's timing tells nothing of how much of it matched."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # bytes: compare_digest refuses non-ASCII str, and a header may hold anything
    return hmac.compare_digest(token.strip().encode("utf-8", "replace"), secret.encode("utf-8"))
