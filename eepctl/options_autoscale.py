"""`eepctl autoscale`'s options, the fields of the autoscaling policy a deployment keeps, and the
policy changes they describe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from engine_ext.protocol import UsageError

MinDp = Annotated[int | None, typer.Option("--min-dp", help="Smallest DP size the autoscaler may choose.")]
MaxDp = Annotated[int | None, typer.Option("--max-dp", help="Largest DP size (at most the deployment's max DP).")]
Mode = Annotated[
    str | None,
    typer.Option("--mode", help="advisory (record, act on none; the default when first set), on (act) or off."),
]
TargetQueue = Annotated[
    float | None,
    typer.Option("--target-queue", help="Target requests (waiting + running) per rank; 0 leaves it out."),
]
TargetKv = Annotated[
    float | None, typer.Option("--target-kv", help="Target KV-cache use per rank, 0..1; 0 leaves it out.")
]
SloTtftMs = Annotated[
    float | None,
    typer.Option("--slo-ttft-ms", help="SLO on time to first token, p95 ms (2x breached: panic, up at once)."),
]
SloTpotMs = Annotated[float | None, typer.Option("--slo-tpot-ms", help="SLO on time per output token, p95 ms.")]
UpDelay = Annotated[
    str | None,
    typer.Option(
        "--up-delay",
        help="Seconds a larger size must be recommended before it is acted on (default 20), or auto: the predicted "
        "scale-up.",
    ),
]
DownDelay = Annotated[
    str | None,
    typer.Option(
        "--down-delay",
        help="Seconds a smaller size must be recommended (default 300), or auto: 10 round trips of what a scale "
        "costs here (2 s..300 s).",
    ),
]
Tolerance = Annotated[
    float | None,
    typer.Option("--tolerance", help="No change while |signal/target - 1| is within this (default 0.10)."),
]
MaxStep = Annotated[int | None, typer.Option("--max-step", help="Ranks added or removed per decision (default 2).")]
Cooldown = Annotated[
    str | None,
    typer.Option("--cooldown", help="Seconds after each action before the next (default 30), or auto (1 s)."),
]
Window = Annotated[float | None, typer.Option("--window", help="Seconds of signals each decision reads (default 60).")]
TargetUtilization = Annotated[
    float | None,
    typer.Option(
        "--target-utilization",
        help="The load rule: as many ranks as the arrivals and the backlog need at this share of a rank's "
        "capacity, 0..1 (0 leaves it out).",
    ),
]
Drain = Annotated[
    float | None, typer.Option("--drain", help="Seconds the load rule gives the queued work to drain (default 2).")
]
Standby = Annotated[
    str | None,
    typer.Option(
        "--standby",
        help="auto: the autoscaler keeps as many ranks launched ahead as a --burst times the base load needs "
        "beyond the current width; off: the pool is `eepctl standby`'s.",
    ),
]
Burst = Annotated[
    float | None,
    typer.Option("--burst", help="The burst --standby auto absorbs, as a multiple of the base load (default 4)."),
]
Capacity = Annotated[
    str | None,
    typer.Option(
        "--capacity",
        help="A rank's tokens/s at saturation until the deployment has measured its own: a number, or "
        "benchmarks/capacity.py's JSON.",
    ),
]


def _delay(v: str | None) -> float | str | None:
    """A delay option: seconds, or "auto" (the policy checks what else was given)."""
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        return v


def _capacity(v: str | None) -> float | None:
    """``--capacity``: tokens/s, or the path of benchmarks/capacity.py's JSON (its closed loop)."""
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        pass
    import json
    from pathlib import Path

    from engine_ext.control.autoscale_load import capacity_from_benchmark

    try:
        return capacity_from_benchmark(json.loads(Path(v).read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UsageError(f"--capacity takes tokens/s or benchmarks/capacity.py's JSON; {v}: {e}") from None


def _as_given(v: Any) -> Any:
    return v


# The policy's field each option sets, and how the option's text becomes the field's value.
POLICY_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "min_dp": ("min_dp", _as_given),
    "max_dp": ("max_dp", _as_given),
    "mode": ("mode", _as_given),
    "target_queue": ("target_queue", _as_given),
    "target_kv": ("target_kv", _as_given),
    "slo_ttft_ms": ("slo_ttft_ms", _as_given),
    "slo_tpot_ms": ("slo_tpot_ms", _as_given),
    "up_delay": ("up_delay_s", _delay),
    "down_delay": ("down_delay_s", _delay),
    "tolerance": ("tolerance", _as_given),
    "max_step": ("max_step", _as_given),
    "cooldown": ("cooldown_s", _delay),
    "window": ("window_s", _as_given),
    "target_utilization": ("target_utilization", _as_given),
    "drain": ("drain_s", _as_given),
    "capacity": ("capacity_tokens_s", _capacity),
    "standby": ("standby", _as_given),
    "burst": ("burst", _as_given),
}


def policy_changes(options: dict[str, Any]) -> dict[str, Any]:
    """The policy fields `autoscale`'s options set (by parameter name: the command's
    ``ctx.params``), each as its field's value; options not given are left out."""
    given = {field: parse(options[opt]) for opt, (field, parse) in POLICY_FIELDS.items()}
    return {k: v for k, v in given.items() if v is not None}
