"""`eepctl status`: the per-rank table, once or refreshed in place (registered by eepctl.cli)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from eepctl import streams
from eepctl.options import Address, Name, Namespace, Output, OutputOpt, emit, target, width
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE

Watch = Annotated[bool, typer.Option("--watch", "-w", help="Refresh in place until interrupted.")]
Interval = Annotated[float, typer.Option("--interval", help="Refresh interval for --watch, seconds.")]
State = Annotated[
    list[str] | None, typer.Option("--state", help="Only ranks in this state (repeat or comma-separate).")
]
Node = Annotated[str | None, typer.Option("--node", help="Only ranks on this node (its id or IP).")]


def status(
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
    watch: Watch = False,
    interval: Interval = 1.0,
    state: State = None,
    node: Node = None,
) -> None:
    """Per-rank status: state, requests, slots, KV, workspace, graphs, EPLB, heartbeat.

    Ranks needing attention (failed, stale, not serving) come first."""
    from eepctl import core, render

    t = target(address, namespace, name)
    read = core.status_reader(t)  # resolves the deployment once: one registry call per refresh after

    def snap() -> dict[str, Any]:
        return render.filter_ranks(read(), state, node)

    if not watch:
        data = snap()
        emit(
            render.to_json("status", data) + "\n" if output == Output.json else render.status_text(data, width=width())
        )
        return
    if output == Output.json:
        while True:
            emit(render.to_json("status", snap()) + "\n")
            time.sleep(interval)
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    with Live(Text(""), console=Console(file=streams.output()), auto_refresh=False, screen=False) as live:
        while True:
            t0 = time.time()
            rows = max(1, live.console.height - 12)  # the table fits the screen; the rest is counted
            live.update(Text(render.status_text(snap(), width=live.console.width, max_rows=rows)), refresh=True)
            time.sleep(max(0.0, interval - (time.time() - t0)))
