"""What a scale will cost, predicted from the curves measured on this host.

A small linear model, fitted by least squares to the bytes curve of ``benchmarks/curves.py``
(``benchmarks/fit_cost.py`` writes it, with the host it was fitted on):

  move time (the pre-copy, in prepare)  = latency + bytes moved x s/B + bytes landing in spare
                                          buffers x s/B (all ranks': the moves go one at a time in
                                          the plan's order; a member lands its experts in fresh
                                          memory while it serves; the plan's ``precopy.per_rank``)
  serving pause (per capture policy)    = base + expert bytes a rank holds x slope
                                          + bytes the commit loads into slots x slope (where the
                                          curves had none: / the copy rate, the
                                          host's or on a GPU the device's)
                                          + bytes moved in the commit / the move's rate

Each figure comes with a range: the prediction times the least and the most measured/predicted
ratio of the fit's points, each predicted by a fit of the others (``spread``, leave-one-out). One
scale's pause of a few milliseconds strays by tens of per cent where ranks share cores; the range
says by how much on this host.

Bytes per rank and extra memory come from the plan itself (``engine_ext.elastic.precopy``); the
model only prices them. A deployment fits its own model, in this form, from its own finished scales
(engine_ext.control.cost_learn) and uses it once it has one; until then the model read from
``$EEPCTL_COST_MODEL`` or the file shipped beside this module, only on the host it was fitted on
(hostname, CPU count, device kind, GPU name): elsewhere the prediction says so and predicts nothing.
Torch-free; plain Python (the controller imports it).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

ENV = "EEPCTL_COST_MODEL"
SHIPPED = Path(__file__).with_name("cost_model.json")
FORMAT = 1
MOVE_FEATURES = ["total_moved_bytes", "spare_total_bytes"]
PAUSE_FEATURES = ["rank_expert_bytes", "commit_load_bytes"]


def host_identity(device: str = "cpu") -> dict[str, Any]:
    """The host a curve ran on or a prediction is made on: a model is only good where it was fitted.
    On a GPU host the GPU's name too: lent machines share a hostname and a CPU count, and an H100's
    fit priced an H200's scales (``nvidia-smi``: no CUDA context in this process)."""
    kind = device.split(":")[0]
    return {
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count() or 0,
        "device": kind,
        "gpu": gpu_name() if kind == "cuda" else "",
    }


@functools.cache
def gpu_name() -> str:
    """The first GPU's name, or "" where ``nvidia-smi`` cannot say (then no GPU fit matches). Asked
    once per process: every dry run of a GPU deployment checks the host."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out.strip() else ""


def same_host(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Hostname, CPU count, device kind and GPU name agree (a fit written before the GPU's name was
    kept has none: it matches only a host without a GPU)."""
    return all(a.get(k) == b.get(k) for k in ("hostname", "cpus", "device")) and a.get("gpu", "") == b.get("gpu", "")


def model_path() -> Path:
    return Path(os.environ[ENV]) if os.environ.get(ENV) else SHIPPED


def load_model(device: str = "cpu") -> tuple[dict[str, Any] | None, str]:
    """The model fitted on this host, or None and why not (one line)."""
    path = model_path()
    try:
        model = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no cost model fitted on this host ({path} does not exist; benchmarks/fit_cost.py writes one)"
    except (OSError, ValueError) as e:
        return None, f"no cost model fitted on this host ({path} unreadable: {e})"
    here, there = host_identity(device), model.get("host", {})
    if model.get("format") != FORMAT or not same_host(here, there):
        return None, (
            f"no cost model fitted on this host ({here['hostname']}, {here['cpus']} CPUs, "
            f"{_device(here)}): {path} was fitted on {there.get('hostname')}, {there.get('cpus')} "
            f"CPUs, {_device(there)}"
        )
    return model | {"path": str(path)}, ""


def _device(h: dict[str, Any]) -> str:
    return f"{h.get('device')} ({h['gpu']})" if h.get("gpu") else str(h.get("device"))


