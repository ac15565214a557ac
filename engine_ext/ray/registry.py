"""The registry: a named, detached actor per deployment holding its telemetry.

Ranks push to it fire-and-forget; losing it never stops serving, and a new one rebuilds the
picture from the ranks' next heartbeats and re-sent events.
"""

from __future__ import annotations

from typing import Any

from engine_ext.elastic.telemetry import RegistryState


class Registry:
    def __init__(self, deployment: str, kind: str = "reference") -> None:
        self.state = RegistryState(deployment, kind)
        self.epoch = 0

    def set_info(self, info: dict[str, Any]) -> None:
        self.state.info.update(info)

    def report_status(self, status: dict[str, Any]) -> dict[str, Any]:
        return self.state.report_status(status)

    def report_events(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            self.state.report_event(ev)

    def record_operation(self, op: dict[str, Any]) -> None:
        self.state.record_operation(op)

    def forget_rank(self, rank: int) -> None:
        self.state.forget_rank(rank)

    def snapshot(self) -> dict[str, Any]:
        return self.state.snapshot()

    def events(self, op_id: str | None = None, since_seq: int = 0) -> dict[str, Any]:
        return {"events": self.state.events_for(op_id, since_seq), "operations": self.state.operations(op_id)}

    def ping(self) -> str:
        return self.state.deployment
