"""The registry's picture of a deployment, built only from what ranks report.

Ray-free and torch-free: the Ray registry actor wraps it, the process launcher uses it
directly, and a new registry rebuilds it from the ranks' next reports. It stores typed records
(engine_ext.records) and renders its views from them as JSON-ready builtins.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Any

import msgspec

from engine_ext.control.invariants import TERMINAL, event_violations, gone, rank_violations
from engine_ext.control.worker_records import merge as merge_worker
from engine_ext.protocol import STALE_AFTER_S
from engine_ext.records import (
    Event,
    Operation,
    OpState,
    RankState,
    RankStatus,
    Record,
    VllmWorkerStatus,
    from_builtins,
    rank_status_type,
    to_builtins,
)

_MAX_EVENTS = 5000
_RANK_PHASES = {"transfer", "precopy", "reshuffle", "warm", "capture"}
_MAX_RECORD_BYTES = 1 << 20


def _intake(data: Any, record_type: type[Record], what: str) -> Record:
    """The typed record, or a ValueError; nothing that is refused touches the state (the fuzz
    tests hold us to it). msgspec checks the types; free-form parts (an event's ``detail``, an
    operation's ``plan``) must encode as JSON within the size limit."""
    record = from_builtins(data, record_type, what)
    try:
        size = len(msgspec.json.encode(record))
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise ValueError(f"{what} is not JSON-representable: {e}") from None
    if size > _MAX_RECORD_BYTES:
        raise ValueError(f"{what} is {size} bytes, over the {_MAX_RECORD_BYTES} byte limit")
    return record


class RegistryState:
    def __init__(self, deployment: str, kind: str = "reference") -> None:
        self.deployment = deployment
        self.kind = kind
        self.info: dict[str, Any] = {}
        self.fenced_reports = 0  # status reports refused from fenced ranks
        self.ranks: dict[int, RankStatus] = {}
        self.received_at: dict[int, float] = {}  # by rank: heartbeat age is measured on this clock
        self.events: deque[tuple[int, Event]] = deque(maxlen=_MAX_EVENTS)  # (seq, event)
        self._event_keys: set[tuple[str, int, str, float]] = set()
        self.ops: dict[str, Operation] = {}
        self.workers: dict[int, tuple[VllmWorkerStatus, float]] = {}  # vLLM: by DP rank, (record, received)
        self.rejected: list[str] = []
        self.seq = 0
        self._left_at: dict[int, list[int]] = {}  # rank -> the event seqs at which it was forgotten
        self.started = time.time()
        # Set by a controller that recreated this registry: how many ranks it runs. Until that
        # many have reported, the snapshot says it is rebuilding instead of showing a short list.
        self.expected_ranks: int | None = None

    def set_info(self, info: Mapping[str, Any]) -> None:
        info = dict(info)
        expected = info.pop("expected_ranks", None)
        if isinstance(expected, int) and expected > 0:
            self.expected_ranks = expected
        self.info.update(info)

    # ---- intake --------------------------------------------------------------------------
    def report_status(self, status: Any) -> dict[str, Any]:
        """Accept a rank's status. A second live rank claiming an identity is refused (I1)."""
        kind = status.get("kind") if isinstance(status, Mapping) else None
        st = _intake(status, rank_status_type(kind), "status")
        fenced = ((self.info.get("control") or {}).get("fenced") or {}).get(str(st.rank))
        if fenced is not None and getattr(st, "epoch", 0) <= int(fenced.get("epoch", 0)):
            # A rank of a world the controller fenced it out of (it hung or was cut off, and came
            # back): its reports never count again; a new rank given its number has a newer epoch.
            self.fenced_reports += 1
            return {"accepted": False, "reason": f"rank {st.rank} was fenced at epoch {fenced.get('epoch')}"}
        for other in self.ranks.values():
            if other.rank != st.rank and other.instance_id == st.instance_id and not gone(other):
                msg = f"duplicate identity {st.instance_id!r}: ranks {other.rank} and {st.rank}"
                if msg not in self.rejected:
                    self.rejected.append(msg)
                return {"accepted": False, "reason": msg}
        self.ranks[st.rank] = st
        self.received_at[st.rank] = time.time()
        return {"accepted": True}

    def report_worker(self, record: Any) -> dict[str, Any]:
        """A vLLM worker's own record, merged into its rank's at every view (worker_records)."""
        try:
            worker = _intake(record, VllmWorkerStatus, "worker status")
        except ValueError as e:  # answered, not raised: the worker logs it once (a refused field)
            return {"accepted": False, "reason": str(e)}
        self.workers[worker.rank] = (worker, time.time())
        return {"accepted": True}

    def report_event(self, event: Any) -> None:
        ev = _intake(event, Event, "event")
        key = (ev.op_id, ev.rank, ev.phase, round(ev.start, 6))
        if key in self._event_keys:
            return  # re-sent after a registry restart
        self._event_keys.add(key)
        self.seq += 1
        self.events.append((self.seq, ev))

    def record_operation(self, op: Any) -> None:
        record = _intake(op, Operation, "operation")
        self.ops[record.op_id] = record

    def forget_rank(self, rank: int) -> None:
        """The rank left the deployment: a process that takes its number later is a new joiner."""
        self._left_at.setdefault(rank, []).append(self.seq)
        self.ranks.pop(rank, None)
        self.received_at.pop(rank, None)
        self.workers.pop(rank, None)

    # ---- views -------------------------------------------------------------------------------
    def _rank_records(self, now: float | None = None) -> list[RankStatus]:
        """Each rank's last report with its heartbeat age; silent too long, it shows as stale."""
        now = now or time.time()
        out = []
        for rank in sorted(self.ranks):
            st = self.ranks[rank]
            if rank in self.workers:
                worker, received = self.workers[rank]
                st = merge_worker(st, worker, max(0.0, now - received))
            age = max(0.0, now - self.received_at.get(rank, st.last_heartbeat))
            st = msgspec.structs.replace(st, heartbeat_age_s=round(age, 2))
            if age > STALE_AFTER_S and st.state not in TERMINAL:
                st = msgspec.structs.replace(
                    st, state=RankState.STALE.value, state_reason=f"no heartbeat for {age:.1f}s (was {st.state})"
                )
            out.append(st)
        return out

    def rank_views(self, now: float | None = None) -> list[dict[str, Any]]:
        return [to_builtins(st) for st in self._rank_records(now)]

    def current_op(self) -> dict[str, Any] | None:
        running = [o for o in self.ops.values() if o.state == OpState.RUNNING.value]
        return to_builtins(running[-1]) if running else None

    def operations(self, op_id: str | None = None) -> list[dict[str, Any]]:
        """Operations with the ranks' phase durations folded in (slowest rank per phase)."""
        ops = sorted(self.ops.values(), key=lambda o: o.started)
        if op_id:
            ops = [o for o in ops if o.op_id == op_id]
        out = []
        for op in ops:
            phases = dict(op.phase_durations)
            for _, e in self.events:
                if e.op_id == op.op_id and e.rank >= 0 and e.phase in _RANK_PHASES:
                    phases[e.phase] = max(phases.get(e.phase, 0.0), e.duration_s)
            out.append(to_builtins(msgspec.structs.replace(op, phase_durations=phases)))
        return out

    def events_for(self, op_id: str | None = None, since_seq: int = 0) -> list[dict[str, Any]]:
        """The events of ``op_id`` (all without one); for a vLLM operation also its ranks' events,
        which carry the ids vLLM's ranks derive (``rank_ops``), while it ran."""
        ranks, (lo, hi) = self._rank_ops(op_id)
        return [
            {**to_builtins(e), "seq": seq}
            for seq, e in self.events
            if seq > since_seq
            and (op_id is None or e.op_id == op_id or (e.op_id in ranks and e.end >= lo and e.start <= hi))
        ]

    def _rank_ops(self, op_id: str | None) -> tuple[set[str], tuple[float, float]]:
        op = self.ops.get(op_id) if op_id else None
        rank_ops = getattr(op, "rank_ops", None)
        if op is None or not isinstance(rank_ops, list):
            return set(), (0.0, 0.0)
        return set(rank_ops), (op.started, (op.finished or time.time()) + 5.0)

    def violations(self, ranks: list[RankStatus] | None = None) -> list[dict[str, str]]:
        """Invariants the registry can see broken from telemetry alone (engine_ext.control.invariants)."""
        ranks = ranks if ranks is not None else self._rank_records()
        policy = (self.info.get("config") or {}).get("capture_policy", "recapture")
        found = rank_violations(ranks)
        found.extend(event_violations(self.events, policy, self._left_at, self.kind))
        found.extend({"invariant": "I1", "rank": "-", "message": m} for m in self.rejected[-5:])
        return found

    def snapshot(self) -> dict[str, Any]:
        live = [st for st in self._rank_records() if not gone(st)]
        by_state: dict[str, int] = defaultdict(int)
        for st in live:
            by_state[st.state] += 1
        if self.expected_ranks is not None and len(live) >= self.expected_ranks:
            self.expected_ranks = None  # rebuilt
        return {
            "deployment": self.deployment,
            "kind": self.kind,
            "info": self.info,
            "ranks": [to_builtins(st) for st in live],
            "summary": {
                "ranks": len(live),
                "by_state": dict(by_state),
                "standby": by_state.get("standby", 0),
                "requests_running": sum(st.requests_running for st in live),
                "requests_waiting": sum(st.requests_waiting for st in live),
                **memory_summary(live),
            },
            "operation": self.current_op(),
            "violations": self.violations(live),
            "rebuilding": self.expected_ranks is not None,
            "expected_ranks": self.expected_ranks,
            "registry_age_s": round(time.time() - self.started, 2),
            "eplb": eplb_balance(live),
        }


def _total(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def memory_summary(ranks: list[RankStatus]) -> dict[str, int | None]:
    """What the ranks hold resident (their ``memory_bytes``), all of them and the standby ones (a
    reference standby pool's, a vLLM prepare held open), with the standby ranks' KV cache; None
    where no rank of them reports it."""
    standby = [st for st in ranks if st.state == "standby"]
    return {
        "memory_bytes": _total([st.memory_bytes for st in ranks]),
        "standby_memory_bytes": _total([st.memory_bytes for st in standby]),
        "standby_kv_cache_bytes": _total([st.kv_cache_bytes for st in standby]),
    }


def eplb_balance(ranks: list[RankStatus]) -> dict[str, Any]:
    """The deployment's expert-load balance over the ranks' recent EPLB windows, as vLLM's EPLB
    logs it: each rank's load is what its slots carry (an expert's tokens split evenly over its
    replicas); imbalance is max/mean of those loads (1.0 balanced). None where there is no load
    (or the ranks do not report slots: a vLLM rank)."""
    holders = [st for st in ranks if st.eplb_slots and st.eplb_recent_load]
    total: dict[int, float] = defaultdict(float)
    replicas: dict[int, int] = defaultdict(int)
    for st in holders:
        for e, n in enumerate(st.eplb_recent_load):
            total[e] += n
        for e in st.eplb_slots:
            replicas[e] += 1
    load = {st.rank: sum(total[e] / replicas[e] for e in st.eplb_slots) for st in holders}
    whole = sum(load.values())
    if not load or whole <= 0:
        return {"imbalance": None, "rank_load": {}, "rank_share": {}}
    mean = whole / len(load)
    return {
        "imbalance": round(max(load.values()) / mean, 4),
        "rank_load": {str(r): round(v, 3) for r, v in sorted(load.items())},
        "rank_share": {str(r): round(v / whole, 4) for r, v in sorted(load.items())},
    }
