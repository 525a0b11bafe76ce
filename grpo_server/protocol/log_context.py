"""One log format for every process (front end, samplers, learner ranks): plain lines, or JSON lines when asked
(`log_format: json` in the server config, or GRPO_SERVER_LOG_FORMAT, which the workers inherit), with the
experiment, the adapter version and the request id of the work a line is about, on every line where they are known.

They are context variables, bound where the work starts (`bound`): the front end's middleware binds a request's id
(the client's X-Request-Id, or a new one) and the experiment in its path; a train step binds its own id and the
version it trains from. The front end sends them to a worker with every verb (`CONTEXT_HEADERS`) and the worker
binds them while it serves it, so a request's lines carry the same id in the front end's log and the workers'.
asyncio tasks and `asyncio.to_thread` copy the context, so work a request spawns keeps its id. Libraries that
install handlers of their own (vLLM, DeepSpeed) keep their formats: only lines through the root logger are ours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import sys
from contextvars import ContextVar
from typing import Iterator, Literal, Mapping

LogFormat = Literal["plain", "json"]
FORMAT_ENV = "GRPO_SERVER_LOG_FORMAT"
REQUEST_ID_HEADER = "X-Request-Id"
# Front end -> worker: the fields bound where the verb was called.
CONTEXT_HEADERS = {"request_id": REQUEST_ID_HEADER, "experiment": "X-Grpo-Experiment", "version": "X-Grpo-Version"}
# A client's own id is kept when it is short and plain (it goes into every line and back in the answer's header).
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
FIELDS = ("experiment", "version", "request_id")

_context: dict[str, ContextVar[str | int | None]] = {field: ContextVar(field, default=None) for field in FIELDS}


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def current() -> dict[str, str | int]:
    """The fields bound here, without the unknown ones."""
    return {field: value for field, var in _context.items() if (value := var.get()) is not None}


@contextlib.contextmanager
def bound(**fields: str | int | None) -> Iterator[None]:
    """Bind these fields (None: leave as bound) until the block ends."""
    tokens = [(_context[field], _context[field].set(value)) for field, value in fields.items() if value is not None]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def context_headers() -> dict[str, str]:
    """The bound fields as a worker verb's headers."""
    return {CONTEXT_HEADERS[field]: str(value) for field, value in current().items()}


def from_headers(headers: Mapping[str, str]) -> dict[str, str | int | None]:
    """The fields a verb's headers carry (what `context_headers` wrote), ready for `bound`."""
    fields: dict[str, str | int | None] = {}
    for field, header in CONTEXT_HEADERS.items():
        value = headers.get(header)
        if value is None or not CLIENT_REQUEST_ID.fullmatch(value):
            continue
        fields[field] = int(value) if field == "version" and value.isdigit() else value
    return fields


class ContextFilter(logging.Filter):
    """Puts the bound fields on each record (a field given in `extra=` wins), for the formatters."""

    def filter(self, record: logging.LogRecord) -> bool:
        for field, var in _context.items():
            if getattr(record, field, None) is None:
                setattr(record, field, var.get())
        return True


class PlainFormatter(logging.Formatter):
    """`time level process logger: message [experiment=... version=... request=...]`."""

    def __init__(self, process: str):
        super().__init__(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tags = " ".join(f"{label}={value}" for label, value in (
            ("experiment", getattr(record, "experiment", None)), ("version", getattr(record, "version", None)),
            ("request", getattr(record, "request_id", None))) if value is not None)
        if not tags:
            return line
        head, newline, rest = line.partition("\n")  # after the message, before a traceback
        return f"{head} [{tags}]{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (seconds since the epoch), level, process, logger, message, the bound fields
    that are known, and the exception's traceback as one string."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {"time": round(record.created, 6), "level": record.levelname,
                                   "process": self.process, "logger": record.name, "message": record.getMessage()}
        for field in FIELDS:
            if (value := getattr(record, field, None)) is not None:
                line[field] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(process: str, fmt: LogFormat | None = None, level: int = logging.INFO) -> LogFormat:
    """The root logger's one handler, on stderr, in `fmt` (default: GRPO_SERVER_LOG_FORMAT, else plain). Called
    again (the front end once its config is read), it replaces the handler. The format chosen is exported, so the
    workers this process starts log the same way."""
    fmt = fmt or ("json" if os.environ.get(FORMAT_ENV, "").strip().lower() == "json" else "plain")
    os.environ[FORMAT_ENV] = fmt
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "grpo_server_format", None)]
    if root.handlers and not ours:
        return fmt  # configured by whoever runs us in-process (pytest, an application): theirs stay, as basicConfig
    for old in ours:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else PlainFormatter(process))
    handler.grpo_server_format = fmt  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    return fmt
