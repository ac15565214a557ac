"""One operation (a transition or a recovery) as a rank sees it: its plan, role and groups."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_ext.elastic.comm import StatelessGroup
from engine_ext.elastic.transition_plan import TransitionPlan


@dataclass
class PreCopy:
    """Experts a scale's pre-copy holds for the commit: (move, spare buffer) pairs of a member,
    their bytes (taken out of the KV pool), since when, and how to give the bytes back."""

    held: list[tuple[Any, Any]]
    nbytes: int
    since: float
    release: Callable[[], None]


@dataclass
class OpState:
    """One operation as this rank sees it."""

    plan: TransitionPlan
    role: str
    standby: StatelessGroup | None = None
    eplb_comm: StatelessGroup | None = None
    prepared: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    commit_held_since: float = 0.0  # when a test's hold first kept this rank from agreeing to commit
    precopy: PreCopy | None = None

    def free_precopy(self, why: str) -> dict[str, Any]:
        """Give the pre-copy's spare bytes back (the commit loaded them, or the operation ended
        before it); what was held, for how long and why it was freed (the operation record's)."""
        pc, self.precopy = self.precopy, None
        if pc is None:
            return {}
        pc.release()
        now = time.time()
        self.result["move_memory"] = info = {
            "spare_bytes": pc.nbytes,
            "held_s": round(now - pc.since, 6),
            "freed_at": now,
            "freed_by": why,
        }
        return info

    def drop_groups(self) -> None:
        for g in (self.standby, self.eplb_comm):
            if g is not None:
                g.destroy()
        self.free_precopy("rollback")

    def abort_groups(self, keep: StatelessGroup | None = None) -> None:
        """Drop the operation's groups at once (a peer died), except ``keep`` (the live group)."""
        for g in (self.standby, self.eplb_comm):
            if g is not None and g is not keep:
                g.abort()
        self.free_precopy("abort")


def comm_members(plan: TransitionPlan) -> tuple[int, ...]:
    """The members of an operation's EPLB communicator, in its rank order: the new world on a
    scale-up and a recovery (the dead cannot send), the old world (the sources) on a scale-down."""
    return plan.old_world if plan.kind == "scale_down" else plan.new_world
