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

from engine_ext.control.autoscale_cost import ScaleCost
from engine_ext.control.autoscale_load import (
    ArrivalWindow,
    CapacityLearner,
    LoadSignals,
)
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
    tokens_queued: float | None = None  # the work the rank holds, in tokens (None: not reported)


def kv_use(st: dict[str, Any]) -> float:
    """A rank's KV-cache use, 0..1."""
    if st.get("kv_usage") is not None and st.get("kind") == "vllm":
        return float(st["kv_usage"])
    total = float(st.get("kv_blocks_total") or 0)
    return float(st.get("kv_blocks_used") or 0) / total if total > 0 else 0.0


def reading(now: float, st: dict[str, Any]) -> RankReading:
    held, queued = st.get("request_seconds"), st.get("tokens_queued")
    return RankReading(
        now,
        int(st["rank"]),
        float((st.get("requests_waiting") or 0) + (st.get("requests_running") or 0)),
        kv_use(st),
        st.get("ttft_ms_p95"),
        st.get("tpot_ms_p95"),
        None if held is None else float(held),
        float(st.get("last_heartbeat") or 0.0),
        str(st.get("instance_id") or ""),
        None if queued is None else float(queued),
    )


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
    """The last ``window_s`` seconds of rank readings, the router's admission counters and the
    ranks' saturated-step counters (the load rule's arrivals and capacity: kept across worlds)."""

    def __init__(self, window_s: float = 60.0, keep: int = 20000, learned: dict[str, Any] | None = None) -> None:
        self.window_s = window_s
        self.readings: deque[RankReading] = deque(maxlen=keep)
        self.arrivals = ArrivalWindow(window_s)
        self.capacity = CapacityLearner(learned)

    def add(self, now: float, statuses: list[dict[str, Any]], admissions: dict[str, int] | None = None) -> None:
        """One tick's rank status records (any rank; ``observed`` keeps the members') and the
        router's admission counters (None: it counts none)."""
        for st in statuses:
            if isinstance(st, dict) and "rank" in st:
                self.readings.append(reading(now, st))
        while self.readings and self.readings[0].at < now - self.window_s:
            self.readings.popleft()
        self.arrivals.keep_s = self.window_s
        self.arrivals.add(now, admissions)
        self.capacity.add(now, statuses)

    def load(self, now: float, members: list[int], capacity_seed: float = 0.0) -> LoadSignals | None:
        """The load rule's signals now; None before the router's counters were read twice."""
        rps, prompt_tps, per_request, base_rps = self.arrivals.signals(now, self.window_s)
        if rps is None:
            return None
        latest: dict[int, RankReading] = {}
        for x in self.readings:
            if x.rank in members:
                latest[x.rank] = x
        queued = [x.tokens_queued for x in latest.values() if x.tokens_queued is not None]
        tps, source = self.capacity.capacity(capacity_seed)
        return LoadSignals(rps, prompt_tps, base_rps, per_request, sum(queued) if queued else None, tps, source)

    def observed(
        self,
        now: float,
        members: list[int],
        *,
        busy: str | None = None,
        num_experts: int = 1,
        slots_per_rank: int = 1,
        standby_ready: int = 0,
        prepared_dp: int | None = None,
        capacity: Callable[[int], str | None] | None = None,
        eplb_imbalance: float | None = None,
        capacity_seed: float = 0.0,
        cost: ScaleCost | None = None,
    ) -> Observed:
        """The tick's ``Observed``: per member, its mean load and KV use over the window and its
        TTFT/TPOT p95 readings."""
        ranks = []
        for r in members:
            rows = [x for x in self.readings if x.rank == r and x.at >= now - self.window_s]
            n = max(1, len(rows))
            ranks.append(
                RankSignals(
                    r,
                    mean_held(rows),
                    sum(x.kv_use for x in rows) / n,
                    [x.ttft_ms for x in rows if x.ttft_ms is not None],
                    [x.tpot_ms for x in rows if x.tpot_ms is not None],
                )
            )
        return Observed(
            dp=len(members),
            ranks=ranks,
            window_s=self.window_s,
            busy=busy,
            num_experts=num_experts,
            slots_per_rank=slots_per_rank,
            standby_ready=standby_ready,
            prepared_dp=prepared_dp,
            capacity=capacity,
            eplb_imbalance=eplb_imbalance,
            load=self.load(now, members, capacity_seed),
            cost=cost,
        )
