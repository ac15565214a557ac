"""Ray metrics (``ray.util.metrics``) for ranks and transitions, so that a Prometheus that
already scrapes the Ray cluster (each node's ``--metrics-export-port``) picks them up.

Names follow Prometheus conventions (base units, ``_total`` counters, ``_seconds`` and
``_bytes`` suffixes); Ray's exporter adds the ``ray_`` prefix, so ``eep_rank_requests_running``
is scraped as ``ray_eep_rank_requests_running``. Names, tags and example queries:
docs/operations.md.

Everything here is best effort: a metric that cannot be recorded never disturbs serving, and
the cost is a handful of in-process gauge updates per status report (~1 Hz per rank).
"""

from __future__ import annotations

import threading
from typing import Any

RANK_TAGS = ("deployment", "rank", "identity")
PHASE_BOUNDS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
CAPTURE_BOUNDS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
PAUSE_BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

# gauge name -> (status field, description)
RANK_GAUGES: dict[str, tuple[str, str]] = {
    "eep_rank_requests_running": ("requests_running", "Requests running on the rank."),
    "eep_rank_requests_waiting": ("requests_waiting", "Requests waiting on the rank."),
    "eep_rank_slots_used": ("slots_used", "Sequence slots in use."),
    "eep_rank_slots_total": ("slots_total", "Sequence slots of the rank."),
    "eep_rank_kv_blocks_used": ("kv_blocks_used", "KV-cache blocks in use."),
    "eep_rank_kv_blocks_total": ("kv_blocks_total", "KV-cache blocks of the rank."),
    "eep_rank_workspace_bytes": ("workspace_bytes", "Bytes of the rank's MoE workspace."),
    "eep_rank_workspace_required_bytes": ("workspace_required_bytes", "Worst-case workspace bound at warm-up."),
    "eep_rank_workspace_locked": ("workspace_locked", "1 when the workspace is locked (serving)."),
    "eep_rank_graphs_captured": ("graphs_captured", "Captured graph sizes currently held."),
    "eep_rank_dp_size": ("dp_size", "DP world size the rank serves in."),
    "eep_rank_eplb_imbalance": (
        "eplb_imbalance",
        "EPLB load imbalance: max/mean rank load (1.0 = perfectly balanced; 0 before any load).",
    ),
    "eep_rank_last_capture_seconds": ("last_capture_s", "Duration of the rank's last capture pass."),
}
# gauge name -> (status field in ms, description): set in seconds (the autoscaler's SLO signals)
RANK_LATENCY_GAUGES: dict[str, tuple[str, str]] = {
    "eep_rank_ttft_p50_seconds": ("ttft_ms_p50", "Time to first token, p50 over the rank's latency window."),
    "eep_rank_ttft_p95_seconds": ("ttft_ms_p95", "Time to first token, p95 over the rank's latency window."),
    "eep_rank_tpot_p50_seconds": ("tpot_ms_p50", "Time per output token, p50 over the rank's latency window."),
    "eep_rank_tpot_p95_seconds": ("tpot_ms_p95", "Time per output token, p95 over the rank's latency window."),
}
# counter name -> (monotonic status field, description): incremented by the reported delta
RANK_COUNTERS: dict[str, tuple[str, str]] = {
    "eep_rank_steps_total": ("steps", "Forward steps run by the rank."),
    "eep_rank_graph_replays_total": ("graph_replays", "Graph replays (CUDA graphs or CPU static replays)."),
}
STATES = (
    "starting",
    "serving",
    "preparing",
    "committing",
    "warming",
    "capturing",
    "draining",
    "removing",
    "removed",
    "failed",
    "stale",
)


