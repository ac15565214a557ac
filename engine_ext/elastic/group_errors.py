"""How a stateless group's collective or store operation failed, as its transport tells it
(engine_ext.elastic.comm raises these; the rank side reads the code to tell a peer's failure
from its own)."""

from __future__ import annotations

import enum


class GroupFailure(str, enum.Enum):
    """Why a group's collective or store operation failed, as the transport tells it."""

    PEER_GONE = "peer_gone"  # the other side closed, reset or never answered the connection
    TIMEOUT = "timeout"  # the backend's or the store's timeout ran out
    ABORTED = "aborted"  # this process aborted or destroyed the group (recovery stops the step loop so)
    # larger than the world's shared memory was sized for: every member refuses it; the world is rebuilt
    OVERFLOW = "overflow"


class GroupError(RuntimeError):
    """A collective or store operation of a ``StatelessGroup`` failed: a peer (or the store) is
    gone, not this rank. ``code`` says how; the backend's error is the ``__cause__``."""

    def __init__(self, code: GroupFailure, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


def failure_code(ex: BaseException) -> GroupFailure:
    """The transport's reading of its backend's error (gloo, NCCL and TCPStore say it in words)."""
    text = str(ex).lower()
    if isinstance(ex, TimeoutError) or "timeout" in text or "timed out" in text:
        return GroupFailure.TIMEOUT
    return GroupFailure.PEER_GONE