# ---- the fit ------------------------------------------------------------------------------------
def least_squares(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Coefficients c minimising sum((x . c - y)^2): the normal equations, solved by Gaussian
    elimination with partial pivoting (a handful of columns; no numpy in the controller)."""
    n = len(xs[0])
    a = [[sum(r[i] * r[j] for r in xs) for j in range(n)] + [sum(r[i] * y for r, y in zip(xs, ys))] for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            raise ValueError(f"column {col} is linearly dependent on the others: nothing to fit it from")
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * p for v, p in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_linear(points: list[dict[str, float]], features: list[str], target: str, loo: bool = True) -> dict[str, Any]:
    """``target`` = intercept + sum(coef x feature) over ``points``, minimising the squared
    relative errors (the target is "within x %": a 0.02 s pause weighs as much as a 2 s one). A
    feature that does not vary over the points cannot be told from the intercept: it is left out
    (coefficient 0) and named. Every feature is bytes that cost time, so a negative price is the
    noise of a few points (two scales that landed experts in spare buffers fitted -0.1 s/GiB on the
    16-core host and mispriced the next such scale by a third): that feature is left out too, the
    rest refitted, and it is named in ``negative``."""
    fixed = [f for f in features if len({p[f] for p in points}) < 2]
    used = [f for f in features if f not in fixed]
    ys = [float(p[target]) for p in points]
    w = [1.0 / y if y > 0 else 1.0 for y in ys]
    negative: list[str] = []
    while True:
        rows = [[1.0, *(float(p[f]) for f in used)] for p in points]
        if len(points) < len(used) + 1:
            raise ValueError(f"{target}: {len(points)} point(s) cannot fit {len(used) + 1} coefficients")
        coef = least_squares([[v * wi for v in r] for r, wi in zip(rows, w)], [y * wi for y, wi in zip(ys, w)])
        worst = min(range(len(used)), key=lambda i: coef[i + 1], default=None)
        if worst is None or coef[worst + 1] >= 0:
            break
        negative.append(used.pop(worst))
    fixed += negative
    fitted = [sum(c * v for c, v in zip(coef, r)) for r in rows]
    ratios = [y / f for f, y in zip(_left_out(points, features, target, loo), ys) if f > 0 and y > 0]
    return {
        "intercept": coef[0],
        "coef": dict(zip(used, coef[1:])),
        "not_fitted": fixed,
        "negative": negative,
        "points": len(points),
        "range": {f: [min(p[f] for p in points), max(p[f] for p in points)] for f in features},
        "max_rel_error": max((abs(f - y) / y for f, y in zip(fitted, ys) if y > 0), default=0.0),
        # measured / predicted over the fit's points, each predicted by the fit of the others, least
        # and most: how far a scale the fit did not see strayed on this host (on shared cores a
        # pause of a few ms strays by tens of per cent; a price only two points had, more)
        "spread": [min(ratios, default=1.0), max(ratios, default=1.0)],
    }


def _left_out(points: list[dict[str, float]], features: list[str], target: str, loo: bool) -> list[float]:
    """Each point's prediction by the fit of the other points (leave-one-out), or 0 where those
    cannot be fitted; with ``loo`` False (the inner fits) nothing is computed."""
    if not loo:
        return [0.0] * len(points)
    out = []
    for i in range(len(points)):
        try:
            part = fit_linear(points[:i] + points[i + 1 :], features, target, loo=False)
        except ValueError:
            out.append(0.0)
            continue
        out.append(_linear(part, points[i]))
    return out


def fit(
    points: list[dict[str, Any]], host: dict[str, Any], source: list[str], copy_GBps: float | None = None
) -> dict[str, Any]:
    """The model from curve points (``point``'s keys), with the host they were measured on.
    ``copy_GBps``: the copy rate measured beside them (the commit's loads into slots: host memory, or
    on a GPU the device's)."""
    model: dict[str, Any] = {
        "format": FORMAT,
        "host": host,
        "fitted_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "source": source,
        "move": fit_linear(points, MOVE_FEATURES, "move_s"),
        "pause": {},
        "load_s_per_byte": 1e-9 / copy_GBps if copy_GBps else 0.0,
    }
    for policy in sorted({p["capture_policy"] for p in points}):
        mine = [p for p in points if p["capture_policy"] == policy]
        model["pause"][policy] = fit_linear(mine, PAUSE_FEATURES, "pause_s") | {
            "capture_sizes": mine[0]["capture_sizes"],
            "joiners_from_pool": sorted({p["pool"] for p in mine}),
        }
    return model


# ---- the features of a plan, the prediction, the measurement -------------------------------------
def plan_features(plan: dict[str, Any], per_expert: int, slots_per_rank: int) -> dict[str, Any]:
    """What the model prices, from a plan's ``precopy.per_rank``: per rank the bytes it moves in the
    pre-copy (a joiner receives into its slots, a member into spare buffers; a sender sends), the
    bytes moved in the commit and the spare bytes held while serving."""
    joiners = {int(j["rank"]) for j in plan.get("joining", [])}
    ranks: dict[str, dict[str, int]] = {}
    for r, d in (plan.get("precopy") or {}).get("per_rank", {}).items():
        into = d["receive"] if int(r) in joiners else d["spare"]
        ranks[r] = {
            "moved_bytes": into + d["send"],  # through the rank; sends: the commit's too (a bound)
            "commit_bytes": d["commit_moved"],
            "spare_bytes": d["spare"],
            "into": into,
        }
    total = sum(v.pop("into") for v in ranks.values())
    return {
        "per_rank": ranks,
        "moved_bytes": max((v["moved_bytes"] for v in ranks.values()), default=0),
        "total_moved_bytes": total,
        "spare_total_bytes": sum(v["spare_bytes"] for v in ranks.values()),
        "commit_bytes": max((v["commit_bytes"] for v in ranks.values()), default=0),
        "commit_load_bytes": max(
            (d.get("commit_copy", 0) for d in (plan.get("precopy") or {}).get("per_rank", {}).values()), default=0
        ),
        "rank_expert_bytes": per_expert * slots_per_rank,
        "joiners": len(joiners),
    }


def _linear(part: dict[str, Any], x: dict[str, Any]) -> float:
    return part["intercept"] + sum(c * float(x[f]) for f, c in part["coef"].items())


def move_s(model: dict[str, Any], x: dict[str, Any]) -> float:
    """The pre-copy's predicted time for features ``x``."""
    return max(0.0, _linear(model["move"], x))


def pause_fit(model: dict[str, Any], x: dict[str, Any], capture_policy: str) -> dict[str, Any] | None:
    """The pause fit that prices ``x``: the one of its direction (a scale-up has joiners) where the
    model has one (a deployment's own fit: engine_ext.control.cost_learn), else the policy's."""
    direction = "up" if x.get("joiners") else "down"
    own = (model.get("pause_by_direction") or {}).get(capture_policy) or {}
    return own.get(direction) or model["pause"].get(capture_policy)


def pause_s(model: dict[str, Any], x: dict[str, Any], capture_policy: str) -> float | None:
    """The serving pause predicted for features ``x``, or None where no pause was fitted for the
    capture policy. The commit's moves are priced at the move's rate; its loads into slots as
    fitted where the curves had some, else at the copy rate measured beside the curves."""
    pz = pause_fit(model, x, capture_policy)
    if pz is None:
        return None
    rate = model["move"]["coef"].get("total_moved_bytes", 0.0)  # s/B
    load = 0.0 if "commit_load_bytes" in pz["coef"] else x["commit_load_bytes"] * model.get("load_s_per_byte", 0.0)
    return max(0.0, _linear(pz, x) + x.get("commit_bytes", 0) * rate + load)


def predict(
    plan: dict[str, Any],
    per_expert: int,
    slots_per_rank: int,
    capture_policy: str,
    pool: bool,
    model: dict[str, Any] | None,
    why_none: str = "",
) -> dict[str, Any]:
    """The plan's predicted cost: always bytes per rank and extra memory (the plan's own); move
    time and serving pause only from a model fitted on this host, else ``no_model`` says why."""
    x = plan_features(plan, per_expert, slots_per_rank)
    out: dict[str, Any] = {
        "per_rank": x["per_rank"],
        "moved_bytes": x["moved_bytes"],
        "commit_bytes": x["commit_bytes"],
        "rank_expert_bytes": x["rank_expert_bytes"],
        "commit_load_bytes": x["commit_load_bytes"],
        "total_moved_bytes": x["total_moved_bytes"],
        "spare_total_bytes": x["spare_total_bytes"],
        "extra_memory_bytes": max((v["spare_bytes"] for v in x["per_rank"].values()), default=0),
    }
    if model is None:
        return out | {"no_model": why_none}
    mv = model["move"]
    out["move_s"] = move_s(model, x)
    if "spread" in mv:  # (a model written before the spread was kept has none)
        out["move_range_s"] = [out["move_s"] * mv["spread"][0], out["move_s"] * mv["spread"][1]]
    out["model"] = {"path": model.get("path"), "host": model["host"], "fitted_at": model.get("fitted_at")}
    if model.get("learned"):  # the deployment's own fit (engine_ext.control.cost_learn): its number of scales
        out["model"]["learned"] = model["learned"]
    outside = [f for f, (lo, hi) in mv["range"].items() if not lo <= x[f] <= hi]
    pz = pause_fit(model, x, capture_policy)
    if pz is None:
        fitted = ", ".join(sorted(model["pause"])) or "none"
        out["pause_note"] = (
            f"no fit applies to capture policy {capture_policy}: the model has a pause fit for "
            f"{fitted} only (benchmarks/fit_cost.py fits one from curves run under {capture_policy})"
        )
    else:
        out["pause_s"] = pause_s(model, x, capture_policy)
        if "spread" in pz:
            out["pause_range_s"] = [out["pause_s"] * pz["spread"][0], out["pause_s"] * pz["spread"][1]]
        outside += [f for f, (lo, hi) in pz["range"].items() if not lo <= x[f] <= hi]
        if x["commit_bytes"]:
            out["pause_note"] = "the commit's moves priced at the pre-copy's rate (no curve point moves in the commit)"
        if pool not in pz.get("joiners_from_pool", [pool]):
            out["pause_note"] = f"fitted with joiners {'from' if not pool else 'not from'} a standby pool"
    if outside:
        out["outside_fit"] = sorted(set(outside))
    return out


def measured(op: dict[str, Any], prepared: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a real scale cost, in the prediction's terms: its serving pause, the slowest rank's
    pre-copy, per rank the bytes its pre-copy moved, the commit moved and the spare bytes held."""
    per_rank: dict[str, dict[str, int]] = {}
    for r, res in prepared.items():
        pc = res.get("precopy") or {}
        mm = (op.get("move_memory") or {}).get(r, {})
        per_rank[r] = {
            "moved_bytes": max(pc.get("bytes_received", 0), pc.get("spare_bytes", 0)) + pc.get("bytes_sent", 0),
            "commit_bytes": int(mm.get("commit_moved_bytes", 0)),
            "spare_bytes": int(mm.get("spare_bytes", pc.get("spare_bytes", 0))),
        }
    return {
        "pause_s": float(op.get("serving_pause_s", 0.0)),
        "move_s": max(((res.get("precopy") or {}).get("s", 0.0) for res in prepared.values()), default=0.0),
        "per_rank": per_rank,
        "moved_bytes": max((v["moved_bytes"] for v in per_rank.values()), default=0),
        "commit_bytes": max((v["commit_bytes"] for v in per_rank.values()), default=0),
        "extra_memory_bytes": max((v["spare_bytes"] for v in per_rank.values()), default=0),
    }


def relative_errors(predicted: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    """(predicted - measured) / measured for each figure both have and the measurement is not 0."""
    keys = ("pause_s", "move_s", "moved_bytes", "commit_bytes", "extra_memory_bytes")
    return {
        k: (float(predicted[k]) - float(got[k])) / float(got[k])
        for k in keys
        if predicted.get(k) is not None and got.get(k)
    }


def within_range(predicted: dict[str, Any], got: dict[str, Any]) -> dict[str, bool]:
    """For the pause and the move time: whether the measurement fell inside the predicted range
    (the prediction scaled by the fit's ``spread``)."""
    out = {}
    for k in ("pause_s", "move_s"):
        rng = predicted.get(k.removesuffix("_s") + "_range_s")
        if rng and got.get(k) is not None:
            out[k] = rng[0] <= float(got[k]) <= rng[1]
    return out
