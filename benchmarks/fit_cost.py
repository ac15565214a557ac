"""Fit the scale cost model (engine_ext/control/cost_model.py) to curves measured by
``benchmarks/curves.py`` (its bytes and pause parts), and write it with the host they ran on; or
report, for curves run with a model in place, each scale's predicted cost beside its measured one.

  fit      move time = latency + bytes moved x s/B + bytes into spare buffers x s/B (the pre-copy,
           slowest rank; all ranks' bytes), and per capture
           policy serving pause = base + expert bytes a rank holds x slope, by least squares on the
           relative errors; the commit's loads into slots priced at the copy rate (host or device, measured
           by curves.py beside the scales)
  report   per scale: predicted and measured pause and move time, and the error of each
  leave-one-size-out  per scale: predicted by a fit of the other sizes only, and measured

Usage:
  PYTHONPATH=. python benchmarks/fit_cost.py docs/results/curves.json [...] --out engine_ext/control/cost_model.json
  PYTHONPATH=. python benchmarks/fit_cost.py --report /tmp/check/curves.json
  PYTHONPATH=. python benchmarks/fit_cost.py --leave-one-size-out tests/data/h100_cuda_fit_curves.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from engine_ext.control.cost_model import MOVE_FEATURES, PAUSE_FEATURES, fit, move_s, pause_s, within_range


def points(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per 2->4 of the bytes and pause parts that recorded its cost (the plan's features
    and the measurement)."""
    rows = list(res.get("bytes", [])) + ([res["pause"]] if res.get("pause") else [])
    out = []
    for r in rows:
        cost = r.get("cost") or {}
        pred, got = cost.get("predicted"), cost.get("measured")
        if r.get("state") != "succeeded" or not pred or not got:
            continue
        out.append(
            {
                **{f: pred[f] for f in MOVE_FEATURES + PAUSE_FEATURES},
                "move_s": got["move_s"],
                "pause_s": got["pause_s"],
                "capture_policy": r["capture_policy"],
                "capture_sizes": r["capture_sizes"],
                "pool": r["pool"],
                "expert_MiB": r.get("expert_MiB", 1.0),
            }
        )
    return out


def fit_and_write(paths: list[str], out: str) -> dict[str, Any]:
    """Fit the points of every curves JSON in ``paths`` (all from one host) and write the model."""
    runs = [json.load(open(p)) for p in paths]
    hosts = {json.dumps(r.get("host"), sort_keys=True) for r in runs}
    if len(hosts) != 1 or not runs[0].get("host"):
        raise SystemExit(f"curves from one host with its identity recorded, got: {sorted(hosts)}")
    pts = [p for r in runs for p in points(r)]
    rates = [r["copy_GBps"] for r in runs if r.get("copy_GBps")]
    model = fit(pts, runs[0]["host"], paths, min(rates) if rates else None)
    with open(out, "w") as f:
        json.dump(model, f, indent=1)
        f.write("\n")
    mv = model["move"]
    print(f"wrote {out}: {len(pts)} points from {runs[0]['host']}")
    print(
        f"  move: {mv['intercept']:.4f} s + {mv['coef'].get('total_moved_bytes', 0.0) * 2**30:.3f} s/GiB moved + "
        f"{mv['coef'].get('spare_total_bytes', 0.0) * 2**30:.3f} s/GiB into spare buffers "
        f"(not fitted: {mv['not_fitted']}) "
        f"(max error on its points {mv['max_rel_error']:.0%}, "
        f"spread x{mv['spread'][0]:.2f}..x{mv['spread'][1]:.2f}); "
        f"the commit's loads at "
        f"{min(rates) if rates else 0:.1f} GB/s (the copy rate measured beside the curves)"
    )
    for policy, pz in model["pause"].items():
        print(
            f"  pause ({policy}): {pz['intercept']:.4f} s + {pz['coef'].get('rank_expert_bytes', 0.0) * 2**30:.4f} "
            f"s/GiB held per rank + {pz['coef'].get('commit_load_bytes', 0.0) * 2**30:.4f} s/GiB loaded in the "
            f"commit (max error on its points {pz['max_rel_error']:.0%}, "
            f"spread x{pz['spread'][0]:.2f}..x{pz['spread'][1]:.2f}; "
            f"not fitted: {pz['not_fitted']})"
        )
    return model


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _error_cell(err: dict[str, float], inside: dict[str, bool], k: str) -> str:
    """The error of part ``k``, and whether the measurement fell inside the predicted range."""
    where = "" if k not in inside else " in" if inside[k] else " **out**"
    return (f"{err[k]:+.0%}" if k in err else "-") + where


def _range_cell(pred: dict[str, Any], k: str) -> str:
    return f" ({pred[k][0]:.4f}-{pred[k][1]:.4f})" if pred.get(k) else ""


