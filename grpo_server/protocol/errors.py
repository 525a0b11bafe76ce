"""Domain errors of the front end, and the one place where they become HTTP statuses."""

from __future__ import annotations

from pydantic import ValidationError


class ApiError(Exception):
    """An error a client sees as `{"error": {"code", "message"}}` with `status`."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


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
    """A worker answered with an internal error: reported, never hidden."""

    status, code = 502, "worker_error"


def describe_validation_error(exc: ValidationError, most: int = 10) -> str:
    """A pydantic error as one line naming each bad field (the first `most` of them)."""
    return "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
                     for error in exc.errors()[:most])