class RankMetrics:
    """One rank's metrics; ``on_status`` and ``on_event`` are called where the rank publishes."""

    def __init__(self, deployment: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.deployment = deployment
        self._lock = threading.Lock()
        self._gauges = {n: Gauge(n, description=d, tag_keys=RANK_TAGS) for n, (_, d) in RANK_GAUGES.items()}
        self._counters = {n: Counter(n, description=d, tag_keys=RANK_TAGS) for n, (_, d) in RANK_COUNTERS.items()}
        self._latency = {n: Gauge(n, description=d, tag_keys=RANK_TAGS) for n, (_, d) in RANK_LATENCY_GAUGES.items()}
        self._state = Gauge(
            "eep_rank_state",
            description="1 for the rank's current state, 0 for the others.",
            tag_keys=(*RANK_TAGS, "state"),
        )
        self._captures = Counter(
            "eep_rank_graph_captures_total",
            description="Graph capture passes (one per transition per rank when healthy).",
            tag_keys=RANK_TAGS,
        )
        self._capture_s = Histogram(
            "eep_rank_capture_seconds",
            description="Duration of a rank's capture pass.",
            boundaries=CAPTURE_BOUNDS,
            tag_keys=RANK_TAGS,
        )
        self._phase_s = Histogram(
            "eep_transition_phase_seconds",
            description="Duration of one transition phase on one rank (rank -1: the controller).",
            boundaries=PHASE_BOUNDS,
            tag_keys=(*RANK_TAGS, "phase", "outcome"),
        )
        self._last: dict[str, float] = {}
        self._last_state = ""
        self._ident = ""

    def _tags(self, st: dict[str, Any]) -> dict[str, str]:
        return {
            "deployment": self.deployment,
            "rank": str(st.get("rank", "")),
            "identity": str(st.get("instance_id", "")),
        }

    def on_status(self, st: dict[str, Any]) -> None:
        try:
            with self._lock:
                tags = self._tags(st)
                self._ident = tags["identity"]
                for name, (key, _) in RANK_GAUGES.items():
                    v = st.get(key)
                    if v is not None:
                        self._gauges[name].set(float(v), tags=tags)
                for name, (key, _) in RANK_LATENCY_GAUGES.items():
                    v = st.get(key)
                    if v is not None:
                        self._latency[name].set(float(v) / 1000.0, tags=tags)
                for name, (key, _) in RANK_COUNTERS.items():
                    v = float(st.get(key) or 0)
                    delta = v - self._last.get(key, 0.0)
                    if delta > 0:
                        self._counters[name].inc(delta, tags=tags)
                    self._last[key] = v
                state = str(st.get("state", ""))
                if state != self._last_state:
                    for s in STATES:
                        self._state.set(1.0 if s == state else 0.0, tags=dict(tags, state=s))
                    self._last_state = state
        except Exception:  # noqa: BLE001 - metrics never disturb serving
            pass

    def on_event(self, ev: dict[str, Any]) -> None:
        try:
            with self._lock:
                tags = {"deployment": self.deployment, "rank": str(ev.get("rank", "")), "identity": self._identity(ev)}
                dur = max(0.0, float(ev.get("end", 0.0)) - float(ev.get("start", 0.0)))
                phase = str(ev.get("phase", ""))
                self._phase_s.observe(dur, tags=dict(tags, phase=phase, outcome=str(ev.get("outcome", "ok"))))
                if phase == "capture" and ev.get("outcome", "ok") == "ok":
                    self._captures.inc(1.0, tags=tags)
                    self._capture_s.observe(dur, tags=tags)
        except Exception:  # noqa: BLE001
            pass

    def _identity(self, ev: dict[str, Any]) -> str:
        rank = ev.get("rank", "")
        if self._ident:
            return self._ident
        return f"{self.deployment}_dp{rank}" if isinstance(rank, int) and rank >= 0 else ""


class DeploymentMetrics:
    """The controller's view: transitions and their serving pause."""

    def __init__(self, deployment: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.deployment = deployment
        self._seen: set[str] = set()
        self._pause = Histogram(
            "eep_serving_pause_seconds",
            description="Forward-pass pause of a transition (a joiner's wait for the members to stop is not counted).",
            boundaries=PAUSE_BOUNDS,
            tag_keys=("deployment",),
        )
        self._ops = Counter(
            "eep_transitions_total",
            description="Finished scale operations by outcome.",
            tag_keys=("deployment", "state"),
        )
        self._dp = Gauge(
            "eep_deployment_dp_size", description="DP size after the last operation.", tag_keys=("deployment",)
        )
        self._duration = Histogram(
            "eep_transition_seconds",
            description="Wall time of a scale operation.",
            boundaries=PHASE_BOUNDS,
            tag_keys=("deployment", "state"),
        )
        self._recovery = Histogram(
            "eep_recovery_seconds",
            description="From a rank's death to serving again (a recover operation).",
            boundaries=PHASE_BOUNDS,
            tag_keys=("deployment", "state"),
        )
        self._rerouted = Counter(
            "eep_rerouted_requests_total",
            description="Requests of dead ranks re-submitted to survivors.",
            tag_keys=("deployment",),
        )

    def on_operation(self, op: dict[str, Any], dp_size: int) -> None:
        try:
            if not op.get("finished") or op.get("op_id") in self._seen:
                return
            self._seen.add(op["op_id"])
            tags = {"deployment": self.deployment}
            state = str(op.get("state", ""))
            self._ops.inc(1.0, tags=dict(tags, state=state))
            self._dp.set(float(dp_size), tags=tags)
            self._duration.observe(
                max(0.0, float(op["finished"]) - float(op.get("started", op["finished"]))), tags=dict(tags, state=state)
            )
            if op.get("serving_pause_s"):
                self._pause.observe(float(op["serving_pause_s"]), tags=tags)
            if op.get("kind") == "recover":
                detect = float(op.get("phase_durations", {}).get("detect", 0.0))
                total = float(op["finished"]) - float(op.get("started", op["finished"])) + detect
                self._recovery.observe(max(0.0, total), tags=dict(tags, state=state))
                if int(op.get("rerouted_requests") or 0) > 0:
                    self._rerouted.inc(float(op["rerouted_requests"]), tags=tags)
        except Exception:  # noqa: BLE001
            pass


# The autoscaler's signals by name (engine_ext/control/autoscaler.py readings) and their units.
AUTOSCALER_SIGNALS = ("queue", "kv", "ttft", "tpot")


class AutoscalerMetrics:
    """The autoscaler's view: every signal (value, target, the size it recommends) and every
    decision (sizes, panic, the action taken), so a dashboard can replay what it decided and why."""

    def __init__(self, deployment: str) -> None:
        from ray.util.metrics import Counter, Gauge

        self.deployment = deployment
        tags = ("deployment",)
        sig = ("deployment", "signal")
        self._value = Gauge(
            "eep_autoscaler_signal_value",
            description="A signal's aggregate over the window (queue: requests per rank; kv: 0..1; ttft/tpot: p95 ms).",
            tag_keys=sig,
        )
        self._target = Gauge(
            "eep_autoscaler_signal_target", description="The policy's target for the signal.", tag_keys=sig
        )
        self._ratio = Gauge(
            "eep_autoscaler_signal_ratio", description="Signal / target (1.0 = on target).", tag_keys=sig
        )
        self._per_signal = Gauge(
            "eep_autoscaler_signal_recommended_dp", description="The DP size the signal alone recommends.", tag_keys=sig
        )
        self._current = Gauge("eep_autoscaler_current_dp", description="DP size the autoscaler saw.", tag_keys=tags)
        self._recommended = Gauge(
            "eep_autoscaler_recommended_dp",
            description="DP size recommended after stabilisation, step and bounds.",
            tag_keys=tags,
        )
        self._panic = Gauge(
            "eep_autoscaler_panic", description="1 while an SLO is breached 2x (panic mode).", tag_keys=tags
        )
        self._decisions = Counter(
            "eep_autoscaler_decisions_total",
            description="Decisions by what was done (none, advisory, scale, blocked, off).",
            tag_keys=("deployment", "action"),
        )
        self._outcomes = Counter(
            "eep_autoscaler_scales_total",
            description="Scales the autoscaler asked for, by outcome.",
            tag_keys=("deployment", "outcome"),
        )

    def on_decision(self, d: Any) -> None:
        try:
            tags = {"deployment": self.deployment}
            for s in d.signals:
                t = dict(tags, signal=s.name)
                self._value.set(float(s.value), tags=t)
                self._target.set(float(s.target), tags=t)
                self._ratio.set(float(s.ratio), tags=t)
                self._per_signal.set(float(s.recommendation), tags=t)
            self._current.set(float(d.current_dp), tags=tags)
            self._recommended.set(float(d.recommendation), tags=tags)
            self._panic.set(1.0 if d.panic else 0.0, tags=tags)
            self._decisions.inc(1.0, tags=dict(tags, action=action_kind(d.action)))
        except Exception:  # noqa: BLE001 - metrics never disturb the loop
            pass

    def on_outcome(self, ok: bool) -> None:
        try:
            self._outcomes.inc(1.0, tags={"deployment": self.deployment, "outcome": "scaled" if ok else "failed"})
        except Exception:  # noqa: BLE001
            pass


def action_kind(action: str) -> str:
    """A decision's action as a low-cardinality label: none, advisory, scale, blocked, off, scaled, failed."""
    head = action.split(":", 1)[0].strip()
    return head if head in ("none", "advisory", "scale", "blocked", "off", "scaled", "failed") else "other"
