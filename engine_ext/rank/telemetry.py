"""What a rank tells the world: its status record, phase events, state changes and heartbeat.

Everything goes out through the rank's sink (the Ray actor or the launcher's pipe); a sink
that fails never stops the rank.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from engine_ext.protocol import Event, RankState, RankStatus
from engine_ext.records import to_builtins

if TYPE_CHECKING:
    from engine_ext.rank.engine import RankEngine

Sink = Callable[[str, dict[str, Any]], None]  # (kind, payload): "status" | "event" | "results" | "tokens"


class RankTelemetry:
    """Status, events and heartbeat of one rank."""

    def __init__(self, engine: RankEngine, sink: Sink | None) -> None:
        self.engine = engine
        self.sink: Sink = sink or (lambda kind, payload: None)
        self.events: deque[dict[str, Any]] = deque(maxlen=512)
        self._thread: threading.Thread | None = None

    def status(self) -> dict[str, Any]:
        e = self.engine
        s, g = e.sched, e.graphs
        st = RankStatus(
            deployment=e.deployment, rank=e.rank, instance_id=e.instance_id, engine_id=e.engine_id,
            kind=e.kind, node=f"{e.node}/{e.ip}", node_id=e.node_id, node_ip=e.ip,
            pid=os.getpid(), device=str(e.device),
            state=e.state.value, state_reason=e.state_reason, dp_size=e.world_size,
            requests_running=len(s.running), requests_waiting=len(s.waiting),
            slots_used=s.slots.used, slots_total=s.slots.total,
            kv_blocks_used=s.blocks.used, kv_blocks_total=s.blocks.total,
            workspace_bytes=e.workspace.nbytes, workspace_locked=e.workspace.locked,
            workspace_required_bytes=e.required_workspace, capture_policy=e.cfg.capture_policy,
            workspace_recapture_bytes=e.model.moe_workspace_bound(e.world_size),
            graphs_captured=len(g.captured_sizes), capture_sizes=g.captured_sizes, graph_kind=g.kind,
            graph_replays=g.stats.replays, last_capture_s=g.stats.last_capture_s,
            capture_times_s={str(k): round(v, 6) for k, v in sorted(g.stats.capture_durations.items())},
            last_capture_pass_s=(round(sum(g.stats.capture_durations.values()), 6)
                                 if g.stats.capture_durations else None),
            captures_this_op=e.capture_passes, current_op=e.current_op,
            eplb_step=e.eplb.step, eplb_imbalance=e.eplb.imbalance(),
            physical_experts=e.eplb.layout.num_physical, logical_experts=e.eplb.layout.num_logical,
            steps=e.steps, last_heartbeat=time.time(),
            stale_replays_refused=e.stale_replays_refused, eplb_logical_load=list(e.eplb.logical_load),
            eplb_recent_load=e.eplb.recent_load(), eplb_slots=e.eplb.layout.local_logical(e.model.rank),  # the layout slice: its position
        )
        return to_builtins(st)

    def send(self, kind: str, payload: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            self.sink(kind, payload)

    def publish(self) -> None:
        with contextlib.suppress(Exception):
            self.sink("status", self.status())

    def set_state(self, state: RankState, reason: str = "") -> None:
        self.engine.state = state
        self.engine.state_reason = reason
        self.publish()

    def event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        self.send("event", ev)

    @contextlib.contextmanager
    def phase(self, op_id: str, phase: str, **detail: Any) -> Iterator[dict[str, Any]]:
        """Time a phase and report it as an event, with its outcome, even when it raises."""
        start = time.time()
        outcome = "ok"
        try:
            yield detail
        except BaseException as e:
            outcome = "error"
            detail["error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.event(to_builtins(Event(op_id=op_id, rank=self.engine.rank, phase=phase, start=start, end=time.time(),
                             outcome=outcome, detail=detail)))

    def failure(self, op_id: str, e: BaseException) -> None:
        now = time.time()
        detail = {"error": str(e), "traceback": traceback.format_exc()[-2000:]}
        self.event(to_builtins(Event(op_id=op_id, rank=self.engine.rank, phase="failure", start=now, end=now,
                         outcome="error", detail=detail)))

    def recent_events(self) -> list[dict[str, Any]]:
        return list(self.events)

    def start_heartbeat(self, interval_s: float = 1.0) -> None:
        e = self.engine

        def beat() -> None:
            while not e.stopping and e.state is not RankState.REMOVED:
                self.publish()
                time.sleep(interval_s)

        self._thread = threading.Thread(target=beat, name=f"heartbeat-{e.rank}", daemon=True)
        self._thread.start()
