"""The plan of one transition, as the controller sends it to every rank, and operation ids.

Torch-free: the orchestrator builds it without the engine, and a rank receives the same
record (pickled by Ray or the process pipe), so there is no second wire shape to keep in step.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from dataclasses import dataclass

from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.rendezvous import Rendezvous

# A process's id suffixes count on from a random start (a forked child draws its own): unique within
# the process (16 random bits per id collided in CI: 50 ids made in one second, about 2 % of the
# time), apart across processes.
_SUFFIXES = itertools.count(secrets.randbelow(1 << 16))


def _reseed() -> None:
    global _SUFFIXES
    _SUFFIXES = itertools.count(secrets.randbelow(1 << 16))


os.register_at_fork(after_in_child=_reseed)


def new_op_id() -> str:
    """The one operation-id format: ``op-YYYYmmdd-HHMMSS-xxxx`` (sortable by start, unique)."""
    return f"op-{time.strftime('%Y%m%d-%H%M%S')}-{next(_SUFFIXES) % (1 << 16):04x}"


@dataclass(frozen=True)
class TransitionPlan:
    """Everything a rank needs for its side of one operation."""

    op_id: str
    kind: str  # "scale_up" | "scale_down" | "recover"
    old_size: int
    new_size: int
    rdzv: Rendezvous
    old_layout: ExpertLayout
    new_layout: ExpertLayout
    timeout_s: float = 120.0
    # The ordered global ranks of each world: a rank's position (group rank, layout slice) is
    # its index here. Empty means 0..size-1 (no rank ever died).
    old_members: tuple[int, ...] = ()
    new_members: tuple[int, ...] = ()
    # recover: members whose expert weights may be half moved (a failed commit); every slot they
    # held is restored from another copy or the weight source instead.
    untrusted: tuple[int, ...] = ()
    # scale: the expert moves (indices into plan_moves' list) the pre-copy makes in prepare; the rest
    # move in the commit (engine_ext/elastic/precopy.py split_moves). None: every move.
    precopy_moves: tuple[int, ...] | None = None

    @property
    def old_world(self) -> tuple[int, ...]:
        return self.old_members or tuple(range(self.old_size))

    @property
    def new_world(self) -> tuple[int, ...]:
        return self.new_members or tuple(range(self.new_size))

    def new_pos(self, rank: int) -> int:
        """The position of global rank ``rank`` in the new world (-1: not a member)."""
        return self.new_world.index(rank) if rank in self.new_world else -1

    def role(self, rank: int) -> str:
        """existing | joining (scale-up), remaining | removing (scale-down), surviving (recover)."""
        if self.kind == "recover":
            return "surviving"
        if self.kind == "scale_up":
            return "existing" if rank in self.old_world else "joining"
        return "remaining" if rank in self.new_world else "removing"
