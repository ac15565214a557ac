"""The parts of a rank's status record (engine_ext.records.RankStatus) that its components
report: the scheduler's requests, slots, KV blocks and latency; the graph manager's captures and
replays; the EPLB state's layout and load; the process's resident memory. The engine adds its
identity, state and world."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_ext.elastic.eplb import EplbState
    from engine_ext.elastic.graphs import GraphManager
    from engine_ext.rank.scheduler import Scheduler


def scheduler_fields(s: Scheduler, now: float) -> dict[str, Any]:
    """Requests, slots and KV blocks in use, held request-seconds, windowed latency and the
    autoscaler's load and capacity signals."""
    return dict(
        requests_running=len(s.running),
        requests_waiting=len(s.waiting),
        request_seconds=round(s.held.total(now), 6),
        slots_used=s.slots.used,
        slots_total=s.slots.total,
        kv_blocks_used=s.blocks.used,
        kv_blocks_total=s.blocks.total,
        **s.latency.summary(),  # windowed TTFT/TPOT p50/p95 (engine_ext/rank/latency.py)
        **s.served.summary(),
        tokens_queued=s.tokens_queued(),
    )


def graph_fields(g: GraphManager) -> dict[str, Any]:
    """What was captured, when and how long it took, and the replays and eager steps since the
    last switch (I4's evidence)."""
    return dict(
        graphs_captured=len(g.captured_sizes),
        capture_sizes=g.captured_sizes,
        graph_kind=g.kind,
        graph_replays=g.stats.replays,
        last_capture_s=g.stats.last_capture_s,
        capture_times_s={str(k): round(v, 6) for k, v in sorted(g.stats.capture_durations.items())},
        last_capture_pass_s=(round(sum(g.stats.capture_durations.values()), 6) if g.stats.capture_durations else None),
        switch_op=g.window.op_id,
        replays_since_switch={str(k): v for k, v in sorted(g.window.replays.items())},
        eager_since_switch={str(k): v for k, v in sorted(g.window.eager.items())},
        eager_fallbacks=g.stats.eager_fallbacks,
        captured_in={str(k): v for k, v in g.captured_in.items()},
    )


def eplb_fields(eplb: EplbState, position: int) -> dict[str, Any]:
    """The EPLB step and imbalance, the layout's size, the load counts, and the logical experts
    in the slots at the model's EP ``position``."""
    return dict(
        eplb_step=eplb.step,
        eplb_imbalance=eplb.imbalance(),
        physical_experts=eplb.layout.num_physical,
        logical_experts=eplb.layout.num_logical,
        eplb_logical_load=list(eplb.logical_load),
        eplb_recent_load=eplb.recent_load(),
        eplb_slots=eplb.layout.local_logical(position),
    )


def process_rss_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """This process's resident set (``VmRSS`` of /proc/self/status, one small read), or None where
    there is no such file (not Linux). Pages shared with other processes count in each one's."""
    try:
        text = status.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            return int(value) * 1024 if unit == "kB" else int(value)
    return None
