"""A killed eepctl says one line: what it was doing and what it leaves running, then exits 130
(SIGINT) or 143 (SIGTERM), never a stack dump.

Commands say what they are doing (``doing``); ``install`` makes SIGINT and SIGTERM raise a
KeyboardInterrupt (which Ray's blocking calls let through, and typer turns into exit 130),
remembering which signal it was, so eepctl.main can say the line and pick the code. ``ray.init``
installs Ray's own SIGTERM handler (its core worker dumps stacks on SIGTERM), so eepctl.cluster
installs ours again after it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine_ext.protocol import ExitCode

_activity: list[tuple[str, str]] = []  # (what eepctl is doing, what an interruption leaves running)
received: list[int] = []  # the signals that ended it
_when_received: list[tuple[str, str]] = []  # what it was doing then (``doing`` blocks unwind before main reports)


def interrupted(signum: int, frame: Any = None) -> None:
    """The handler: remember the signal, end what runs (a KeyboardInterrupt)."""
    received.append(signum)
    if _activity and not _when_received:
        _when_received.append(_activity[-1])
    raise KeyboardInterrupt


def reset() -> None:
    """A new command (an in-process caller runs several): no signal seen, nothing being done."""
    received.clear()
    _when_received.clear()
    _activity.clear()


def install() -> None:
    """SIGINT and SIGTERM interrupt (main thread only; Python allows handlers nowhere else)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupted)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # generate --rate keeps its own
            signal.signal(signal.SIGINT, interrupted)


@contextmanager
def doing(what: str, leaves: str = "nothing is left running") -> Iterator[None]:
    """While open, an interruption reports ``what`` was going on and ``leaves``."""
    depth = len(_activity)
    _activity.append((what, leaves))
    try:
        yield
    finally:
        del _activity[depth:]


def now_doing(what: str, leaves: str) -> None:
    """Replace what the innermost ``doing`` says (it learnt more: an operation id)."""
    if _activity:
        _activity[-1] = (what, leaves)
    else:
        _activity.append((what, leaves))


def outcome() -> tuple[str, int]:
    """The one line and the exit code of an interruption now."""
    term = signal.SIGTERM in received
    name, code = ("SIGTERM", ExitCode.TERMINATED) if term else ("SIGINT", ExitCode.INTERRUPTED)
    doing_then = _when_received or _activity
    what, leaves = doing_then[-1] if doing_then else ("", "nothing is left running")
    return f"{what + ' ' if what else ''}interrupted by {name}; {leaves}", int(code)
