"""`eepctl events` as text: one row per operation (its short id, kind, start, sizes, state, time,
phases, serving pause), the errors, fences and predicted-vs-measured costs under it, and the
per-rank events only when asked for (``-v`` or ``--op``). Pure: records in, text out."""

from __future__ import annotations

import time
from typing import Any

from engine_ext.protocol import REPORTED_PHASES

_KIND = {"recover": "recovery"}  # an operation's kind as the table names it
_CAUSE = {"replace": "grow", "autoscale": "autoscale"}  # a scale the controller started, and why


def kind_label(op: dict[str, Any]) -> str:
    """scale, grow (policy replace growing back), autoscale, recovery or rebuild."""
    kind = op.get("kind") or "scale"
    if kind == "scale" and op.get("cause") in _CAUSE:
        return _CAUSE[op["cause"]]
    return _KIND.get(kind, kind)


def operation_level(ev: dict[str, Any]) -> bool:
    """An event every reader needs: the controller's (an operation's own phases), a fence, a failure.
    The rest (each rank's part of each phase) is shown on demand."""
    return ev["rank"] == -1 or ev["phase"] == "fence" or ev.get("outcome", "ok") != "ok"


def event_line(ev: dict[str, Any], short: dict[str, str] | None = None) -> str:
    who = "controller" if ev["rank"] == -1 else f"rank {ev['rank']}"
    ts = time.strftime("%H:%M:%S", time.localtime(ev["start"]))
    op = (short or {}).get(ev["op_id"], ev["op_id"]) or "-"
    detail = ev.get("detail") or {}
    extra = "".join(f" {k}={detail[k]}" for k in ("epoch", "reason", "error") if k in detail)
    took = ev.get("duration_s", 0.0)
    return f"{ts} {op} {who:<10} {ev['phase']:<22} {ev.get('outcome', 'ok'):<5} {took:8.3f}s{extra}"


def fence_lines(events: list[dict[str, Any]], short: dict[str, str]) -> list[str]:
    """Every fence among ``events``: when, which rank, at which epoch and why."""
    out = []
    for e in events:
        if e["phase"] == "fence" and e["rank"] >= 0:
            d = e.get("detail") or {}
            during = f" (during {short.get(e['op_id'], e['op_id'])})" if e.get("op_id") else ""
            out.append(
                f"{time.strftime('%H:%M:%S', time.localtime(e['start']))} rank {e['rank']} fenced at epoch "
                f"{d.get('epoch', '?')}: {d.get('reason', 'no reason given')}{during}"
            )
    return out


def _span(per_rank: dict[str, int]) -> str:
    from eepctl.render_text import human_bytes

    if not per_rank:
        return "-"
    lo, hi = min(per_rank.values()), max(per_rank.values())
    return human_bytes(hi) if lo == hi else f"{human_bytes(lo)}..{human_bytes(hi)}"


def _captures(per_rank: dict[str, int]) -> str:
    if not per_rank:
        return "-"
    lo, hi = min(per_rank.values()), max(per_rank.values())
    return f"{lo} each" if lo == hi else f"{lo}-{hi}"


def _workspace(op: dict[str, Any]) -> str:
    before, after = op.get("workspace_before") or {}, op.get("workspace_after") or {}
    return f"{_span(before)} -> {_span(after)}" if before or after else "-"


def _took(op: dict[str, Any]) -> str:
    if not op.get("finished") or not op.get("started"):
        return "-"
    return f"{max(0.0, op['finished'] - op['started']):.2f}s"


def _longest(op: dict[str, Any]) -> str:
    pd = op.get("phase_durations") or {}
    if not pd:
        return "-"
    phase = max(pd, key=lambda p: pd[p])
    return f"{phase} {pd[phase]:.2f}s"


# The column sets of the table, widest first: the first that fits the width is drawn.
_LEVELS = ("phases", "longest+memory", "longest", "base")


def ops_table(ops: list[dict[str, Any]], short: dict[str, str], level: str) -> Any:
    """The operations, one line each. Every level has the id, kind, start, sizes, state, time and
    pause; "phases" adds each phase any of them has, the captures and the workspace; the
    "longest" levels the longest phase ("+memory": with the captures and workspace)."""
    from rich.table import Table

    phases = [p for p in REPORTED_PHASES if any(p in (o.get("phase_durations") or {}) for o in ops)]
    extra = {
        "phases": [*phases, "captures/rank", "workspace"],
        "longest+memory": ["longest phase", "captures/rank", "workspace"],
        "longest": ["longest phase"],
        "base": [],
    }[level]
    table = Table(title="operations", title_justify="left")
    ids = [short.get(o["op_id"], o["op_id"]) for o in ops]
    for col in ("op", "kind", "started", "dp", "state", "took", "pause", *extra):
        table.add_column(col, no_wrap=True, overflow="ellipsis", min_width=max(map(len, ids)) if col == "op" else None)
    for op_short, op in zip(ids, ops):
        pd = op.get("phase_durations") or {}
        started = time.strftime("%H:%M:%S", time.localtime(op["started"])) if op.get("started") else "-"
        cells = {p: f"{pd[p]:.2f}s" if p in pd else "-" for p in phases}
        cells.update(
            {
                "longest phase": _longest(op),
                "captures/rank": _captures(op.get("captures_per_rank") or {}),
                "workspace": _workspace(op),
            }
        )
        table.add_row(
            op_short,
            kind_label(op),
            started,
            f"{op['from_size']}->{op['to_size']}",
            op["state"],
            _took(op),
            f"{op.get('serving_pause_s', 0.0) * 1000:.0f} ms",
            *[cells[c] for c in extra],
        )
    return table


def events_text(data: dict[str, Any], width: int = 160, verbose: bool = False) -> str:
    """The table with the most columns that fit ``width``, then the lines under it (each error in
    full, the requests a scale-up re-dispatched, costs, fences); every event with ``verbose``."""
    from eepctl.render_cost import cost_lines
    from eepctl.render_text import natural_width, rich_text

    ops, evs = data.get("operations", []), data.get("events", [])
    short = data.get("short_ids") or {o["op_id"]: o["op_id"] for o in ops}
    out: list[Any] = []
    if ops:
        tables = (ops_table(ops, short, level) for level in _LEVELS)
        out.append(next((t for t in tables if natural_width(t) <= width), None) or ops_table(ops, short, "base"))
    total = data.get("operations_total")
    if total and total > len(ops):
        out.append(f"the last {len(ops)} of {total} operations (--last N shows more)")
    out += [f"{short.get(o['op_id'], o['op_id'])} {o['state']}: {o['error']}" for o in ops if o.get("error")]
    out += [
        f"{short.get(o['op_id'], o['op_id'])}: {o['redispatched_requests']} request(s) waiting on the old ranks "
        "re-dispatched over the new width"
        for o in ops
        if o.get("redispatched_requests")
    ]
    out += cost_lines(ops)
    out += fence_lines(evs, short)
    if verbose:
        out += [event_line(e, short) for e in evs]
    elif any(e["phase"] != "fence" for e in evs):
        out.append(
            f"{sum(e['phase'] != 'fence' for e in evs)} phase event(s) of the controller and each rank not "
            "shown: -v shows them, --op ID one operation's"
        )
    if not out:
        out.append("no operations or events yet")
    return rich_text(out, width)