def _report_row(
    mib: float, pred: dict[str, Any], got: dict[str, Any], err: dict[str, float], inside: dict[str, bool]
) -> str:
    """One scale's row of the report: predicted (range), measured and error of the pause and the move."""
    pause = (
        f"{_seconds(pred.get('pause_s'))}{_range_cell(pred, 'pause_range_s')} | {_seconds(got.get('pause_s'))} "
        f"| {_error_cell(err, inside, 'pause_s')}"
    )
    move = (
        f"{_seconds(pred.get('move_s'))}{_range_cell(pred, 'move_range_s')} | {_seconds(got.get('move_s'))} "
        f"| {_error_cell(err, inside, 'move_s')}"
    )
    return f"| {mib:.0f} | {pause} | {move} |" + (f" {pred['no_model']}" if pred.get("no_model") else "")


def report(paths: list[str]) -> None:
    """Per scale, then per part: how many within 25 %, how many inside the predicted range, and
    the error of the median of the repeats of each size (one scale's pause strays; the median of
    its repeats says whether the model is off)."""
    print(
        "| expert MiB | pause predicted s (range) | measured s | error "
        "| move predicted s (range) | measured s | error |"
    )
    print("|---|---|---|---|---|---|---|")
    by_plan: dict[tuple[Any, ...], list[tuple[dict[str, Any], dict[str, Any]]]] = {}  # repeats of one plan
    for p in paths:
        res = json.load(open(p))
        for r in list(res.get("bytes", [])) + ([res["pause"]] if res.get("pause") else []):
            cost = r.get("cost") or {}
            pred, got, err = cost.get("predicted") or {}, cost.get("measured") or {}, cost.get("error") or {}
            if not got:
                continue
            mib = r.get("expert_MiB", 1.0)
            key = (mib, *(pred.get(f) for f in ("total_moved_bytes", "spare_total_bytes", "commit_load_bytes")))
            by_plan.setdefault(key, []).append((pred, got))
            print(_report_row(mib, pred, got, err, within_range(pred, got)))
    for k in ("pause_s", "move_s"):
        pairs = [(pr, g) for rows in by_plan.values() for pr, g in rows if pr.get(k) is not None and g.get(k)]
        if not pairs:
            continue
        errs = [(pr[k] - g[k]) / g[k] for pr, g in pairs]
        inside = [within_range(pr, g).get(k) for pr, g in pairs]
        med = []
        for key, rows in sorted(by_plan.items(), key=lambda kv: (kv[0][0], str(kv[0][1:]))):
            got = [g[k] for pr, g in rows if pr.get(k) is not None and g.get(k)]
            if got:  # one size's repeats may differ in plan (the load-based layout): grouped by plan
                gm = statistics.median(got)
                med.append(
                    f"{key[0]:.0f} MiB{' (spare)' if key[2] else ''} x{len(got)} {(rows[0][0][k] - gm) / gm:+.0%}"
                )
        print(
            f"{k}: within 25 % on {sum(abs(x) <= 0.25 for x in errs)} of {len(errs)} scales (median |error| "
            f"{statistics.median(abs(x) for x in errs):.0%}); inside the range on {sum(bool(x) for x in inside)} of "
            f"{sum(x is not None for x in inside)}; median of the repeats of each plan: {', '.join(med)}"
        )


def leave_one_size_out(paths: list[str]) -> None:
    """Each size's scales predicted by a model fitted on the other sizes' scales only: a held-out
    check from one run (a second run on a lent machine may land on another one)."""
    runs = [json.load(open(p)) for p in paths]
    pts = [pt for r in runs for pt in points(r)]
    rates = [r["copy_GBps"] for r in runs if r.get("copy_GBps")]
    counts = {"pause_s": 0, "move_s": 0}
    for size in sorted({p["expert_MiB"] for p in pts}):
        model = fit([p for p in pts if p["expert_MiB"] != size], runs[0]["host"], paths, min(rates) if rates else None)
        for p in pts:
            if p["expert_MiB"] != size:
                continue
            pred = {"pause_s": pause_s(model, p, p["capture_policy"]), "move_s": move_s(model, p)}
            err = {k: (pred[k] - p[k]) / p[k] for k in pred}
            counts = {k: counts[k] + (abs(err[k]) <= 0.25) for k in counts}
            print(
                f"| {size:.0f} | {p['commit_load_bytes'] / 2**20:.0f} | {pred['pause_s']:.4f} | {p['pause_s']:.4f} | "
                f"{err['pause_s']:+.0%} | {pred['move_s']:.4f} | {p['move_s']:.4f} | {err['move_s']:+.0%} |"
            )
    print(f"within 25 %: pause on {counts['pause_s']} of {len(pts)} scales, move on {counts['move_s']} of {len(pts)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("curves", nargs="+", help="curves JSON files written by benchmarks/curves.py")
    ap.add_argument("--out", default="engine_ext/control/cost_model.json")
    ap.add_argument("--report", action="store_true", help="print predicted vs measured instead of fitting")
    ap.add_argument(
        "--leave-one-size-out",
        action="store_true",
        help="predict each size from a fit of the other sizes (no model written)",
    )
    a = ap.parse_args()
    if a.report:
        report(a.curves)
    elif a.leave_one_size_out:
        print(
            "| expert MiB | loaded in commit MiB | pause predicted s | measured s | error "
            "| move predicted s | measured s | error |"
        )
        print("|---|---|---|---|---|---|---|---|")
        leave_one_size_out(a.curves)
    else:
        fit_and_write(a.curves, a.out)
