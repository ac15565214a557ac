"""The registry: a named, detached actor per deployment holding what its ranks report.

Ranks push to it fire-and-forget; losing it never stops serving, and a new one rebuilds the
picture from the ranks' next heartbeats and re-sent events.
"""

from __future__ import annotations

from typing import Any

from engine_ext.elastic.registry_state import RegistryState


class Registry:
    def __init__(self, deployment: str, kind: str = "reference") -> None:
        self.state = RegistryState(deployment, kind)

    def set_info(self, info: dict[str, Any]) -> None:
        self.state.info.update(info)

    def report_status(self, status: dict[str, Any]) -> dict[str, Any]:
        return self.state.report_status(status)

    def report_events(self, events: list[dict[str, Any]]) -> dict[str, int]:
        """Each event on its own: a malformed one (ValueError/TypeError) is counted, not fatal to the
        rest of the batch (callers send fire-and-forget, so no error is raised for it)."""
        if not isinstance(events, (list, tuple)):
            raise TypeError(f"events must be a list, not {type(events).__name__}")
        refused = 0
        for ev in events:
            try:
                self.state.report_event(ev)
            except (ValueError, TypeError):
                refused += 1
        return {"accepted": len(events) - refused, "refused": refused}

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
