"""`eepctl autoscale`: set, show or plot the autoscaling policy a deployment keeps. Parses its
options, calls eepctl.core, renders with eepctl.render_autoscale (registered by eepctl.cli)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from eepctl.options import (
    Address,
    ApiKey,
    Name,
    Namespace,
    Output,
    OutputOpt,
    emit,
    target,
    width,
)
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE, UsageError


def autoscale(
    min_dp: Annotated[int | None, typer.Option("--min-dp", help="Smallest DP size the autoscaler may choose.")] = None,
    max_dp: Annotated[
        int | None, typer.Option("--max-dp", help="Largest DP size (at most the deployment's max DP).")
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option("--mode", help="advisory (record, act on none; the default when first set), on (act) or off."),
    ] = None,
    target_queue: Annotated[
        float | None,
        typer.Option("--target-queue", help="Target requests (waiting + running) per rank; 0 leaves it out."),
    ] = None,
    target_kv: Annotated[
        float | None, typer.Option("--target-kv", help="Target KV-cache use per rank, 0..1; 0 leaves it out.")
    ] = None,
    slo_ttft_ms: Annotated[
        float | None,
        typer.Option("--slo-ttft-ms", help="SLO on time to first token, p95 ms (2x breached: panic, up at once)."),
    ] = None,
    slo_tpot_ms: Annotated[
        float | None, typer.Option("--slo-tpot-ms", help="SLO on time per output token, p95 ms.")
    ] = None,
    up_delay: Annotated[
        str | None,
        typer.Option(
            "--up-delay",
            help="Seconds a larger size must be recommended before it is acted on (default 20), or auto: the predicted scale-up.",
        ),
    ] = None,
    down_delay: Annotated[
        str | None,
        typer.Option(
            "--down-delay",
            help="Seconds a smaller size must be recommended (default 300), or auto: 10 round trips of what a scale costs here (2 s..300 s).",
        ),
    ] = None,
    tolerance: Annotated[
        float | None,
        typer.Option("--tolerance", help="No change while |signal/target - 1| is within this (default 0.10)."),
    ] = None,
    max_step: Annotated[
        int | None, typer.Option("--max-step", help="Ranks added or removed per decision (default 2).")
    ] = None,
    cooldown: Annotated[
        str | None,
        typer.Option("--cooldown", help="Seconds after each action before the next (default 30), or auto (1 s)."),
    ] = None,
    window: Annotated[
        float | None, typer.Option("--window", help="Seconds of signals each decision reads (default 60).")
    ] = None,
    target_utilization: Annotated[
        float | None,
        typer.Option(
            "--target-utilization",
            help="The load rule: as many ranks as the arrivals and the backlog need at this share of a rank's capacity, 0..1 (0 leaves it out).",
        ),
    ] = None,
    drain: Annotated[
        float | None, typer.Option("--drain", help="Seconds the load rule gives the queued work to drain (default 2).")
    ] = None,
    standby: Annotated[
        str | None,
        typer.Option(
            "--standby",
            help="auto: the autoscaler keeps as many ranks launched ahead as a --burst times the base load needs beyond the current width; off: the pool is `eepctl standby`'s.",
        ),
    ] = None,
    burst: Annotated[
        float | None,
        typer.Option("--burst", help="The burst --standby auto absorbs, as a multiple of the base load (default 4)."),
    ] = None,
    capacity: Annotated[
        str | None,
        typer.Option(
            "--capacity",
            help="A rank's tokens/s at saturation until the deployment has measured its own: a number, or benchmarks/capacity.py's JSON.",
        ),
    ] = None,
    show: Annotated[
        bool, typer.Option("--show", help="Print the policy and the current recommendation; change nothing.")
    ] = False,
    plot: Annotated[
        bool, typer.Option("--plot", help="Draw DP, load and the SLO signal over the decisions' window.")
    ] = False,
    api_key: ApiKey = None,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
) -> None:
    """Set the autoscaling policy the deployment keeps (its controller's loop runs it), or --show / --plot it."""
    from eepctl import core, render, render_autoscale

    given: dict[str, Any] = {
        "min_dp": min_dp,
        "max_dp": max_dp,
        "mode": mode,
        "target_queue": target_queue,
        "target_kv": target_kv,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "up_delay_s": _delay(up_delay),
        "down_delay_s": _delay(down_delay),
        "tolerance": tolerance,
        "max_step": max_step,
        "cooldown_s": _delay(cooldown),
        "window_s": window,
        "target_utilization": target_utilization,
        "drain_s": drain,
        "capacity_tokens_s": _capacity(capacity),
        "standby": standby,
        "burst": burst,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    if (show or plot) and changes:
        raise UsageError("--show and --plot change nothing: give them without policy options")
    t = target(address, namespace, name)
    if plot:
        data = core.autoscale_decisions(t, api_key=api_key)
        emit(
            render.to_json("autoscale_decisions", data) + "\n"
            if output == Output.json
            else render_autoscale.plot_text(data, width=width())
        )
    elif show:
        data = core.autoscale_show(t, api_key=api_key)
        emit(render.to_json("autoscale", data) + "\n" if output == Output.json else render_autoscale.show_text(data))
    else:
        res = core.autoscale(t, changes, api_key=api_key)
        emit(render.to_json("autoscale", res) + "\n" if output == Output.json else render_autoscale.set_text(res))


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
