"""The EP-width autoscaler's decision: from a window of rank signals to a desired DP size.

Pure and torch/Ray-free: ``Autoscaler.decide`` is called once per tick of the controller's
reconcile loop with what the controller observed, and returns a ``Decision``, the audit record
of that tick. It only ever proposes a desired size; the loop acts on it (mode ``on``) through
the orchestrator's scale, and reports the outcome back with ``Autoscaler.record_outcome``.

The rules follow Kubernetes' HPA (desired = ceil(current x signal / target), a tolerance band,
stabilisation windows), Knative's panic mode and AIBrix/KEDA's "largest recommendation of
several signals wins", adapted to EP width (docs/autoscaling.md says why each default).
"""

from __future__ import annotations

import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_ext.config import AutoscaleMode
from engine_ext.control.autoscale_cost import AUTO, ScaleCost, timing
from engine_ext.control.autoscale_load import (
    LoadSignals,
    drains_before_scale,
    load_terms,
)
from engine_ext.control.autoscale_policy import AutoscalePolicy

__all__ = [
    "AutoscaleMode",
    "AutoscalePolicy",
    "Autoscaler",
    "Decision",
    "Observed",
    "RankSignals",
    "SignalReading",
    "p95",
]

CapacityCheck = Callable[[int], str | None]
"""The placement preflight: why ``n`` more ranks would not fit the cluster, or None."""


def p95(samples: list[float]) -> float | None:
    """The 95th percentile (nearest rank) of ``samples``; None when there are none."""
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, math.ceil(0.95 * len(s)) - 1))]


@dataclass
class RankSignals:
    """One rank's signals over the window: mean requests (waiting + running), mean KV-cache use
    (0..1), and the TTFT/TPOT samples (ms) of the requests it finished in the window."""

    rank: int
    requests: float = 0.0
    kv_use: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)


@dataclass
class Observed:
    """What the controller saw this tick. ``busy`` names a running operation or recovery."""

    dp: int
    ranks: list[RankSignals]
    window_s: float = 60.0
    busy: str | None = None
    num_experts: int = 1
    slots_per_rank: int = 1
    standby_ready: int = 0
    prepared_dp: int | None = None  # the size vLLM's engine cores prepared ahead serve by the commit alone
    capacity: CapacityCheck | None = None  # not recorded; its verdict is
    eplb_imbalance: float | None = None  # shown, not a scaling target
    load: LoadSignals | None = None  # the load rule's signals (engine_ext.control.autoscale_load)
    cost: ScaleCost | None = None  # what a scale costs here (engine_ext.control.autoscale_cost)


@dataclass
class SignalReading:
    """One signal's aggregate, its target and the size it alone recommends."""

    name: str
    value: float
    target: float
    ratio: float
    recommendation: int
    samples: int = 0
    terms: dict[str, Any] | None = None  # the load rule's arithmetic, each term


@dataclass
class Decision:
    """The audit record of one tick. ``act`` says the loop must scale to ``recommendation``."""

    id: str
    at: float
    mode: str
    current_dp: int
    window_s: float
    signals: list[SignalReading]
    raw_recommendation: int
    recommendation: int
    rule: str
    action: str
    act: bool = False
    panic: bool = False
    eplb_imbalance: float | None = None
    outcome: str = ""
    timing: dict[str, Any] | None = None  # the delays used, and why (engine_ext.control.autoscale_cost)
    standby: int | None = None  # the standby pool ``--standby auto`` keeps (None: the operator's)
    adopts: int | None = None  # the scale-up adopts the engine cores vLLM prepared for this DP (its commit alone)

    def to_dict(self) -> dict[str, Any]:
        """A copy as plain data (one level per container: ``asdict``'s deep copy made a
        persisted trail of 200 decisions cost milliseconds a tick)."""
        d = dict(self.__dict__)
        d["signals"] = [dict(s.__dict__, terms=dict(s.terms) if s.terms else s.terms) for s in self.signals]
        d["timing"] = dict(self.timing) if self.timing else self.timing
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decision:
        data = dict(d)
        data["signals"] = [SignalReading(**s) for s in d.get("signals", [])]
        return cls(**data)


def _hpa(current: int, value: float, target: float, tolerance: float) -> tuple[float, int]:
    """HPA's rule: (ratio, ceil(current x ratio)), or the current size inside the tolerance band."""
    ratio = value / target
    if abs(ratio - 1.0) <= tolerance:
        return ratio, current
    return ratio, max(1, math.ceil(current * ratio - 1e-9))


