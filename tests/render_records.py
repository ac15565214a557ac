"""Recorded-style records for the renderer tests: a 256-rank deployment's status and a 64-rank
scale's events, built through the real typed records and the registry's own state, so the
renderers see exactly what `eepctl status/events -o json` would hand them."""

from __future__ import annotations

from typing import Any

from engine_ext.control.registry_state import RegistryState
from engine_ext.records import Event, Operation, RankStatus, to_builtins

T0 = 1_760_000_000.0  # a fixed wall clock: the snapshots must not depend on today


def rank_status(rank: int, dp: int, **over: Any) -> dict[str, Any]:
    """One rank as RankTelemetry.status() sends it: 8 experts over 4 slots per rank."""
    slots = [(rank * 4 + i) % 8 for i in range(4)]
    load = [float((e + 1) * 10) if rank % 2 == 0 else 10.0 for e in range(8)]
    st = RankStatus(
        deployment="big",
        rank=rank,
        instance_id=f"big_dp{rank}",
        engine_id=f"big_dp{rank}",
        node=f"node-{rank // 8}/10.0.{rank // 8}.1",
        pid=1000 + rank,
        state="serving",
        dp_size=dp,
        requests_running=rank % 3,
        requests_waiting=0,
        slots_used=rank % 3,
        slots_total=8,
        kv_blocks_used=rank % 100,
        kv_blocks_total=128,
        workspace_bytes=1 << 20,
        rss_bytes=(3 << 29) + (rank % 8) * (1 << 20),
        memory_bytes=(3 << 29) + (rank % 8) * (1 << 20),
        workspace_locked=True,
        workspace_required_bytes=1 << 20,
        graphs_captured=4,
        capture_sizes=[1, 2, 4, 8],
        graph_replays=100 + rank,
        last_capture_s=0.05,
        capture_times_s={"1": 0.06, "2": 0.07, "4": 0.08, "8": 0.09},
        last_capture_pass_s=0.3,
        captures_this_op=1,
        eplb_step=50,
        physical_experts=4 * dp,
        logical_experts=8,
        steps=1000,
        last_heartbeat=T0,
        eplb_logical_load=load,
        eplb_recent_load=load,
        eplb_slots=slots,
    )
    return {**to_builtins(st), **over}


def big_status(ranks: int = 256) -> dict[str, Any]:
    """The registry snapshot of a ``ranks``-rank deployment with a failed, a draining and a
    stale-replay rank among the serving ones."""
    state = RegistryState("big")
    for r in range(ranks):
        over: dict[str, Any] = {}
        if r == 200:
            over = {"state": "failed", "state_reason": "RuntimeError: gloo connection reset"}
        elif r == 17:
            over = {"state": "draining", "state_reason": "scale to DP 255"}
        elif r == 5:
            over = {"stale_replays_refused": 2}
        state.report_status(rank_status(r, ranks, **over))
    snap = state.snapshot()
    for r in snap["ranks"]:
        r["heartbeat_age_s"] = 0.4
    snap["registry_age_s"] = 12.0
    return snap


def scale_events(ranks: int = 64, op_id: str = "op-1700000000-abcd") -> dict[str, Any]:
    """`eepctl events --op` data of a scale from ``ranks - 8`` to ``ranks``: the controller's
    phases and each rank's prepare, commit (holding reshuffle, warm, capture); ranks 56.. joined,
    rank 13 was slow to capture."""
    evs: list[Event] = []

    def ev(rank: int, phase: str, start: float, end: float, **detail: Any) -> None:
        evs.append(Event(op_id, rank, phase, T0 + start, T0 + end, "ok", detail))

    ev(-1, "launch", 0.0, 2.5, ranks=list(range(ranks - 8, ranks)))
    ev(-1, "prepare", 2.5, 2.9)
    for r in range(ranks):
        joined = r >= ranks - 8
        slow = 0.4 if r == 13 else 0.0
        ev(r, "prepare", 2.5, 2.85 if joined else 2.6)
        ev(r, "transfer", 2.6, 2.8) if joined else None
        ev(r, "reshuffle", 2.95, 3.05)
        ev(r, "warm", 3.05, 3.2)
        ev(r, "capture", 3.2, 3.5 + slow)
        ev(r, "commit", 2.92, 3.52 + slow, pause_s=0.6 + slow)
    ev(-1, "commit", 2.9, 3.95)
    ev(-1, "cleanup", 3.95, 3.96)
    events = [{**to_builtins(e), "seq": i + 1} for i, e in enumerate(sorted(evs, key=lambda e: e.start))]
    op = {
        "op_id": op_id,
        "deployment": "big",
        "from_size": ranks - 8,
        "to_size": ranks,
        "state": "succeeded",
        "phase": "cleanup",
        "started": T0,
        "finished": T0 + 3.96,
        "serving_pause_s": 1.0,
    }
    return {"events": events, "operations": [op]}


def history(ops: int = 6) -> dict[str, Any]:
    """`eepctl events` data of a deployment's history, oldest first, through the registry's own
    state: scales up and down, a rank fenced and the recovery around it, the grow back (policy
    replace), a rebuild, and a scale rolled back with a long error; each scale with rank events."""
    state = RegistryState("big")
    kinds = [
        ("scale", "", 2, 4),
        ("scale", "", 4, 3),
        ("recover", "", 3, 2),
        ("scale", "replace", 2, 3),
        ("rebuild", "", 3, 3),
        ("scale", "", 3, 4),
    ]
    for i in range(ops):
        kind, cause, a, b = kinds[i % len(kinds)]
        op_id = f"op-20261206-2340{i:02d}-{0xA000 + i:04x}"
        start = T0 + 60 * i
        failed = i == ops - 1 and kind == "scale"
        state.record_operation(
            to_builtins(
                Operation(
                    op_id,
                    "big",
                    a,
                    b,
                    state="rolled_back" if failed else "succeeded",
                    phase="cleanup",
                    started=start,
                    finished=start + 2.5,
                    kind=kind,
                    cause=cause,
                    serving_pause_s=0.125,
                    error="rank 3 failed in prepare: RuntimeError: gloo connection reset by peer while "
                    "receiving expert 5 of layer 1 from rank 0"
                    if failed
                    else "",
                    phase_durations={"prepare": 0.4, "commit": 1.25}
                    if kind == "scale"
                    else {"detect": 0.2, "regroup": 0.1},
                    captures_per_rank={str(r): 1 for r in range(b)},
                )
            )
        )
        if kind == "recover":
            state.report_event(
                to_builtins(
                    Event(
                        "",
                        2,
                        "fence",
                        start - 1,
                        start - 1,
                        "ok",
                        {"epoch": 4, "reason": "silent for 7.0s (deadline 5s)"},
                    )
                )
            )
        state.report_event(to_builtins(Event(op_id, -1, "prepare", start, start + 0.4)))
        for r in range(b):
            state.report_event(to_builtins(Event(op_id, r, "prepare", start, start + 0.3)))
            state.report_event(to_builtins(Event(op_id, r, "commit", start + 0.5, start + 1.7, "ok", {"pause_s": 0.1})))
        state.report_event(to_builtins(Event(op_id, -1, "commit", start + 0.4, start + 1.8)))
    return {"events": state.events_for(), "operations": state.operations()}
