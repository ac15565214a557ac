"""The autoscaler's window of rank signals: what the controller's loop saw in the ranks' status
records over the policy's window, turned into the ``Observed`` of one tick. Torch- and Ray-free.

Per rank and tick it keeps requests (waiting + running; a reference rank's also as a
request-seconds counter, read as the exact time-weighted mean over the window), KV-cache use (a vLLM rank's
``kv_usage``, else used/total blocks) and the rank's windowed TTFT/TPOT p95; ``observed`` gives
the window's mean load per rank and the p95 readings as the latency samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_ext.control.autoscaler import Observed, RankSignals


@dataclass(frozen=True)
class RankReading:
    at: float
    rank: int
    requests: float
    kv_use: float
    ttft_ms: float | None
    tpot_ms: float | None
    held_s: float | None = None  # the rank's request-seconds counter (a reference rank's), at ``rank_at``
    rank_at: float = 0.0
    instance: str = ""


def kv_use(st: dict[str, Any]) -> float:
    """A rank's KV-cache use, 0..1."""
    if st.get("kv_usage") is not None and st.get("kind") == "vllm":
        return float(st["kv_usage"])
    total = float(st.get("kv_blocks_total") or 0)
    return float(st.get("kv_blocks_used") or 0) / total if total > 0 else 0.0


def reading(now: float, st: dict[str, Any]) -> RankReading:
    held = st.get("request_seconds")
    return RankReading(now, int(st["rank"]), float((st.get("requests_waiting") or 0) + (st.get("requests_running") or 0)),
                       kv_use(st), st.get("ttft_ms_p95"), st.get("tpot_ms_p95"),
                       None if held is None else float(held), float(st.get("last_heartbeat") or 0.0),
                       str(st.get("instance_id") or ""))


def mean_held(rows: list[RankReading], min_span_s: float = 0.5) -> float:
    """The mean requests a rank held over ``rows``: exact from its request-seconds counter where
    readings span at least ``min_span_s`` of one process's clock (a restart's reset is skipped),
    else the mean of the sampled counts (a vLLM rank's)."""
    timed = sorted((r for r in rows if r.held_s is not None and r.rank_at > 0), key=lambda r: r.rank_at)
    area = span = 0.0
    for a, b in zip(timed, timed[1:]):
        if b.instance == a.instance and b.rank_at > a.rank_at and b.held_s >= a.held_s:  # type: ignore[operator]
            area += b.held_s - a.held_s  # type: ignore[operator]
            span += b.rank_at - a.rank_at
    if span >= min_span_s:
        return area / span
    return sum(x.requests for x in rows) / max(1, len(rows))


class SignalWindow:
    """The last ``window_s`` seconds of rank readings."""

    def __init__(self, window_s: float = 60.0, keep: int = 20000) -> None:
        self.window_s = window_s
        self.readings: deque[RankReading] = deque(maxlen=keep)

    def add(self, now: float, statuses: list[dict[str, Any]]) -> None:
        """One tick's rank status records (any rank; ``observed`` keeps the members')."""
        for st in statuses:
            if isinstance(st, dict) and "rank" in st:
                self.readings.append(reading(now, st))
        while self.readings and self.readings[0].at < now - self.window_s:
            self.readings.popleft()

    def observed(self, now: float, members: list[int], *, busy: str | None = None, num_experts: int = 1,
                 slots_per_rank: int = 1, standby_ready: int = 0, capacity: Callable[[int], str | None] | None = None,
                 eplb_imbalance: float | None = None) -> Observed:
        """The tick's ``Observed``: per member, its mean load and KV use over the window and its
        TTFT/TPOT p95 readings."""
        ranks = []
        for r in members:
            rows = [x for x in self.readings if x.rank == r and x.at >= now - self.window_s]
            n = max(1, len(rows))
            ranks.append(RankSignals(r, mean_held(rows), sum(x.kv_use for x in rows) / n,
                                     [x.ttft_ms for x in rows if x.ttft_ms is not None],
                                     [x.tpot_ms for x in rows if x.tpot_ms is not None]))
        return Observed(dp=len(members), ranks=ranks, window_s=self.window_s, busy=busy, num_experts=num_experts,
                        slots_per_rank=slots_per_rank, standby_ready=standby_ready, capacity=capacity,
                        eplb_imbalance=eplb_imbalance)
