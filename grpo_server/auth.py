"""Bearer keys: the admin key manages everything; an experiment's own key reaches that experiment only.

Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from typing import Iterable

from aiohttp import web

from grpo_server.config import ExperimentConfig
from grpo_server.errors import Forbidden, Unauthorized

ADMIN = "admin"


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing 'Authorization: Bearer <key>' header", code="missing_key")
    return token.strip()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def principal(request: web.Request, admin_key: str, experiments: Iterable[ExperimentConfig]) -> str:
    """ADMIN, or the name of the experiment whose key was given. 401 for an unknown key."""
    token = _bearer(request)
    if _same(token, admin_key):
        return ADMIN
    found = None
    for config in experiments:  # every key is compared, so timing does not reveal which matched
        if config.api_key is not None and _same(token, config.api_key.get_secret_value()):
            found = config.name
    if found is None:
        raise Unauthorized("invalid API key", code="invalid_key")
    return found


def require(who: str, experiment: str | None = None, admin_only: bool = False) -> None:
    if who == ADMIN:
        return
    if admin_only:
        raise Forbidden("this call needs the admin key", code="admin_only")
    if experiment is not None and who != experiment:
        raise Forbidden("this key does not grant access to that experiment", code="wrong_experiment")
