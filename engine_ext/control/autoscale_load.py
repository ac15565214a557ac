"""The autoscaler's load rule: the width the load needs, from leading signals and measured capacity.

    target = ceil((arrival x work per request + backlog / drain budget) / (capacity per rank x utilisation))

- **arrival**: requests admitted per second at the router (the ingresses on Ray), over the last
  ``ARRIVAL_WINDOW_S``; **work per request**: the prompt and output tokens those requests asked
  for, per request, over the policy's window;
- **backlog**: the work the members hold now, in tokens (each rank's ``tokens_queued``: waiting
  requests' prompts and outputs to come, running ones' remaining output);
- **capacity per rank**: tokens a rank computes per second while requests wait for room in its
  batch (saturated), learned from the ranks' counters (``saturated_tokens / saturated_s``) over
  the last ``CAPACITY_WINDOW_S``; until the deployment has been saturated long enough, the last
  learned figure, else the policy's ``capacity_tokens_s`` (``eepctl autoscale --capacity``: a
  number or ``benchmarks/capacity.py``'s JSON), else ``DEFAULT_CAPACITY_TPS``.

Torch- and Ray-free; ``engine_ext.control.autoscale_signals`` feeds it, ``autoscaler`` decides with it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

ARRIVAL_WINDOW_S = 1.0  # the arrival rate: admissions over the last second (two ticks of 0.5 s)
CAPACITY_WINDOW_S = 120.0  # capacity: the saturated steps of the last two minutes...
MIN_SATURATED_S = 0.25  # ...once they add up to this many rank-seconds
# What benchmarks/capacity.py's closed loop measured per rank on a 16-core host (the H100 host,
# 2026-12-05, DP 4, 64 clients: 4658 output tokens/s, docs/results/h100_2026-12-05b/
# capacity_cpu_16cores_64clients.json), in tokens computed: 4658 / 4 x (8 prompt + 16 output) / 16.
DEFAULT_CAPACITY_TPS = 1747.0
CAPACITY_PROMPT_TOKENS = 8  # the prompt benchmarks/capacity.py sends (its PROMPT)


@dataclass
class LoadSignals:
    """What the load rule reads at one tick (None: not reported by this kind of deployment)."""

    arrival_rps: float | None = None
    prompt_tps: float | None = None  # prompt tokens admitted per second, same window
    base_rps: float | None = None  # requests admitted per second over the policy's window
    work_per_request: float = 0.0  # tokens (prompt + output asked for) per admitted request
    backlog_tokens: float | None = None
    capacity_tps: float = DEFAULT_CAPACITY_TPS  # per rank
    capacity_source: str = "default"

    @property
    def demand_tps(self) -> float:
        """Tokens per second the arrivals bring (before the backlog's share)."""
        return (self.arrival_rps or 0.0) * self.work_per_request


@dataclass
class LoadTerms:
    """The load rule's arithmetic at one tick, every term as the decision record shows it."""

    arrival_rps: float
    work_per_request: float
    backlog_tokens: float
    drain_s: float
    capacity_tps: float
    target_utilization: float
    capacity_source: str
    need: float = 0.0  # ranks, before the ceiling
    recommendation: int = 0
    terms: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        return (
            f"ceil(({self.arrival_rps:.4g} req/s x {self.work_per_request:.4g} tok + {self.backlog_tokens:.4g} tok"
            f" / {self.drain_s:g} s) / ({self.capacity_tps:.4g} tok/s x {self.target_utilization:g})) = "
            f"ceil({self.need:.3g}) = {self.recommendation}"
        )


def load_terms(load: LoadSignals, drain_s: float, target_utilization: float) -> LoadTerms:
    """The ranks the load needs: the formula above, each term kept."""
    t = LoadTerms(
        load.arrival_rps or 0.0,
        load.work_per_request,
        load.backlog_tokens or 0.0,
        drain_s,
        load.capacity_tps,
        target_utilization,
        load.capacity_source,
    )
    demand = t.arrival_rps * t.work_per_request + (t.backlog_tokens / drain_s if drain_s > 0 else 0.0)
    t.need = demand / max(1e-9, t.capacity_tps * target_utilization)
    t.recommendation = max(1, math.ceil(t.need - 1e-9))
    t.terms = {
        "arrival_rps": round(t.arrival_rps, 4),
        "prompt_tps": None if load.prompt_tps is None else round(load.prompt_tps, 3),
        "work_per_request": round(t.work_per_request, 3),
        "backlog_tokens": round(t.backlog_tokens, 1),
        "drain_s": drain_s,
        "demand_tps": round(demand, 3),
        "capacity_tps": round(t.capacity_tps, 3),
        "capacity_source": t.capacity_source,
        "target_utilization": target_utilization,
        "need": round(t.need, 4),
        "formula": t.text(),
    }
    return t


def drains_before_scale(load: LoadSignals, current: int, scale_s: float, target_utilization: float) -> str | None:
    """Why a scale-up would come too late: the arrivals fit the current width (at the target
    utilisation: only the backlog asks for more) and what is queued drains at its spare capacity
    before the scale could serve (the burst is shorter than the scale it would need). None: the
    scale is worth it."""
    spare = current * load.capacity_tps - load.demand_tps
    backlog = load.backlog_tokens or 0.0
    if load.demand_tps > current * load.capacity_tps * target_utilization or backlog <= 0:
        return None
    drain = backlog / spare
    if drain <= scale_s:
        return f"the backlog ({backlog:.0f} tok) drains at DP {current} in {drain:.2f}s, before a {scale_s:.2f}s scale"
    return None


class ArrivalWindow:
    """The router's admission counters, read each tick, as rates."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self.keep_s = keep_s
        self.rows: deque[tuple[float, float, float, float]] = deque()  # (at, requests, prompt, output)

    def add(self, now: float, counts: dict[str, int] | None) -> None:
        if counts is None:
            return
        row = (
            now,
            float(counts.get("requests", 0)),
            float(counts.get("prompt_tokens", 0)),
            float(counts.get("output_tokens", 0)),
        )
        if self.rows and row[1] < self.rows[-1][1]:
            self.rows.clear()  # a restarted router counts from 0 again: rates start over
        self.rows.append(row)
        while len(self.rows) > 2 and self.rows[0][0] < now - self.keep_s:
            self.rows.popleft()

    def _since(self, now: float, span_s: float) -> tuple[float, float, float, float] | None:
        """The newest row at least ``span_s`` older than the last (else the oldest), or None."""
        if len(self.rows) < 2:
            return None
        last = self.rows[-1]
        old = next((r for r in reversed(self.rows) if r[0] <= last[0] - span_s), self.rows[0])
        return old if last[0] - old[0] > 0 else None

    def signals(self, now: float, window_s: float) -> tuple[float | None, float | None, float, float | None]:
        """(requests/s and prompt tokens/s over the last ARRIVAL_WINDOW_S, tokens per request and
        requests/s over ``window_s``); None before two readings."""
        short, long_ = self._since(now, ARRIVAL_WINDOW_S), self._since(now, window_s)
        if short is None or long_ is None:
            return None, None, 0.0, None
        last = self.rows[-1]
        span = last[0] - short[0]
        asked = last[1] - long_[1]
        per_request = ((last[2] - long_[2]) + (last[3] - long_[3])) / asked if asked > 0 else 0.0
        return (last[1] - short[1]) / span, (last[2] - short[2]) / span, per_request, asked / (last[0] - long_[0])


class CapacityLearner:
    """A rank's tokens per second at saturation, from the ranks' counters (summed over ranks:
    saturated tokens over saturated rank-seconds)."""

    def __init__(self, learned: dict[str, Any] | None = None) -> None:
        self.last: dict[tuple[int, str], tuple[float, float]] = {}  # (rank, instance) -> (tokens, seconds)
        self.samples: deque[tuple[float, float, float]] = deque()  # (at, tokens, seconds)
        self.learned: dict[str, Any] | None = learned  # {tokens_s, saturated_s, at}: persisted

    def add(self, now: float, statuses: list[dict[str, Any]]) -> None:
        for st in statuses:
            if not isinstance(st, dict) or st.get("saturated_s") is None or "rank" not in st:
                continue
            key = (int(st["rank"]), str(st.get("instance_id") or ""))
            cur = (float(st.get("saturated_tokens") or 0), float(st["saturated_s"]))
            prev = self.last.get(key)
            self.last[key] = cur
            if prev is not None and cur[1] > prev[1] and cur[0] >= prev[0]:
                self.samples.append((now, cur[0] - prev[0], cur[1] - prev[1]))
        while self.samples and self.samples[0][0] < now - CAPACITY_WINDOW_S:
            self.samples.popleft()
        seconds = sum(s for _, _, s in self.samples)
        if seconds >= MIN_SATURATED_S:
            tps = sum(t for _, t, _ in self.samples) / seconds
            self.learned = {"tokens_s": round(tps, 3), "saturated_s": round(seconds, 3), "at": now}

    def capacity(self, seed: float) -> tuple[float, str]:
        """(tokens/s per rank, where the figure comes from)."""
        if self.learned:
            return float(self.learned["tokens_s"]), (
                f"learned: {self.learned['saturated_s']:.3g} rank-s of saturated steps"
            )
        if seed > 0:
            return seed, "seed: --capacity"
        return DEFAULT_CAPACITY_TPS, "default seed (benchmarks/capacity.py, H100 host's 16 cores)"


def capacity_from_benchmark(result: dict[str, Any]) -> float:
    """A rank's tokens per second from ``benchmarks/capacity.py``'s JSON (its closed loop): the
    least over the DP sizes measured of output tokens/s per rank, in tokens computed (prompt and
    output). ValueError when the file holds no closed-loop figure."""
    tokens = float((result.get("args") or {}).get("tokens") or 16)
    per_rank = [
        float(row["closed"]["tok_s"]) / int(row["dp"]) * (CAPACITY_PROMPT_TOKENS + tokens) / tokens
        for row in result.get("load") or []
        if (row.get("closed") or {}).get("tok_s") and row.get("dp")
    ]
    if not per_rank:
        raise ValueError("no closed-loop tok/s in it (run benchmarks/capacity.py with --parts closed)")
    return round(min(per_rank), 3)
