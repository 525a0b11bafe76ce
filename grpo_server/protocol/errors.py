"""Domain errors of the front end, and the one place where they become HTTP statuses."""

from __future__ import annotations

import re

from pydantic import ValidationError


# OpenAI's error object has a `type` besides its `code`: the OpenAI-compatible routes give one by status (the
# statuses not named here: invalid_request_error below 500, server_error from it).
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# Anthropic's error `type`s by status, as its Messages API documents them (the statuses not named here:
# invalid_request_error below 500, api_error from it). A 503 (a worker down: retry) is its "overloaded" (529).
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}


class ApiError(Exception):
    """An error a client sees as `{"error": {"code", "message"}}` with `status`; the OpenAI-compatible routes add
    `type` and `param` (`openai_body`); the Anthropic-compatible ones answer in Anthropic's shape (`anthropic_body`)."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 retry_after: float | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after
        self.param = param  # the request field at fault, where one is (OpenAI's `param`: "tools.0", "top_p")

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}

    def openai_body(self) -> dict:
        """As the OpenAI-compatible routes answer it: OpenAI's error object, which the Open Responses spec's
        `ErrorPayload` requires whole (`type`, `code`, `message`, `param`)."""
        kind = "server_error" if self.status >= 500 else _OPENAI_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"code": self.code, "message": self.message, "type": kind, "param": self.param}}

    def anthropic_body(self) -> dict:
        """As the Anthropic-compatible routes answer it: the Messages API's `{"type": "error", "error": {"type",
        "message"}}`, which the `anthropic` package reads, with our `code` beside them."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message, "code": self.code}}


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class Unprocessable(ApiError):
    status, code = 422, "unprocessable"


class TooManyRequests(ApiError):
    """Back-pressure: the learner lags behind the feedback; retry after a while."""

    status, code = 429, "too_many_requests"

    def __init__(self, message: str, retry_after: float = 5.0, **kwargs):
        super().__init__(message, retry_after=retry_after, **kwargs)


class Unavailable(ApiError):
    """A worker is down or restarting: the client should retry."""

    status, code = 503, "unavailable"

    def __init__(self, message: str, retry_after: float = 5.0, **kwargs):
        super().__init__(message, retry_after=retry_after, **kwargs)


class WorkerFailed(ApiError):
    """A worker answered with an internal error: reported, never hidden (its text in the front end's log, the
    client gets a fixed message with an incident id: grpo_server/workers/pool.py)."""

    status, code = 502, "worker_error"


def validation_param(exc: ValidationError) -> str | None:
    """The first bad field of a pydantic error, dotted ("input.0.call_id"); None for the body as a whole."""
    errors = exc.errors()
    return (".".join(str(p) for p in errors[0]["loc"]) or None) if errors else None


def describe_validation_error(exc: ValidationError, most: int = 10) -> str:
    """A pydantic error as one line naming each bad field (the first `most` of them)."""
    return "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
                     for error in exc.errors()[:most])


# An absolute path (a run directory, a model folder, a source file) and a URL (a worker's address): the server's
# own layout, which no client needs. A path not after a word character, '.', ':', '/', '~' or '-', so "tok/s"
# and "1/2" stay as they are.
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"`,;()\[\]{}<>]*[^\s'\"`,;()\[\]{}<>:.]", re.IGNORECASE)
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[\w.~-][^\s'\"`,;:()\[\]{}<>]*")
_TRACEBACK = "Traceback (most recent call last)"
MAX_PUBLIC_MESSAGE = 2000


def public_message(text: str) -> str:
    """`text` (a worker's message, an exception's) as a client may read it: no traceback, URLs as `<url>`,
    absolute paths as `<path>`, at most MAX_PUBLIC_MESSAGE characters. The full text belongs in the server's log."""
    text = text.split(_TRACEBACK, 1)[0].rstrip() or "details in the server log"
    text = _ABSOLUTE_PATH.sub("<path>", _URL.sub("<url>", text))
    return text if len(text) <= MAX_PUBLIC_MESSAGE else text[:MAX_PUBLIC_MESSAGE - 3] + "..."
