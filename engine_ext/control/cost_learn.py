"""The scale cost model learned from the deployment's own scales, and which model a prediction uses.

Each finished reference-engine scale that succeeded and recorded its cost (the operation's
``cost``: the plan's features under ``predicted``, the measured pause and pre-copy under
``measured``; engine_ext.control.scale_run) becomes a point: the bytes the model prices (all
ranks' moved bytes, the bytes landing in spare buffers, the expert bytes a rank holds, the bytes
the commit loads into slots), the commit's moved bytes, the measured move time and serving pause,
the capture policy and whether the joiners came from a standby pool. Once ``MIN_SCALES`` points
moved experts the deployment has its own fit, in the shipped model's form
(engine_ext.control.cost_model): the move time by least squares over the points that moved
bytes, the serving pause per capture policy over that policy's points (the commit's moves
taken out at the fitted move's rate: the prediction adds them back), and per direction once
MIN_SCALES scale-ups or scale-downs of it are known (``pause_by_direction``), each with its
leave-one-out ``spread``. The last ``KEEP`` points are kept; the fit is made again at each new point.

``choose`` picks the model a prediction uses: the deployment's own fit, else the shipped one on
the host it was fitted on, else none, and the reason says that this host has no fit yet and how
far the learning is (``learning (N of 4 scales that moved experts measured)``). The points
persist with the deployment's durable state (``to_dict``; the Ray controller's snapshot), so a
restarted controller keeps them. Torch-free; plain Python.
"""

from __future__ import annotations

import time
from typing import Any

from engine_ext.control.cost_model import FORMAT, MOVE_FEATURES, PAUSE_FEATURES, fit_linear, host_identity, load_model

MIN_SCALES = 4  # points that moved experts before the deployment's own fit is used (the move has 3 coefficients)
KEEP = 60  # the last points kept (and persisted)
SEEN = 40  # the last operation ids learned from (each once)


def point(op: dict[str, Any], capture_policy: str) -> dict[str, Any] | None:
    """What a finished scale teaches the model, or None (not a succeeded scale, or no cost recorded)."""
    cost = op.get("cost") or {}
    pred, got = cost.get("predicted") or {}, cost.get("measured") or {}
    if op.get("kind", "scale") != "scale" or op.get("state") != "succeeded" or not pred or not got:
        return None
    if any(f not in pred for f in MOVE_FEATURES + PAUSE_FEATURES):
        return None
    joining = (op.get("plan") or {}).get("joining") or []
    return {
        **{f: int(pred[f]) for f in MOVE_FEATURES + PAUSE_FEATURES},
        "commit_bytes": int(pred.get("commit_bytes", 0)),
        "move_s": float(got.get("move_s", 0.0)),
        "pause_s": float(got.get("pause_s", 0.0)),
        "capture_policy": capture_policy,
        "pool": bool(joining) and all(j.get("from_standby") for j in joining),
        "up": int(op.get("to_size") or 0) > int(op.get("from_size") or 0),
        "op_id": str(op.get("op_id", "")),
        "at": float(op.get("finished") or time.time()),
    }


def fit_points(points: list[dict[str, Any]], host: dict[str, Any]) -> dict[str, Any] | None:
    """The model from the deployment's points (cost_model's format), or None while fewer than
    MIN_SCALES of them moved experts or they cannot be fitted."""
    moved = [p for p in points if p["total_moved_bytes"] > 0 and p["move_s"] > 0]
    move = _fit(moved, MOVE_FEATURES, "move_s")
    if move is None:
        return None
    rate = move["coef"].get("total_moved_bytes", 0.0)
    model: dict[str, Any] = {
        "format": FORMAT,
        "host": host,
        "fitted_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(max(p.get("at", 0.0) for p in points))),
        "source": [f"this deployment's own {len(points)} scale(s)"],
        "learned": len(points),
        "move": move,
        "pause": {},
        "load_s_per_byte": 0.0,  # the commit's loads are priced by the pause fit (or its intercept)
    }
    for policy in sorted({p["capture_policy"] for p in points}):
        mine = [
            p | {"pause_s": p["pause_s"] - p["commit_bytes"] * rate}
            for p in points
            if p["capture_policy"] == policy and p["pause_s"] > 0
        ]
        pz = _pause_fit(mine)
        if pz is None:
            continue
        model["pause"][policy] = pz
        by_direction = _pause_by_direction(mine)
        if by_direction:
            model.setdefault("pause_by_direction", {})[policy] = by_direction
    return model


