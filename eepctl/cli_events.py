"""`eepctl events`: a deployment's operations and fences, one operation's events or timeline, the
autoscaler's decisions; ``--follow`` prints each new one. Parses its options, selects with
eepctl.events_query, renders with eepctl.render_events and eepctl.timeline (registered by eepctl.cli)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from eepctl.options import Address, Name, Namespace, Output, OutputOpt, emit, target, width
from engine_ext.protocol import DEFAULT_DEPLOYMENT, DEFAULT_NAMESPACE, UsageError

Op = Annotated[
    str | None,
    typer.Option("--op", help="Only this operation (its full id or the short one the table shows), with every event."),
]
Follow = Annotated[
    bool, typer.Option("--follow", "-f", help="Keep printing new events (until the operation ends, with --op).")
]
Timeline = Annotated[
    bool,
    typer.Option(
        "--timeline",
        help="A per-rank Gantt of an operation's phases (--op; default: the last operation; -o json: the spans).",
    ),
]
Autoscaler = Annotated[
    bool,
    typer.Option(
        "--autoscaler", help="The autoscaler's decisions instead: signals, rule fired, recommendation, action."
    ),
]
Last = Annotated[
    int | None,
    typer.Option(
        "--last", help="Only the last N operations (default 20 in the table; all with -o json).", show_default=False
    ),
]
Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose", "-v", help="Also every event of the controller and of each rank (--op: that operation's)."
    ),
]


def events(
    op: Op = None,
    follow: Follow = False,
    timeline: Timeline = False,
    autoscaler: Autoscaler = False,
    last: Last = None,
    verbose: Verbose = False,
    name: Name = DEFAULT_DEPLOYMENT,
    address: Address = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    output: OutputOpt = Output.table,
) -> None:
    """Operations (kind, sizes, phase durations, serving pause, captures, workspace) and fences; and their events."""
    from eepctl import events_query, render
    from eepctl.render_events import events_text

    t = target(address, namespace, name)
    if last is not None and last < 0:
        raise UsageError(f"--last must be >= 0, got {last}")
    if autoscaler:
        _autoscaler_events(t, follow, output)
        return
    op = events_query.resolve(t, op) if op else None
    if timeline:
        from eepctl import core
        from eepctl.timeline import timeline as build
        from eepctl.timeline import timeline_text

        op = op or events_query.last_op(t)
        tl = build(core.events(t, op), op)
        emit(render.to_json("timeline", tl) + "\n" if output == Output.json else timeline_text(tl, width=width()))
        return
    if last is None and output != Output.json:
        last = events_query.DEFAULT_LAST
    data = events_query.query(t, op, last)
    if not follow:
        emit(
            render.to_json("events", data) + "\n"
            if output == Output.json
            else events_text(data, width=width(), verbose=verbose or op is not None)
        )
        return
    _follow_events(t, op, data, output, verbose or op is not None)


def _follow_events(t: Any, op: str | None, data: dict[str, Any], output: Output, verbose: bool) -> None:
    """`events --follow`: the events so far, then each new one; with ``--op``, until it ends."""
    from eepctl import core, render
    from eepctl.render_events import event_line, operation_level

    seq, short = 0, data.get("short_ids") or {}
    while True:
        for ev in data["events"]:
            seq = max(seq, ev["seq"])
            if output == Output.json:
                emit(render.to_json("event", ev) + "\n")
            elif verbose or operation_level(ev):
                emit(event_line(ev, short) + "\n")
        ops = data.get("operations", [])
        if op and ops and ops[-1].get("state") != "running":
            emit(render.to_json("operation", ops[-1]) + "\n" if output == Output.json else render.scale_text(ops[-1]))
            return
        time.sleep(0.5)
        data = core.events(t, op, seq)


def _autoscaler_events(t: Any, follow: bool, output: Output) -> None:
    """`events --autoscaler`: the decisions, then (``--follow``) each new one as it is taken."""
    from eepctl import core, render, render_autoscale

    data = core.autoscale_decisions(t)
    if not follow:
        emit(
            render.to_json("autoscale_decisions", data) + "\n"
            if output == Output.json
            else render_autoscale.decisions_text(data)
        )
        return
    since = 0.0
    while True:
        for d in data["decisions"]:
            since = max(since, d["at"])
            emit(
                render.to_json("autoscale_decision", d) + "\n"
                if output == Output.json
                else render_autoscale.decision_line(d) + "\n"
            )
        time.sleep(1.0)
        data = core.autoscale_decisions(t, since)
