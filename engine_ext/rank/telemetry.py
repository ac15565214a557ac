"""What a rank tells the world: its status record, phase events, state changes and heartbeat.

Everything goes out through the rank's sink (the Ray actor or the launcher's pipe); a sink
that fails never stops the rank.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from engine_ext.protocol import Event, RankState
from engine_ext.rank.shared import RankShared
from engine_ext.records import to_builtins

Sink = Callable[[str, dict[str, Any]], None]  # (kind, payload): "status" | "event" | "results" | "tokens"


class RankTelemetry:
    """Status, events and heartbeat of one rank. ``status`` builds the rank's status record
    (the engine knows every part it reads)."""

    def __init__(self, shared: RankShared, sink: Sink | None, status: Callable[[], dict[str, Any]]) -> None:
        self.shared = shared
        self.sink: Sink = sink or (lambda kind, payload: None)
        self.status = status
        self.events: deque[dict[str, Any]] = deque(maxlen=512)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: list[tuple[str, dict[str, Any]]] | None = None  # reports kept while quiet
        self._status_held = False

    def send(self, kind: str, payload: dict[str, Any]) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append((kind, payload))
                return
        self._send(kind, payload)

    def _send(self, kind: str, payload: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            self.sink(kind, payload)

    def publish(self) -> None:
        with self._lock:
            if self._held is not None:
                self._status_held = True
                return
        self._publish_now()

    def _publish_now(self) -> None:
        with contextlib.suppress(Exception):
            self.sink("status", self.status())

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Keep this rank's reports (events, state changes) while the deployment is paused, and
        send them, in order, with one status, when it ends. Each report costs this rank a status
        build and the controller a wake-up; on shared cores both came out of the serving pause.
        The heartbeat still publishes,
        so a long quiet stretch (a commit that captures) shows its state within an interval."""
        with self._lock:
            if self._held is not None:  # already quiet: the outer one sends
                nested = True
            else:
                nested, self._held, self._status_held = False, [], False
        try:
            yield
        finally:
            if not nested:
                with self._lock:
                    held, self._held = self._held or [], None
                    status, self._status_held = self._status_held, False
                for kind, payload in held:
                    self._send(kind, payload)
                if status:
                    self._publish_now()

    def set_state(self, state: RankState, reason: str = "") -> None:
        self.shared.state = state
        self.shared.state_reason = reason
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
            self.event(
                to_builtins(
                    Event(
                        op_id=op_id,
                        rank=self.shared.rank,
                        phase=phase,
                        start=start,
                        end=time.time(),
                        outcome=outcome,
                        detail=detail,
                    )
                )
            )

    def failure(self, op_id: str, e: BaseException) -> None:
        now = time.time()
        detail = {"error": str(e), "traceback": traceback.format_exc()[-2000:]}
        self.event(
            to_builtins(
                Event(
                    op_id=op_id,
                    rank=self.shared.rank,
                    phase="failure",
                    start=now,
                    end=now,
                    outcome="error",
                    detail=detail,
                )
            )
        )

    def recent_events(self) -> list[dict[str, Any]]:
        return list(self.events)

    def start_heartbeat(self, interval_s: float = 1.0) -> None:
        shared = self.shared

        def beat() -> None:
            while not shared.stopping and shared.state is not RankState.REMOVED:
                self._publish_now()
                time.sleep(interval_s)

        self._thread = threading.Thread(target=beat, name=f"heartbeat-{shared.rank}", daemon=True)
        self._thread.start()