def _secs(x: float) -> str:
    """Seconds as a rule shows them: whole from 10 s (and when whole), else to a tenth."""
    return f"{x:.0f}" if x >= 10 or x == int(x) else f"{x:.1f}"


def readings(policy: AutoscalePolicy, obs: Observed) -> list[SignalReading]:
    """Each configured signal's reading; a latency signal with no samples in the window is left out."""
    n, out = max(1, obs.dp), []
    aggregates: list[tuple[str, float | None, float, int]] = [
        ("queue", sum(r.requests for r in obs.ranks) / n, policy.target_queue, len(obs.ranks)),
        ("kv", sum(r.kv_use for r in obs.ranks) / n, policy.target_kv, len(obs.ranks)),
    ]
    for name, attr, slo in (("ttft", "ttft_ms", policy.slo_ttft_ms), ("tpot", "tpot_ms", policy.slo_tpot_ms)):
        samples = [x for r in obs.ranks for x in getattr(r, attr)]
        aggregates.append((name, p95(samples), slo, len(samples)))
    for name, value, target, count in aggregates:
        if target <= 0 or value is None or not obs.ranks:
            continue
        ratio, rec = _hpa(obs.dp, value, target, policy.tolerance)
        out.append(SignalReading(name, round(value, 6), target, round(ratio, 6), rec, count))
    load = load_reading(policy, obs)
    return out + ([load] if load is not None else [])


def load_reading(policy: AutoscalePolicy, obs: Observed) -> SignalReading | None:
    """The load rule's reading (absolute: the ranks the load needs), or None when it is left out
    or the router reports no admissions. Inside the tolerance band of the current width: no change."""
    if policy.target_utilization <= 0 or obs.load is None or obs.load.arrival_rps is None:
        return None
    t = load_terms(obs.load, policy.drain_s, policy.target_utilization)
    per_rank = t.capacity_tps * t.target_utilization
    value = t.need * per_rank
    ratio = t.need / max(1, obs.dp)
    rec = obs.dp if abs(ratio - 1.0) <= policy.tolerance else t.recommendation
    return SignalReading("load", round(value, 3), round(per_rank, 3), round(ratio, 6), rec, 1, t.terms)


def _adoptable(obs: Observed, target: int, tolerance: float) -> int | None:
    """The size whose engine cores vLLM prepared ahead when a scale-up to ``target`` would take it:
    ``target`` is that size, or over it within the tolerance band (vLLM adopts a held prepare only
    for its own size; any other scale drops it and starts new engine cores)."""
    n = obs.prepared_dp
    if n is None or not obs.dp < n <= target <= math.ceil(n * (1 + tolerance)):
        return None
    return n


