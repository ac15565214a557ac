"""Pure renderers of the autoscaler's records: the policy, the decision trail, and a terminal plot
of DP (actual and recommended), load and the SLO signal over the window with transitions marked.
Plain characters only, so the plot reads the same in a pipe, a log and a terminal."""

from __future__ import annotations

import time
from typing import Any

MARKS = {"scaled": "S", "scale": "S", "failed": "F", "advisory": "A", "blocked": "B"}
TARGET_TEXT = (
    ("target_queue", "queue {:g} requests/rank"),
    ("target_kv", "KV use {:.0%}"),
    ("slo_ttft_ms", "TTFT p95 {:g} ms"),
    ("slo_tpot_ms", "TPOT p95 {:g} ms"),
    ("target_utilization", "load at {:.0%} of capacity"),
)


def _delay(v: Any) -> str:
    return f"{v:g}s" if isinstance(v, (int, float)) else str(v)


def policy_line(p: dict[str, Any] | None) -> str:
    """A policy in one line; "no autoscaling policy" when none was set."""
    if not p:
        return "no autoscaling policy (`eepctl autoscale --min-dp N --max-dp M --target-queue Q` sets one)"
    targets = ", ".join(fmt.format(p[k]) for k, fmt in TARGET_TEXT if p.get(k)) or "none"
    return (
        f"mode {p['mode']}, DP {p['min_dp']}..{p['max_dp']}, targets: {targets}; up after "
        f"{_delay(p['up_delay_s'])}, down after {_delay(p['down_delay_s'])}, tolerance {p['tolerance']:.0%}, "
        f"max step {p['max_step']}, cooldown {_delay(p['cooldown_s'])}, window {p['window_s']:g}s"
        + (f", standby auto for a {p.get('burst', 4.0):g}x burst" if p.get("standby") == "auto" else "")
    )


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def decision_line(d: dict[str, Any]) -> str:
    sig = " ".join(f"{s['name']}={s['value']:g}/{s['target']:g}->{s['recommendation']}" for s in d.get("signals", []))
    size = f"DP {d['current_dp']}" + (f" -> {d['recommendation']}" if d["recommendation"] != d["current_dp"] else "")
    return f"{_clock(d['at'])}  {d['id']}  {size:<12} {d['action']:<24} {d['rule']}" + (f"  [{sig}]" if sig else "")


def adopts_line(d: dict[str, Any]) -> str:
    """A scale-up that adopts the engine cores vLLM prepared ahead: which, and what it is predicted to cost."""
    cores = int(d["adopts"]) - int(d["current_dp"])
    cost = (d.get("timing") or {}).get("scale_up_s")
    return f"  adopts the {cores} engine core(s) prepared for DP {d['adopts']}: the scale-up is their commit" + (
        f" (predicted {cost:g}s)" if isinstance(cost, (int, float)) else ""
    )


def set_text(res: dict[str, Any]) -> str:
    lines = [f"autoscale policy of {res['deployment']}: {policy_line(res['policy'])}"]
    if res.get("previous"):
        lines.append(f"  was: {policy_line(res['previous'])}")
    if str(res["policy"]["mode"]) == "advisory":
        lines.append("  advisory: decisions are recorded and shown (`eepctl events --autoscaler`), none is acted on")
    return "\n".join(lines) + "\n"


def show_text(data: dict[str, Any]) -> str:
    lines = [f"autoscale policy of {data['deployment']}: {policy_line(data.get('policy'))}"]
    last = data.get("last")
    if last:
        lines.append(f"  recommendation: DP {last['recommendation']} (now {last['current_dp']}): {last['rule']}")
        if last.get("adopts"):
            lines.append(adopts_line(last))
        lines.append(f"  last decision: {decision_line(last)}")
    elif data.get("policy"):
        lines.append("  no decision yet")
    return "\n".join(lines) + "\n"


def decisions_text(data: dict[str, Any]) -> str:
    rows = data.get("decisions", [])
    if not rows:
        return (
            f"no autoscaler decisions for {data['deployment']}"
            + ("" if data.get("policy") else " (no autoscaling policy set)")
            + "\n"
        )
    return "\n".join(decision_line(d) for d in rows) + "\n"