def _pause_by_direction(mine: list[dict[str, Any]]) -> dict[str, Any]:
    """A pause fit of its own for scale-ups and for scale-downs, each once MIN_SCALES of that
    direction are known: within one deployment a rank's expert bytes hardly vary, so the policy's
    one fit is mostly an intercept between an up's pause (a joiner's rendezvous, its re-warm) and
    a down's (0.15 s against 0.06 s under ``recapture`` on the 2-core box). Points kept before the
    direction was recorded belong to neither."""
    fits = {name: _pause_fit([p for p in mine if p.get("up") is up]) for name, up in (("up", True), ("down", False))}
    return {name: pz for name, pz in fits.items() if pz is not None}


def _pause_fit(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pause fitted over ``points`` in the shipped model's form, or None (``_fit``)."""
    pz = _fit(points, PAUSE_FEATURES, "pause_s")
    return None if pz is None else pz | {"capture_sizes": [], "joiners_from_pool": sorted({p["pool"] for p in points})}


def _fit(points: list[dict[str, Any]], features: list[str], target: str) -> dict[str, Any] | None:
    """``target`` fitted over ``points``; None below MIN_SCALES points or where they fit no line."""
    if len(points) < MIN_SCALES:
        return None
    try:
        return fit_linear(points, features, target)
    except ValueError:
        return None


class LearnedCost:
    """One deployment's points and its own fit (None until MIN_SCALES scales moved experts)."""

    def __init__(
        self,
        points: list[dict[str, Any]] | None = None,
        seen: list[str] | None = None,
        host: dict[str, Any] | None = None,
    ) -> None:
        self.points: list[dict[str, Any]] = list(points or [])[-KEEP:]
        self.seen: list[str] = list(seen or [])[-SEEN:]
        self.host: dict[str, Any] = dict(host or {})  # where the points were measured (the controller's host)
        self.fit: dict[str, Any] | None = fit_points(self.points, self.host) if self.points else None

    def observe(self, op: dict[str, Any], capture_policy: str, device: str = "cpu") -> bool:
        """Learn from a finished operation (each once); whether it taught the model anything."""
        op_id = str(op.get("op_id", ""))
        p = point(op, capture_policy)
        if p is None or op_id in self.seen:
            return False
        self.seen = [*self.seen, op_id][-SEEN:]
        self.points = [*self.points, p][-KEEP:]
        self.host = host_identity(device)
        self.fit = fit_points(self.points, self.host)
        return True

    def learning(self) -> str:
        """How far the learning is, in one phrase."""
        moved = sum(1 for p in self.points if p["total_moved_bytes"] > 0 and p["move_s"] > 0)
        return f"learning ({min(moved, MIN_SCALES)} of {MIN_SCALES} scales that moved experts measured)"

    def choose(self, device: str = "cpu") -> tuple[dict[str, Any] | None, str]:
        """The model a prediction uses and, where there is none, why (one line)."""
        if self.fit is not None:
            return self.fit, ""
        shipped, why = load_model(device)
        if shipped is not None:
            return shipped, ""
        shipped_why = why.replace("no cost model fitted on this host", "the shipped model is not for this host", 1)
        return None, f"no cost model fitted on this host yet: {self.learning()}; {shipped_why}"

    def to_dict(self) -> dict[str, Any]:
        """What persists with the deployment's durable state (the fit is made again from the points)."""
        return {"points": self.points, "seen": self.seen, "host": self.host}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> LearnedCost:
        d = d or {}
        return cls(d.get("points"), d.get("seen"), d.get("host"))
