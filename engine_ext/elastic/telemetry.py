"""The registry's picture of a deployment, built only from what ranks report.

Ray-free and torch-free: the Ray registry actor wraps it, the process launcher uses it
directly, and a new registry rebuilds it from the ranks' next reports.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import time
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from engine_ext.protocol import STALE_AFTER_S, Event, OpState, RankState, RankStatus

_MAX_EVENTS = 5000
_TERMINAL = {RankState.REMOVED.value}
_RANK_PHASES = {"transfer", "reshuffle", "warm", "capture"}
_STACKED = re.compile(r"_dp\d+_dp\d+$")
_MAX_RECORD_BYTES = 1 << 20
# Operation fields the registry's views compute with; the rest of an operation record is kept as sent.
_OP_CHECKED = {"op_id": "str", "state": "str", "phase": "str", "started": "float", "finished": "float | None",
               "serving_pause_s": "float", "phase_durations": "dict[str, float]"}


# ---- intake validation: a record is accepted (coerced to its declared types) or refused with a
# ValueError/TypeError; nothing that is refused touches the state (the fuzz tests hold us to it).
def _record(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise TypeError(f"{what} must be a mapping, not {type(data).__name__}")
    if not all(isinstance(k, str) for k in data):
        raise TypeError(f"{what} keys must be strings")
    try:
        size = len(json.dumps(data, default=str))
    except Exception as e:  # noqa: BLE001 - tuple keys deep inside, cycles, absurd nesting or ints
        raise ValueError(f"{what} is not JSON-representable: {type(e).__name__}") from None
    if size > _MAX_RECORD_BYTES:
        raise ValueError(f"{what} is {size} bytes, over the {_MAX_RECORD_BYTES} byte limit")
    return dict(data)


def _coerce(kind: str, value: Any, what: str) -> Any:
    if kind.endswith(" | None"):
        return None if value is None else _coerce(kind[:-7], value, what)
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError(f"{what} must be a string, not {type(value).__name__}")
        return str.__str__(value)  # str enums become their value
    if kind in ("int", "float"):
        if not isinstance(value, numbers.Real):
            raise TypeError(f"{what} must be a number, not {type(value).__name__}")
        if not isinstance(value, numbers.Integral) and not math.isfinite(value):
            raise ValueError(f"{what} must be finite, not {value!r}")
        return int(value) if kind == "int" else float(value)
    if kind == "bool":
        if not isinstance(value, numbers.Integral):
            raise TypeError(f"{what} must be a boolean, not {type(value).__name__}")
        return bool(value)
    if kind.startswith("list["):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{what} must be a list, not {type(value).__name__}")
        return [_coerce(kind[5:-1], v, what) for v in value]
    if kind.startswith("dict[str, "):
        if not isinstance(value, Mapping):
            raise TypeError(f"{what} must be a mapping, not {type(value).__name__}")
        inner = kind[10:-1]
        return {str(k): (v if inner == "Any" else _coerce(inner, v, f"{what}[{k!r}]")) for k, v in value.items()}
    return value


def _typed(cls: type, data: dict[str, Any], what: str) -> Any:
    """The dataclass with every field present coerced to its declared type; None where a field
    has a default means the default. Missing required fields raise TypeError (the dataclass)."""
    kw: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if value is None and has_default and not str(f.type).endswith("| None"):
            continue
        kw[f.name] = _coerce(str(f.type), value, f"{what}.{f.name}")
    return cls(**kw)


class RegistryState:
    def __init__(self, deployment: str, kind: str = "reference") -> None:
        self.deployment = deployment
        self.kind = kind
        self.info: dict[str, Any] = {}
        self.ranks: dict[int, dict[str, Any]] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=_MAX_EVENTS)
        self._event_keys: set[tuple] = set()
        self.ops: dict[str, dict[str, Any]] = {}
        self.rejected: list[str] = []
        self.seq = 0

    # ---- intake --------------------------------------------------------------------------
    def report_status(self, status: dict[str, Any]) -> dict[str, Any]:
        """Accept a rank's status. A second live rank claiming an identity is refused (I1)."""
        status = _record(status, "status")
        st = _typed(RankStatus, status, "status").to_dict()
        rank = st["rank"]
        if rank < 0:
            raise ValueError(f"status.rank must be >= 0, not {rank}")
        extra = {k: v for k, v in status.items() if k not in st}
        st.update(extra)
        for other in self.ranks.values():
            if (other["rank"] != rank and other["instance_id"] == st["instance_id"]
                    and not self._gone(other)):
                msg = f"duplicate identity {st['instance_id']!r}: ranks {other['rank']} and {rank}"
                if msg not in self.rejected:
                    self.rejected.append(msg)
                return {"accepted": False, "reason": msg}
        st["received_at"] = time.time()
        self.ranks[rank] = st
        return {"accepted": True}

    def report_event(self, event: dict[str, Any]) -> None:
        ev = _typed(Event, _record(event, "event"), "event").to_dict()
        if ev["rank"] < -1:
            raise ValueError(f"event.rank must be >= -1 (-1: the controller), not {ev['rank']}")
        key = (ev["op_id"], ev["rank"], ev["phase"], round(ev["start"], 6))
        if key in self._event_keys:
            return  # re-sent after a registry restart
        self._event_keys.add(key)
        self.seq += 1
        ev["seq"] = self.seq
        self.events.append(ev)

    def record_operation(self, op: dict[str, Any]) -> None:
        op = _record(op, "operation")
        if "op_id" not in op:
            raise ValueError("operation has no op_id")
        for key, kind in _OP_CHECKED.items():
            if key in op:
                op[key] = _coerce(kind, op[key], f"operation.{key}")
        self.ops[op["op_id"]] = op

    def forget_rank(self, rank: int) -> None:
        self.ranks.pop(rank, None)

    # ---- views -------------------------------------------------------------------------------
    @staticmethod
    def _gone(st: dict[str, Any]) -> bool:
        return st.get("state") in _TERMINAL

    def rank_views(self, now: float | None = None) -> list[dict[str, Any]]:
        now = now or time.time()
        out = []
        for rank in sorted(self.ranks):
            st = dict(self.ranks[rank])
            age = max(0.0, now - float(st.get("received_at", st.get("last_heartbeat", 0.0))))
            st["heartbeat_age_s"] = round(age, 2)
            if age > STALE_AFTER_S and st["state"] not in _TERMINAL:
                st["state_reason"] = f"no heartbeat for {age:.1f}s (was {st['state']})"
                st["state"] = RankState.STALE.value
            out.append(st)
        return out

    def current_op(self) -> dict[str, Any] | None:
        running = [o for o in self.ops.values() if o.get("state") == OpState.RUNNING.value]
        return running[-1] if running else None

    def operations(self, op_id: str | None = None) -> list[dict[str, Any]]:
        """Operations with the ranks' phase durations folded in (slowest rank per phase)."""
        ops = sorted(self.ops.values(), key=lambda o: o.get("started", 0))
        if op_id:
            ops = [o for o in ops if o["op_id"] == op_id]
        out = []
        for op in ops:
            op = dict(op)
            phases = dict(op.get("phase_durations") or {})
            for e in self.events:
                if e["op_id"] == op["op_id"] and e["rank"] >= 0 and e["phase"] in _RANK_PHASES:
                    phases[e["phase"]] = max(phases.get(e["phase"], 0.0), round(e["end"] - e["start"], 6))
            op["phase_durations"] = phases
            out.append(op)
        return out

    def events_for(self, op_id: str | None = None, since_seq: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.events if e["seq"] > since_seq and (op_id is None or e["op_id"] == op_id)]

    def violations(self, views: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
        """Invariants the registry can see broken from telemetry alone."""
        views = views if views is not None else self.rank_views()
        found: list[dict[str, str]] = []
        live = [v for v in views if v["state"] not in _TERMINAL]
        seen: dict[str, int] = {}
        for v in live:
            iid = v["instance_id"]
            if iid in seen:
                found.append({"invariant": "I1", "rank": str(v["rank"]),
                              "message": f"duplicate identity {iid} (ranks {seen[iid]} and {v['rank']})"})
            seen[iid] = v["rank"]
            for field in ("instance_id", "engine_id"):
                value = v.get(field) or ""
                if value and (not value.endswith(f"_dp{v['rank']}") or _STACKED.search(value)):
                    found.append({"invariant": "I1", "rank": str(v["rank"]),
                                  "message": f"{field} {value!r} does not end in exactly one _dp{v['rank']}"})
            if (v.get("workspace_locked") and v.get("workspace_required_bytes", 0)
                    and v.get("workspace_bytes", 0) < v["workspace_required_bytes"]):
                found.append({"invariant": "I4", "rank": str(v["rank"]),
                              "message": f"workspace locked at {v['workspace_bytes']} B below its bound "
                                         f"{v['workspace_required_bytes']} B"})
            if v.get("stale_replays_refused"):
                found.append({"invariant": "I3", "rank": str(v["rank"]),
                              "message": f"{v['stale_replays_refused']} replay(s) against a reallocated buffer refused"})
        found.extend(self._event_violations())
        found.extend({"invariant": "I1", "rank": "-", "message": m} for m in self.rejected[-5:])
        return found

    def _event_violations(self) -> list[dict[str, str]]:
        found: list[dict[str, str]] = []
        passes: dict[tuple[str, int], int] = defaultdict(int)
        for e in self.events:
            if e["phase"] == "capture" and e["outcome"] == "ok":
                passes[(e["op_id"], e["rank"])] += 1
            if e["phase"] == "warm":
                d = e.get("detail") or {}
                broken = [k for k in ("slots_restored", "live_kv_unchanged", "eplb_unchanged") if d.get(k) is False]
                if broken:
                    found.append({"invariant": "I5", "rank": str(e["rank"]),
                                  "message": f"warm-up in {e['op_id']} touched serving state ({', '.join(broken)} false)"})
        for (op_id, rank), n in passes.items():
            if n > 1:
                found.append({"invariant": "I4", "rank": str(rank),
                              "message": f"{n} capture passes in one operation {op_id}"})
        return found

    def snapshot(self) -> dict[str, Any]:
        views = self.rank_views()
        live = [v for v in views if v["state"] not in _TERMINAL]
        by_state: dict[str, int] = defaultdict(int)
        for v in live:
            by_state[v["state"]] += 1
        return {
            "deployment": self.deployment,
            "kind": self.kind,
            "info": self.info,
            "ranks": live,
            "summary": {"ranks": len(live), "by_state": dict(by_state),
                        "requests_running": sum(v["requests_running"] for v in live),
                        "requests_waiting": sum(v["requests_waiting"] for v in live)},
            "operation": self.current_op(),
            "violations": self.violations(views),
        }
