"""The autoscaling policy a deployment keeps: bounds, mode, signal targets and timings.

Validated once (``validated``), with errors that name the CLI option, so the controller's loop,
the driver and ``eepctl autoscale`` share one check. Defaults and why: docs/autoscaling.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from engine_ext.config import AutoscaleMode
from engine_ext.control.autoscale_cost import AUTO

# Option names as ``eepctl autoscale`` spells them, for the errors.
OPTION = {
    "min_dp": "--min-dp",
    "max_dp": "--max-dp",
    "mode": "--mode",
    "target_queue": "--target-queue",
    "target_kv": "--target-kv",
    "slo_ttft_ms": "--slo-ttft-ms",
    "slo_tpot_ms": "--slo-tpot-ms",
    "up_delay_s": "--up-delay",
    "down_delay_s": "--down-delay",
    "tolerance": "--tolerance",
    "max_step": "--max-step",
    "cooldown_s": "--cooldown",
    "window_s": "--window",
    "target_utilization": "--target-utilization",
    "drain_s": "--drain",
    "capacity_tokens_s": "--capacity",
    "standby": "--standby",
    "burst": "--burst",
}
DELAYS = ("up_delay_s", "down_delay_s", "cooldown_s")  # a number of seconds, or "auto" (from the scale's cost)


@dataclass
class AutoscalePolicy:
    """One deployment's autoscaling policy. A target of 0 leaves that signal out."""

    min_dp: int = 1
    max_dp: int = 8
    mode: AutoscaleMode | str = AutoscaleMode.ADVISORY
    target_queue: float = 0.0  # requests (waiting + running) per rank
    target_kv: float = 0.0  # KV-cache use per rank, 0..1
    slo_ttft_ms: float = 0.0  # time to first token, p95 over the window
    slo_tpot_ms: float = 0.0  # time per output token, p95 over the window
    up_delay_s: float | str = 20.0  # a larger size must be recommended this long before it is acted on
    down_delay_s: float | str = 300.0  # a smaller size this long
    tolerance: float = 0.10  # |signal/target - 1| within this: no change
    max_step: int = 2  # ranks removed per decision, and added by the other signals than the load rule
    cooldown_s: float | str = 30.0  # after each action
    window_s: float = 60.0  # the signals' window
    # The load rule (engine_ext/control/autoscale_load.py): the width the arrivals and the backlog
    # need at this share of each rank's capacity (0 leaves it out), the backlog drained within
    # ``drain_s``, and a rank's capacity in tokens/s until the deployment has measured its own (0: the default).
    target_utilization: float = 0.0
    drain_s: float = 2.0
    capacity_tokens_s: float = 0.0
    # "auto": the autoscaler sizes the standby pool for a ``burst`` times the base arrivals (the
    # ranks it would need beyond the current width); "off": the pool is the operator's (`eepctl standby`).
    standby: str = "off"
    burst: float = 4.0

    def validated(self) -> AutoscalePolicy:
        """This policy, typed and checked; ValueError naming the option otherwise."""
        self.mode = AutoscaleMode.parse(self.mode, OPTION["mode"])
        for name in ("min_dp", "max_dp", "max_step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{OPTION[name]} must be an integer >= 1, not {v!r}")
        if self.min_dp > self.max_dp:
            raise ValueError(f"--min-dp {self.min_dp} is over --max-dp {self.max_dp}")
        for name in (
            "target_queue",
            "target_kv",
            "slo_ttft_ms",
            "slo_tpot_ms",
            "up_delay_s",
            "down_delay_s",
            "tolerance",
            "cooldown_s",
            "window_s",
            "target_utilization",
            "drain_s",
            "capacity_tokens_s",
        ):
            v = getattr(self, name)
            if name in DELAYS and isinstance(v, str) and v.strip().lower() == AUTO:
                setattr(self, name, AUTO)
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(
                    f"{OPTION[name]} must be a number >= 0{' or auto' if name in DELAYS else ''}, not {v!r}"
                )
            setattr(self, name, float(v))
        for name in ("target_kv", "target_utilization"):
            if getattr(self, name) > 1.0:
                raise ValueError(f"{OPTION[name]} is a fraction (0..1], not {getattr(self, name)!r}")
        self.standby = str(self.standby).strip().lower()
        if self.standby not in ("off", AUTO):
            raise ValueError(f"--standby must be auto or off, not {self.standby!r}")
        if isinstance(self.burst, bool) or not isinstance(self.burst, (int, float)) or not self.burst >= 1.0:
            raise ValueError(f"--burst is how many times the base load a burst brings (>= 1), not {self.burst!r}")
        self.burst = float(self.burst)
        if self.standby == AUTO and not self.target_utilization:
            raise ValueError("--standby auto sizes the pool by the load rule: give --target-utilization too")
        if self.tolerance >= 1.0:
            raise ValueError(f"--tolerance must be below 1 (0.10 is 10 %), not {self.tolerance!r}")
        if self.window_s <= 0:
            raise ValueError("--window must be > 0 seconds")
        if self.mode != AutoscaleMode.OFF and not (
            self.target_queue or self.target_kv or self.slo_ttft_ms or self.slo_tpot_ms or self.target_utilization
        ):
            raise ValueError(
                "give at least one target: --target-queue, --target-kv, --slo-ttft-ms, --slo-tpot-ms "
                "or --target-utilization"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = str(self.mode)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AutoscalePolicy:
        """The policy in ``d`` (unknown keys refused: a typo must not pass silently), validated."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown autoscale policy field(s): {', '.join(unknown)}")
        return cls(**d).validated()
