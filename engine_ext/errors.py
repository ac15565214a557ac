"""The exit-code table and the errors that carry it, from a rank's failure to eepctl's exit status.

Torch- and ray-free: eepctl imports this module on every command.
"""

from __future__ import annotations

import enum
from typing import Any

from engine_ext.records import Refusal


class ExitCode(enum.IntEnum):
    """The one exit-code table (README, DESIGN section 7)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    UNREACHABLE = 3
    PRECONDITION = 4
    TRANSITION_FAILED = 5
    TIMEOUT = 6
    INTERRUPTED = 130  # SIGINT (the shell's 128 + 2)
    TERMINATED = 143  # SIGTERM (128 + 15)


class EepError(Exception):
    """An error with a documented exit code; its message is one line for stderr."""

    exit_code: ExitCode = ExitCode.ERROR

    def __init__(self, message: str, *, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail or {}


class UsageError(EepError):
    exit_code = ExitCode.USAGE


class UnreachableError(EepError):
    exit_code = ExitCode.UNREACHABLE


class PreconditionError(EepError):
    exit_code = ExitCode.PRECONDITION


class TransitionFailed(EepError):
    exit_code = ExitCode.TRANSITION_FAILED


class TransitionTimeout(EepError):
    exit_code = ExitCode.TIMEOUT


_ERRORS_BY_CODE: dict[int, type[EepError]] = {
    int(cls.exit_code): cls
    for cls in (EepError, UsageError, UnreachableError, PreconditionError, TransitionFailed, TransitionTimeout)
}


def error_record(e: EepError) -> dict[str, Any]:
    """A refusal as an actor's answer carries it across the process boundary:
    ``{"error": {"code", "message", "detail"}}`` (``error_from_record`` rebuilds the error)."""
    return {"error": {"code": int(e.exit_code), "message": e.message, "detail": e.detail}}


def error_from_record(record: dict[str, Any]) -> EepError:
    """Rebuild an error that crossed a process boundary as {"code", "message", "detail"}."""
    cls = _ERRORS_BY_CODE.get(int(record.get("code", 1)), EepError)
    return cls(str(record.get("message", "unknown error")), detail=record.get("detail") or {})


class RankRefused(RuntimeError):
    """A rank takes no requests now; ``code`` says why. It crosses the process pipe pickled
    (``__reduce__`` keeps the code) and a Ray actor call as the cause of a RayTaskError."""

    def __init__(self, message: str, code: Refusal) -> None:
        super().__init__(message)
        self.code = Refusal(code)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.code.value)


def rank_refusal(error: BaseException) -> RankRefused | None:
    """The rank's refusal an error carries, on itself, its Ray ``cause`` or what it was raised from:
    the innermost one (Ray's RayTaskError is also an instance of the remote error's class, its
    message the whole remote traceback; its ``cause`` is the rank's own)."""
    seen: set[int] = set()
    found: RankRefused | None = None
    cur: BaseException | None = error
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, RankRefused):
            found = cur
        seen.add(id(cur))
        cause = getattr(cur, "cause", None)
        cur = cause if isinstance(cause, BaseException) else cur.__cause__
    return found


def refusal_of(error: BaseException) -> Refusal | None:
    """The refusal code an error carries (``rank_refusal``), None when the call itself failed."""
    refused = rank_refusal(error)
    return refused.code if refused is not None else None
