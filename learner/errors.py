"""Domain errors of the learner, mapped to HTTP answers in one place (learner/app.py)."""

from __future__ import annotations


class LearnerError(Exception):
    """An error the caller can act on: a code, a message, and the HTTP status it maps to."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status

    def __repr__(self) -> str:
        return f"LearnerError({self.code!r}, {self.message!r}, {self.status})"


def not_found(name: str) -> LearnerError:
    return LearnerError("not_found", f"experiment {name!r} is not loaded in the learner", 404)


def bad_request(message: str) -> LearnerError:
    return LearnerError("bad_request", message, 400)
