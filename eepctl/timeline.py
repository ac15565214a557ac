"""A picture of one operation: per-rank spans of its phases, drawn as a Gantt in the terminal.

``timeline(data)`` turns `eepctl events --op ID` data into spans (the -o json form);
``timeline_text`` draws them. Ranks whose phase sequences and times agree within a tolerance share
one row, so 64 ranks stay readable; the serving pause is a row of its own and the slowest rank
(the one that ended its phases last) is marked.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

# Letters and colours of the phases we know, one letter each; any other phase (a vLLM hook's)
# gets a letter of its name that no other phase of the picture has (``glyphs``).
_GLYPH = {
    "launch": "L",
    "plan": "n",
    "prepare": "p",
    "prepare_warm_groups": "g",
    "transfer": "t",
    "precopy": "y",
    "drain": "d",
    "commit": "c",
    "reshuffle": "r",
    "warm": "w",
    "capture": "C",
    "lock": "k",
    "cleanup": "x",
    "rollback": "R",
    "failure": "!",
    "detect": "D",
    "abort": "a",
    "regroup": "G",
    "restore_experts": "e",
    "resume": "u",
    "rebuild": "b",
    "fence": "F",
}
_COLOUR = {
    "launch": "blue",
    "prepare": "cyan",
    "transfer": "magenta",
    "drain": "yellow",
    "commit": "white",
    "reshuffle": "bright_magenta",
    "warm": "green",
    "capture": "bright_green",
    "cleanup": "bright_black",
    "rollback": "red",
    "failure": "bold red",
}
PAUSE_PHASE = "commit"  # a rank stops serving for its commit (its detail carries pause_s)


def glyphs(phases: list[str]) -> dict[str, str]:
    """A distinct letter per phase: the known ones', then for each other phase the first letter of
    its name not taken (lower case, then upper case), else any free letter or digit."""
    out = {p: _GLYPH[p] for p in phases if p in _GLYPH}
    spare = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    for p in phases:
        if p not in out:
            name = [c for c in p if c.isalnum()]
            taken = set(out.values())
            out[p] = next((c for c in [*name, *(c.upper() for c in name), *spare] if c not in taken), "?")
    return out


def timeline(data: dict[str, Any], op_id: str | None = None, tolerance_s: float | None = None) -> dict[str, Any]:
    """Spans relative to the operation's first event, the pause window, the slowest rank and
    the groups of ranks that did the same thing at the same times (within ``tolerance_s``:
    default 5% of the operation, at least 20 ms)."""
    ranks = next((o.get("rank_ops") or [] for o in data.get("operations", []) if o["op_id"] == op_id), [])
    evs = [e for e in data.get("events", []) if op_id is None or e["op_id"] == op_id or e["op_id"] in ranks]
    op_id = op_id or (evs[0]["op_id"] if evs else "")
    if not evs:
        return {
            "op_id": op_id,
            "t0": None,
            "duration_s": 0.0,
            "spans": [],
            "pause": None,
            "slowest_rank": None,
            "groups": [],
        }
    t0 = min(float(e["start"]) for e in evs)
    spans = sorted(
        (
            {
                "rank": e["rank"],
                "phase": e["phase"],
                "start_s": round(float(e["start"]) - t0, 4),
                "end_s": round(float(e["end"]) - t0, 4),
                "duration_s": e.get("duration_s", 0.0),
                "outcome": e.get("outcome", "ok"),
            }
            for e in evs
        ),
        key=lambda s: (s["rank"], s["start_s"], -s["end_s"]),
    )
    total = max(s["end_s"] for s in spans)
    commits = [s for s in spans if s["phase"] == PAUSE_PHASE and s["rank"] >= 0]
    pause = None
    if commits:
        lo, hi = min(s["start_s"] for s in commits), max(s["end_s"] for s in commits)
        pause = {"start_s": lo, "end_s": hi, "duration_s": round(hi - lo, 4)}
    rank_end: dict[int, float] = {}
    for s in spans:
        if s["rank"] >= 0:
            rank_end[s["rank"]] = max(rank_end.get(s["rank"], 0.0), s["end_s"])
    slowest = max(rank_end, key=lambda r: (rank_end[r], -r)) if rank_end else None
    tol = tolerance_s if tolerance_s is not None else max(0.02, 0.05 * total)
    return {
        "op_id": op_id,
        "t0": t0,
        "duration_s": round(total, 4),
        "spans": spans,
        "pause": pause,
        "slowest_rank": slowest,
        "tolerance_s": round(tol, 4),
        "groups": _groups(spans, tol),
    }


def _groups(spans: list[dict[str, Any]], tol: float) -> list[dict[str, Any]]:
    """Rows of ranks with the same phase sequence and each span within ``tol`` of the group's
    first rank; the controller (rank -1) is a row of its own."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        by_rank.setdefault(s["rank"], []).append(s)
    groups: list[dict[str, Any]] = []
    for rank in sorted(by_rank):
        mine = by_rank[rank]
        for g in groups:
            rep = g["spans"]
            if (
                rank >= 0
                and g["ranks"][0] >= 0
                and len(rep) == len(mine)
                and all(
                    a["phase"] == b["phase"]
                    and abs(a["start_s"] - b["start_s"]) <= tol
                    and abs(a["end_s"] - b["end_s"]) <= tol
                    for a, b in zip(rep, mine)
                )
            ):
                g["ranks"].append(rank)
                break
        else:
            groups.append({"ranks": [rank], "spans": mine})
    return groups


