"""`eepctl autoscale`: set, show or plot the autoscaling policy a deployment keeps. Parses its
options (eepctl.options_autoscale), calls eepctl.core, renders with eepctl.render_autoscale
(registered by eepctl.cli)."""

from __future__ import annotations

from typing import Annotated

import typer

from eepctl.options import Address, ApiKey, Name, Namespace, Output, OutputOpt, emit, target, width
from eepctl.options_autoscale import (
    Burst,
    Capacity,
    Cooldown,
    DownDelay,
    Drain,
    MaxDp,
    MaxStep,
    MinDp,
    Mode,
    SloTpotMs,
    SloTtftMs,
    Standby,
    TargetKv,
    TargetQueue,
    TargetUtilization,
    Tolerance,
    UpDelay,
    Window,
    policy_changes,
)
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE, UsageError

Show = Annotated[bool, typer.Option("--show", help="Print the policy and the current recommendation; change nothing.")]
Plot = Annotated[bool, typer.Option("--plot", help="Draw DP, load and the SLO signal over the decisions' window.")]


def autoscale(
    ctx: typer.Context,
    min_dp: MinDp = None,
    max_dp: MaxDp = None,
    mode: Mode = None,
    target_queue: TargetQueue = None,
    target_kv: TargetKv = None,
    slo_ttft_ms: SloTtftMs = None,
    slo_tpot_ms: SloTpotMs = None,
    up_delay: UpDelay = None,
    down_delay: DownDelay = None,
    tolerance: Tolerance = None,
    max_step: MaxStep = None,
    cooldown: Cooldown = None,
    window: Window = None,
    target_utilization: TargetUtilization = None,
    drain: Drain = None,
    standby: Standby = None,
    burst: Burst = None,
    capacity: Capacity = None,
    show: Show = False,
    plot: Plot = False,
    api_key: ApiKey = None,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
) -> None:
    """Set the autoscaling policy the deployment keeps (its controller's loop runs it), or --show / --plot it."""
    from eepctl import core, render, render_autoscale

    changes = policy_changes(ctx.params)
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
