"""One operation (a transition or a recovery) as a rank sees it: its plan, role and groups."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from engine_ext.elastic.comm import StatelessGroup
from engine_ext.elastic.transition_plan import TransitionPlan


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

    def drop_groups(self) -> None:
        for g in (self.standby, self.eplb_comm):
            if g is not None:
                g.destroy()

    def abort_groups(self, keep: StatelessGroup | None = None) -> None:
        """Drop the operation's groups at once (a peer died), except ``keep`` (the live group)."""
        for g in (self.standby, self.eplb_comm):
            if g is not None and g is not keep:
                g.abort()


def comm_members(plan: TransitionPlan) -> tuple[int, ...]:
    """The members of an operation's EPLB communicator, in its rank order: the new world on a
    scale-up and a recovery (the dead cannot send), the old world (the sources) on a scale-down."""
    return plan.old_world if plan.kind == "scale_down" else plan.new_world
