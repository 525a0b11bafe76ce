"""What tests/test_fuzz.py counts as it fuzzes (split from tests/fuzz_schema.py): cases and statuses per test and
operation, statuses and error codes per kind of call (stream, episode turn, episode rating), and the summary its
last test prints (and writes where GRPO_FUZZ_REPORT names a file)."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from typing import Any, Iterable

import schemathesis

from grpo_server.api.app import ENDPOINTS
from tests.fuzz_schema import EPISODE_PREFIX

COUNTS: dict[str, Counter] = defaultdict(Counter)  # test -> "METHOD /path" -> cases
STATUSES: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))  # test -> operation -> status
KINDS: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))  # test -> kind of call -> status
SPANS: dict[str, list[float]] = {}  # test -> [first call, last call] (time.time())


DECLARED = {f"{e.method} {e.path}" for e in ENDPOINTS}


def record(test: str, method: str, path: str, status: int, kinds: Iterable[str] = (),
           code: str | None = None) -> None:
    """One case sent; `kinds` (`kinds_of`), with the error's code when there is one (`error_code`)."""
    label = f"{method.upper()} {path}"
    label = label if label in DECLARED else "undeclared methods"  # the coverage phase's probes
    COUNTS[test][label] += 1
    STATUSES[test][label][status] += 1
    for kind in kinds:
        KINDS[test][kind][str(status) if code is None else f"{status} {code}"] += 1
    now = time.time()
    SPANS.setdefault(test, [now, now])[1] = now


def error_code(status: int, content: bytes) -> str | None:
    """An error answer's `error.code` (None for a success, or an error that is not ErrorBody JSON)."""
    if status < 400:
        return None
    try:
        return str(json.loads(content)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def kinds_of(case: schemathesis.Case) -> list[str]:
    """The kinds of call a case is, beside its operation: the streaming and episode ones (so the record shows
    that they were sent, and what came back)."""
    body, kinds = case.body, []
    path = case.path.replace("/v1/experiments/{name}/", "native ").replace("/v1/", "openai ")
    if not isinstance(body, dict) or case.method.upper() != "POST":
        return kinds
    if path in ("openai chat/completions", "openai completions") and body.get("stream") is True:
        kinds.append(f"{path}: stream")
    episode = body.get("episode_id") is not None or any(k.lower() == "x-episode-id" for k in case.headers or {})
    if path.endswith("completions") and episode:
        kinds.append(f"{path}: episode turn" + (" (X-Episode-Id header)" if body.get("episode_id") is None else ""))
        if body.get("stream") is True and path.startswith("openai"):
            kinds.append(f"{path}: streamed episode turn")
    if path == "native feedback" and body.get("episode_ids") is not None:
        kinds.append("native feedback: episode_ids")
        ids = body["episode_ids"]
        if isinstance(ids, list) and all(isinstance(i, str) and i.startswith(EPISODE_PREFIX) for i in ids):
            kinds.append("native feedback: episode_ids of sampled episodes")  # `shape`'s, from an Episodes book
    if path == "native feedback" and body.get("group_id") is not None:
        kinds.append("native feedback: group_id")
    return kinds


def summary() -> dict[str, Any]:
    """Cases, statuses per operation and per kind of call, and each test's span, per test (JSON-ready)."""
    return {test: {"cases": sum(COUNTS[test].values()), "seconds": round(SPANS[test][1] - SPANS[test][0], 1),
                   "operations": {label: dict(sorted(statuses.items()))
                                  for label, statuses in sorted(STATUSES[test].items())},
                   "kinds": {kind: dict(sorted(statuses.items())) for kind, statuses in sorted(KINDS[test].items())}}
            for test in COUNTS}