class Autoscaler:
    """Decides one deployment's desired DP size, tick by tick; keeps its last decisions."""

    def __init__(self, policy: AutoscalePolicy, decisions: list[dict[str, Any]] | None = None, keep: int = 500) -> None:
        self.policy = policy.validated()
        self.decisions: deque[Decision] = deque((Decision.from_dict(d) for d in decisions or []), maxlen=keep)
        self.history: deque[tuple[float, int]] = deque(maxlen=4096)  # (at, raw recommendation)
        self.standby_asks: deque[tuple[float, int]] = deque(maxlen=4096)  # (at, the width a burst would want)
        self.last_action_at = max((d.at for d in self.decisions if d.act), default=-math.inf)
        self.failures = 0
        self.timing = timing(policy.up_delay_s, policy.down_delay_s, policy.cooldown_s, ScaleCost(), False)

    # ---- the tick --------------------------------------------------------------------------------
    def decide(self, now: float, observed: Observed) -> Decision:
        """This tick's decision (recorded in ``decisions``). Never raises on odd input."""
        p, obs = self.policy, observed
        sig = readings(p, obs)
        raw = max((s.recommendation for s in sig), default=obs.dp)  # the largest recommendation wins
        adopt = _adoptable(obs, raw, p.tolerance)
        self.timing = timing(
            p.up_delay_s,
            p.down_delay_s,
            p.cooldown_s,
            obs.cost or ScaleCost(),
            0 < obs.standby_ready >= raw - obs.dp or adopt is not None,
            f"the engine cores prepared for DP {adopt}" if adopt is not None else "the standby pool",
        )
        self.history.append((now, raw))
        self._prune(now)
        panic = [s for s in sig if s.name in ("ttft", "tpot") and s.ratio >= 2.0]
        d = Decision(
            id=f"as-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{uuid.uuid4().hex[:4]}",
            at=now,
            mode=str(p.mode),
            current_dp=obs.dp,
            window_s=obs.window_s,
            signals=sig,
            raw_recommendation=raw,
            recommendation=obs.dp,
            rule="",
            action="",
            panic=bool(panic),
            eplb_imbalance=obs.eplb_imbalance,
            timing=self.timing.to_dict(),
        )
        target, d.rule = self._stabilised(now, obs, raw, sig, panic)
        target = self._bounded(obs, target, d)
        d.recommendation = target
        d.standby = self._standby(now, obs, d)
        d.action = self._action(now, obs, d)
        if obs.prepared_dp is not None and obs.dp < d.recommendation == obs.prepared_dp:
            d.adopts = obs.prepared_dp
            d.rule += f"; adopts the engine core(s) prepared for DP {d.adopts} (the scale is their commit)"
        d.act = d.action == "scale" and p.mode == AutoscaleMode.ON
        if d.act:
            self.last_action_at = now
        self.decisions.append(d)
        return d

    def _prune(self, now: float) -> None:
        horizon = max(self.timing.up_delay_s, self.timing.down_delay_s) + 1.0
        while self.history and self.history[0][0] < now - horizon:
            self.history.popleft()

    def _streak(self, current: int, above: bool) -> tuple[float, list[int]]:
        """How long (seconds back from the newest) every recommendation stayed above (or below)
        ``current``, and those recommendations."""
        recs: list[int] = []
        start = self.history[-1][0]
        for at, rec in reversed(self.history):
            if (rec > current) != above or rec == current:
                break
            recs.append(rec)
            start = at
        return self.history[-1][0] - start, recs

    def _stabilised(
        self, now: float, obs: Observed, raw: int, sig: list[SignalReading], panic: list[SignalReading]
    ) -> tuple[int, str]:
        """HPA's stabilisation: up to the smallest recommendation held for the up-delay (the
        newest when the load rule asks: it is a rate, not a level), down to the largest held for
        the down-delay; in panic (an SLO breached 2x) up at once. A load-rule ask is not chased
        while what is queued drains at the current width before the scale could serve."""
        p, t, current = self.policy, self.timing, obs.dp
        winner = max(sig, key=lambda s: (s.recommendation, s.name == "load")).name if sig else "none"
        formula = next((f"; load: {s.terms['formula']}" for s in sig if s.name == "load" and s.terms), "")
        if panic:
            worst = max(panic, key=lambda s: s.ratio)
            return max(raw, current + 1), f"panic: {worst.name} p95 {worst.value:g} ms is {worst.ratio:.1f}x its SLO"
        if not sig:
            return current, "no signal: no target configured or no samples in the window"
        if raw == current:
            return current, f"within tolerance ({p.tolerance:.0%} band){formula}"
        held, recs = self._streak(current, above=raw > current)
        delay = t.up_delay_s if raw > current else t.down_delay_s
        way = "up" if raw > current else "down"
        if held < delay:
            return current, f"{winner} asks {way} to DP {raw}; stabilising {_secs(held)}s of {_secs(delay)}s{formula}"
        up_by_load = winner == "load" and raw > current and obs.load is not None
        late = (
            drains_before_scale(obs.load, current, t.scale_up_s, p.target_utilization)
            if up_by_load and obs.load
            else None
        )
        if late:
            return current, f"load asks up to DP {raw}; not chased: {late}{formula}"
        target = raw if up_by_load else min(recs) if raw > current else max(recs)
        return target, f"{winner} held {way} for {_secs(held)}s (>= {_secs(delay)}s): DP {target}{formula}"

    def _bounded(self, obs: Observed, target: int, d: Decision) -> int:
        """Max step, min/max bounds, every expert held, the pool preferred, the cluster's room."""
        p, current = self.policy, obs.dp
        load = next((s.recommendation for s in d.signals if s.name == "load"), current)
        step = max(-p.max_step, min(max(p.max_step, load - current), target - current))  # up: what the load needs
        target = current + step
        need = -(-obs.num_experts // max(1, obs.slots_per_rank))
        lo, hi = max(p.min_dp, need), p.max_dp
        bounded = max(lo, min(hi, target))
        if bounded != target:
            d.rule += f"; bounded to [{lo}, {hi}]" + (
                f" ({obs.num_experts} experts need {need})" if need > p.min_dp else ""
            )
        target = bounded
        pooled = current + obs.standby_ready
        if (
            not d.panic
            and obs.standby_ready > 0
            and current < pooled < target
            and target <= math.ceil(pooled * (1 + p.tolerance))
        ):
            d.rule += f"; DP {pooled} preferred (the standby pool serves it at once)"
            target = pooled
        prepared = _adoptable(obs, target, p.tolerance)
        if not d.panic and prepared is not None and prepared != target:
            d.rule += f"; DP {prepared} preferred (its engine cores are prepared: the commit alone)"
            target = prepared
        return target

    def _standby(self, now: float, obs: Observed, d: Decision) -> int | None:
        """The standby pool ``--standby auto`` keeps: the ranks a ``burst`` times the base arrivals
        would need beyond the width decided, within max DP. The width is the most a burst asked over
        the window, so a lull does not stop the standbys the next burst wants; the pool is what that
        width lacks now, so a burst served at its width refills nothing (a pool kept past it held
        ranks no scale could use: 7 ranks of a DP 4 at max DP 4 in the step benchmark)."""
        p, load = self.policy, obs.load
        if p.standby != AUTO or load is None or load.base_rps is None:
            return None
        per_rank = load.capacity_tps * p.target_utilization
        need = min(p.max_dp, math.ceil(p.burst * load.base_rps * load.work_per_request / max(1e-9, per_rank) - 1e-9))
        self.standby_asks.append((now, need))
        while self.standby_asks[0][0] < now - p.window_s:
            self.standby_asks.popleft()
        n = max(0, max(w for _, w in self.standby_asks) - d.recommendation)
        d.rule += f"; standby {n} (a {p.burst:g}x burst of {load.base_rps:.3g} req/s needs DP {need})"
        return n

    def _action(self, now: float, obs: Observed, d: Decision) -> str:
        """What happens to the recommendation: nothing, blocked (and why), advisory, or scale."""
        p, target = self.policy, d.recommendation
        if p.mode == AutoscaleMode.OFF:
            return "off: not evaluated for action"
        if target == obs.dp:
            return "none"
        if target > p.max_dp:
            return f"blocked: every expert needs DP {target}, over --max-dp {p.max_dp}"
        if obs.busy:
            return f"blocked: {obs.busy} is running"
        wait = self.cooldown_s() - (now - self.last_action_at)
        if wait > 0 and not d.panic:
            return f"blocked: cooldown, {wait:.0f}s left"
        if target > obs.dp and obs.capacity is not None:
            why = obs.capacity(target - obs.dp)
            fit = next((n for n in range(target - obs.dp - 1, 0, -1) if not obs.capacity(n)), 0) if why else 0
            if why and not fit:
                return f"blocked: capacity: {why}"
            if why:
                d.recommendation = obs.dp + fit
                d.rule += f"; DP {target} does not fit ({why}): DP {d.recommendation}, the most that fits"
        if p.mode == AutoscaleMode.ADVISORY:
            return "advisory: not acted"
        return "scale"

    def cooldown_s(self) -> float:
        """The cooldown after an action; doubled per failed scale in a row (capped at the down-delay)."""
        base = self.timing.cooldown_s
        return min(max(base, self.timing.down_delay_s), base * 2**self.failures) if self.failures else base

    # ---- what the loop reports back --------------------------------------------------------------
    def record_outcome(self, decision_id: str, ok: bool, detail: str = "") -> None:
        """The loop acted on ``decision_id``: "scaled" or "failed: ..." (a failure backs off)."""
        self.failures = 0 if ok else self.failures + 1
        for d in reversed(self.decisions):
            if d.id == decision_id:
                d.outcome = (
                    "scaled" + (f": {detail}" if detail else "") if ok else f"failed: {detail or 'no reason given'}"
                )
                d.action = d.outcome
                return

    def set_policy(self, policy: AutoscalePolicy) -> None:
        """A new policy (``eepctl autoscale`` again); the decision trail and cooldown carry over."""
        self.policy = policy.validated()

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        return [d.to_dict() for d in list(self.decisions)[-limit:]]