def rank_ranges(ranks: list[int]) -> str:
    """0,1,2,3,5 -> "0-3,5"."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


def _bar(spans: list[dict[str, Any]], total: float, width: int, glyph: dict[str, str]) -> Text:
    """One row: longer spans first, so phases nested in others (commit holds warm) stay visible."""
    cells = [" "] * width
    styles: list[str | None] = [None] * width
    scale = (width - 1) / total if total > 0 else 0.0
    for s in sorted(spans, key=lambda s: -(s["end_s"] - s["start_s"])):
        a = int(round(s["start_s"] * scale))
        b = max(a, int(round(s["end_s"] * scale)))
        for i in range(a, min(b, width - 1) + 1):
            cells[i] = "!" if s["outcome"] != "ok" else glyph[s["phase"]]
            styles[i] = "bold red" if s["outcome"] != "ok" else _COLOUR.get(s["phase"])
    text = Text()
    for c, st in zip(cells, styles):
        text.append(c, style=st or "")
    return text


def timeline_renderables(tl: dict[str, Any], width: int = 120) -> list[Any]:
    if not tl["spans"]:
        return [f"no events for {tl['op_id'] or 'this operation'}"]
    bar_w = max(20, width - 40)
    total = tl["duration_s"]
    table = Table(
        title=f"{tl['op_id']}: {total:.2f}s, ranks grouped within {tl['tolerance_s'] * 1000:.0f} ms",
        title_justify="left",
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("ranks", no_wrap=True)
    end_label = f"{total:.2f}s"
    table.add_column(f"0s{' ' * (bar_w - 2 - len(end_label))}{end_label}", no_wrap=True)
    table.add_column("end", no_wrap=True, justify="right")
    first = {}  # phase -> when it first began
    for s in tl["spans"]:
        first[s["phase"]] = min(first.get(s["phase"], s["start_s"]), s["start_s"])
    seen = sorted(first, key=lambda p: first[p])
    glyph = glyphs(seen)
    for g in tl["groups"]:
        label = (
            "controller"
            if g["ranks"] == [-1]
            else f"{rank_ranges(g['ranks'])}" + (f" (x{len(g['ranks'])})" if len(g["ranks"]) > 1 else "")
        )
        end = max(s["end_s"] for s in g["spans"])
        slow = tl["slowest_rank"] in g["ranks"] and g["ranks"] != [-1]
        table.add_row(
            Text(label + (" <- slowest" if slow else ""), style="bold red" if slow else ""),
            _bar(g["spans"], total, bar_w, glyph),
            f"{end:.2f}s",
        )
    pause = tl.get("pause")
    if pause:
        table.add_row(
            Text("serving pause", style="bold yellow"),
            _pause_bar(pause, total, bar_w),
            f"{pause['duration_s'] * 1000:.0f} ms",
        )
    legend = "  ".join(f"{glyph[p]}={p}" for p in seen) + ("  ==serving pause" if pause else "")
    return [table, legend]


def _pause_bar(pause: dict[str, Any], total: float, width: int) -> Text:
    cells = [" "] * width
    scale = (width - 1) / total if total > 0 else 0.0
    for i in range(int(round(pause["start_s"] * scale)), int(round(pause["end_s"] * scale)) + 1):
        cells[min(i, width - 1)] = "="
    return Text("".join(cells), style="bold yellow")


def timeline_text(tl: dict[str, Any], width: int = 120) -> str:
    from eepctl.render_text import rich_text

    return rich_text(timeline_renderables(tl, width), width)