def _columns(rows: list[dict[str, Any]], width: int) -> list[dict[str, Any] | None]:
    """The decisions resampled to ``width`` columns by time (the last decision of each column)."""
    t0, t1 = rows[0]["at"], rows[-1]["at"]
    span = max(t1 - t0, 1e-9)
    cols: list[dict[str, Any] | None] = [None] * width
    for d in rows:
        cols[min(width - 1, int((d["at"] - t0) / span * (width - 1)))] = d
    last = None
    for i, c in enumerate(cols):  # a column with no decision repeats the last one seen
        last = c if c is not None else last
        cols[i] = last
    return cols


def _signal(d: dict[str, Any] | None, names: tuple[str, ...], key: str) -> float | None:
    for s in (d or {}).get("signals", []):
        if s["name"] in names:
            return float(s[key])
    return None


def _panel(
    title: str, series: list[tuple[str, list[float | None]]], height: int, lo: float, hi: float, unit: str = ""
) -> list[str]:
    """One chart: each series drawn with its character; rows top (hi) to bottom (lo)."""
    width = len(series[0][1]) if series else 0
    grid = [[" "] * width for _ in range(height)]
    span = max(hi - lo, 1e-9)
    for ch, values in series:
        for x, v in enumerate(values):
            if v is not None:
                y = height - 1 - round((min(max(v, lo), hi) - lo) / span * (height - 1))
                grid[y][x] = ch if grid[y][x] == " " else grid[y][x]
    label_w = 7
    out = [title]
    for i, row in enumerate(grid):
        value = hi - span * i / max(1, height - 1)
        out.append(f"{value:>{label_w - 1}.4g}{(unit[:1] or ' ') if i == 0 else ' '}|" + "".join(row))
    return out


def plot_text(data: dict[str, Any], width: int = 100, height: int = 6) -> str:
    """DP (actual ``#``, recommended ``*``), load (``o``, target ``-``) and the SLO signal's p95 over
    its SLO (``x``, 1.0 ``-``, panic at 2.0 ``=``) over the decisions' window; a marks row below:
    S scaled, F failed, A advisory (not acted), B blocked."""
    rows, p = data.get("decisions", []), data.get("policy") or {}
    if not rows:
        return decisions_text(data)
    w = max(10, width - 8)
    cols = _columns(rows, w)
    dp_hi = float(max([p.get("max_dp", 1)] + [max(d["current_dp"], d["recommendation"]) for d in rows]))
    out = _panel(
        "DP  (# actual, * recommended)",
        [
            ("#", [d["current_dp"] if d else None for d in cols]),
            ("*", [d["recommendation"] if d else None for d in cols]),
        ],
        int(dp_hi) + 1 if dp_hi <= 12 else height,
        0.0,
        dp_hi,
    )  # one row per size when few
    load_names = ("queue",) if p.get("target_queue") else ("kv",)
    load = [_signal(d, load_names, "value") for d in cols]
    target = _signal(rows[-1], load_names, "target")
    if any(v is not None for v in load):
        hi = max([v for v in load if v is not None] + [2 * (target or 0)])
        out += _panel(
            f"load: {load_names[0]} per rank  (o value, - target {target:g})" if target else "load",
            [("o", load), ("-", [target] * w)],
            height,
            0.0,
            hi or 1.0,
        )
    slo = [_signal(d, ("ttft", "tpot"), "ratio") for d in cols]
    if any(v is not None for v in slo):
        hi = max([2.5] + [v for v in slo if v is not None])
        out += _panel(
            "SLO: p95 / SLO  (x value, - SLO, = panic at 2x)",
            [("x", slo), ("-", [1.0] * w), ("=", [2.0] * w)],
            height,
            0.0,
            hi,
        )
    marks = [" "] * w
    for d in rows:
        x = next(i for i, c in enumerate(cols) if c is not None and c["at"] >= d["at"])
        mark = MARKS.get(d["action"].split(":", 1)[0])
        if mark and marks[x] not in ("S", "F"):
            marks[x] = mark
    out.append(" " * 7 + "|" + "".join(marks))
    out.append(" " * 8 + f"{_clock(rows[0]['at'])}" + f"{_clock(rows[-1]['at']):>{max(0, w - 8)}}")
    out.append("marks: S scaled, F failed, A advisory (not acted), B blocked")
    return "\n".join(out) + "\n"
