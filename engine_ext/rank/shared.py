"""What the parts of one rank share: the resources they work on and the mutable state they
read across threads. The parts import this module, never ``engine_ext.rank.engine``."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_ext.protocol import RankState

if TYPE_CHECKING:
    from engine_ext.config import EngineConfig
    from engine_ext.elastic.comm import StatelessGroup
    from engine_ext.elastic.eplb import EplbState
    from engine_ext.elastic.graphs import GraphManager
    from engine_ext.elastic.workspace import WorkspaceManager
    from engine_ext.faults import Faults
    from engine_ext.model.model import MoEModel
    from engine_ext.rank.operation import OpState
    from engine_ext.rank.scheduler import Scheduler


@dataclass(frozen=True)
class RankResources:
    """The objects one rank computes with; built once by the engine, never replaced."""

    cfg: EngineConfig
    device: torch.device
    model: MoEModel
    graphs: GraphManager
    workspace: WorkspaceManager
    sched: Scheduler
    eplb: EplbState
    faults: Faults


class RankShared:
    """The one owner of the state the rank's threads share (step thread, control calls,
    heartbeat).

    Lock discipline: ``lock`` (re-entrant) guards ``group``, ``wake_round``, ``op``,
    ``commit_ready``, ``current_op``, ``stopping``, ``rank`` and the scheduler's queues; write
    them only while holding it (the methods below do). The step thread reads ``group`` without
    the lock: the reference swaps only at a commit on that thread or while the step loop is
    halted. ``halting`` is an Event, set from any thread (a peer died) and cleared only by
    recovery once the step loop stopped. ``state`` changes only through
    ``RankTelemetry.set_state``, which publishes it with its reason (a refused replay and a
    fault's hold also note themselves in the reason); a removing rank turns REMOVING under
    ``lock``, and a request is admitted only if the state read under ``lock`` allows it, so none
    is queued after the commit hands the rank's requests back. One writer each, no lock:
    ``capture_passes`` and ``required_workspace`` (the thread running the warm-up, which the
    operation serializes), ``steps`` and ``stale_replays_refused`` (the step thread).
    """

    def __init__(self, rank: int) -> None:
        self.lock = threading.RLock()
        self.rank = rank
        self.group: StatelessGroup | None = None
        self.wake_round = 0  # the idle round of the current group; every rank starts it at 0
        self.op: OpState | None = None  # the transition this rank is in (kept after commit for wait_op)
        self.abandoned: OpState | None = None  # the last one taken: wait_op still reports its error
        self.commit_ready = False
        self.current_op = ""
        self.capture_passes = 0  # capture passes in the current operation (I4: exactly one)
        self.stopping = False
        self.halting = threading.Event()  # a peer died: the step loop stops until recovery resumes it
        self.state = RankState.STARTING
        self.state_reason = ""
        self.required_workspace = 0
        self.steps = 0
        self.stale_replays_refused = 0
        self.move_bytes_held = 0  # a scale's pre-copy spare buffers, out of the KV pool (under ``lock``)

    @property
    def world_size(self) -> int:
        """Read live from the current group (I6): never cached from construction."""
        group = self.group
        return 1 if group is None else group.size

    @property
    def epoch(self) -> int:
        """The world this rank serves in (its live group's rendezvous epoch), 0 before it joins."""
        group = self.group
        return 0 if group is None else group.rdzv.epoch

    def world_key(self) -> tuple[int, int]:
        """What a capture is bound to under ``recapture``: the live group and its size."""
        group = self.group
        return (id(group) if group is not None else 0, 1 if group is None else group.size)

    def set_group(self, group: StatelessGroup | None) -> StatelessGroup | None:
        """Make ``group`` the live DP/EP group (its idle rounds start at 0); returns the old one."""
        with self.lock:
            old, self.group, self.wake_round = self.group, group, 0
        return old

    def begin_op(self, op_id: str, op: OpState | None = None) -> None:
        """A new operation: its id, no capture pass yet, and (a transition's) its state."""
        with self.lock:
            if op is not None:
                self.op = op
            self.current_op = op_id
            self.capture_passes = 0

    def finish_op(self, *, stop: bool = False) -> None:
        """The operation ended on this rank (``op`` stays: ``wait_op`` reads its result)."""
        with self.lock:
            self.commit_ready = False
            self.current_op = ""
            self.stopping = self.stopping or stop

    def take_op(self) -> OpState | None:
        """Abandon the current operation (rolled back, or a peer died): nobody commits it any more."""
        with self.lock:
            op, self.op, self.commit_ready = self.op, None, False
            self.abandoned = op or self.abandoned
        return op

    def stop(self) -> None:
        with self.lock:
            self.stopping = True

    def wake(self) -> None:
        """Wake every rank of the group if they sleep (the key of the current idle round)."""
        with self.lock:
            group, idx = self.group, self.wake_round
        if group is None:
            return
        with contextlib.suppress(Exception):
            group.wake_store.set(f"wake/{idx}", b"1")
