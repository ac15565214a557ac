"""The plan of one transition, as the controller sends it to every rank, and operation ids.

Torch-free: the orchestrator builds it without the engine, and a rank receives the same
record (pickled by Ray or the process pipe), so there is no second wire shape to keep in step.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.rendezvous import Rendezvous


def new_op_id() -> str:
    """The one operation-id format: ``op-YYYYmmdd-HHMMSS-xxxx`` (sortable by start, unique)."""
    return f"op-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


@dataclass(frozen=True)
class TransitionPlan:
    """Everything a rank needs for its side of one operation."""

    op_id: str
    kind: str  # "scale_up" | "scale_down"
    old_size: int
    new_size: int
    rdzv: Rendezvous
    old_layout: ExpertLayout
    new_layout: ExpertLayout
    timeout_s: float = 120.0

    def role(self, rank: int) -> str:
        """existing | joining (scale-up), remaining | removing (scale-down)."""
        if self.kind == "scale_up":
            return "existing" if rank < self.old_size else "joining"
        return "remaining" if rank < self.new_size else "removing"
