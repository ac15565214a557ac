"""Status lines for the control plane: what the reconcile loop works on, unhealthy and fenced
ranks with why, the controller's restarts and the last reconcile error with its age. Pure:
data in, text out (the controller keeps the view in the registry's info as ``control``)."""

from __future__ import annotations

import time
from typing import Any

FENCED_SHOWN_S = 60.0  # a fence is shown this long, then while its rank number does not serve (fence_matters)
SUSPICION_SHOWN_S = 300.0  # how the last suspicion of the observer ended is shown this long (JSON: always)


def control_lines(snap: dict[str, Any], now: float | None = None) -> list[str]:
    control = (snap.get("info") or {}).get("control") or {}
    if not control:
        return []
    now = time.time() if now is None else now
    lines: list[str] = []
    pool_error = ((snap.get("info") or {}).get("standby_pool") or {}).get("last_error")
    if pool_error:
        lines.append(
            f"standby pool short: launching standby {pool_error.get('standby')} failed "
            f"{_ago(now, pool_error.get('at'))}: {pool_error.get('error')} (tried again every 10s)"
        )
    if control.get("controller_restarts"):
        lines.append(
            f"controller restarted {control['controller_restarts']} time(s); "
            f"took over: {'; '.join(control.get('took_over') or []) or 'nothing to do'}"
        )
    if control.get("working_on"):
        lines.append(f"reconciling: {control['working_on']}")
    lines += suspicion_lines(control, now)
    for rank, h in sorted((control.get("health") or {}).items(), key=lambda kv: int(kv[0])):
        if h.get("unhealthy"):
            lines.append(f"rank {rank} unhealthy: {h['unhealthy']}")
    for rank, f in sorted((control.get("fenced") or {}).items(), key=lambda kv: int(kv[0])):
        if fence_matters(int(rank), f, snap, now):
            lines.append(f"rank {rank} fenced at epoch {f.get('epoch')} {_ago(now, f.get('at'))}: {f.get('reason')}")
    if control.get("parked_requests"):
        lines.append(f"{control['parked_requests']} request(s) waiting for a healthy world")
    err = control.get("last_error")
    if err:
        lines.append(
            f"last reconcile error {_ago(now, err.get('at'))} in {err.get('action')}: {err.get('error')}"
            + _retry_in(control, now)
        )
    esc = control.get("escalated")
    if esc:
        lines.append(
            f"ESCALATED: {esc.get('action')} failed the same way {esc.get('attempts')} times in a row: "
            f"{esc.get('cause')}"
        )
        lines += [f"  tried {t}" for t in esc.get("tried") or []]
        lines.append(f"  operator: {esc.get('operator')}")
    return lines


def suspicion_lines(control: dict[str, Any], now: float) -> list[str]:
    """The health check suspecting itself (most ranks silent together): now, or how the last
    suspicion ended, for SUSPICION_SHOWN_S after it did."""
    cur, last = control.get("suspicion"), control.get("last_suspicion")
    if cur:
        return [
            f"health: suspecting the observer: {len(cur['silent'])} of {cur['members']} ranks silent "
            f"{cur['silent_s']:.1f}s while alive; controller tick lag {cur['lag_s']:.1f}s{_load(cur)}; "
            f"deadline extended to {cur['extended_s']:g}s"
        ]
    if last and now - float(last.get("ended") or 0.0) <= SUSPICION_SHOWN_S:
        fenced = (
            f"fenced rank(s) {', '.join(map(str, last['fenced']))} (no answer to a second probe)"
            if last.get("fenced")
            else "fenced none"
        )
        return [
            f"health: suspected the observer {_ago(now, last.get('ended'))} for "
            f"{float(last['ended']) - float(last['since']):.0f}s ({len(last['silent'])} of {last['members']} "
            f"ranks silent up to {last['longest_s']:.1f}s while alive; deadline extended to "
            f"{last['extended_s']:g}s); {fenced}"
        ]
    return []


def _load(s: dict[str, Any]) -> str:
    return f"; host load {s['load']:.1f} on {s['cores']} cores" if s.get("load") is not None else ""


def fence_matters(rank: int, fence: dict[str, Any], snap: dict[str, Any], now: float) -> bool:
    """Whether status still shows a fence: for FENCED_SHOWN_S after it, then while a rank of its
    number is listed and not serving (neither it nor a replacement serves yet). `eepctl events`
    lists every fence."""
    if now - float(fence.get("at", 0.0)) <= FENCED_SHOWN_S:
        return True
    return any(r.get("rank") == rank and r.get("state") not in ("serving", "standby") for r in snap.get("ranks", []))


def ingress_lines(snap: dict[str, Any]) -> list[str]:
    """Where requests enter (each ingress's HTTP URL), with what it holds when it holds some, why
    its port changed or why it does not listen, and whether anyone can send requests."""
    lines = []
    for ing in (snap.get("info") or {}).get("ingress") or []:
        held = [f"{ing[k]} {k}" for k in ("inflight", "parked") if ing.get(k)]
        where = ing.get("url") or (
            f"not listening: {ing['listen_error']} (trying again every second)"
            if ing.get("listen_error")
            else "starting"
        )
        lines.append(
            f"ingress {ing.get('index')}: {where}"
            + (f" ({', '.join(held)})" if held else "")
            + (" (restarted by Ray)" if ing.get("restarted") else "")
            + (f" ({ing['note']})" if ing.get("note") else "")
            + exposure(ing)
        )
    return lines


def api_lines(ingresses: list[dict[str, Any]]) -> list[str]:
    """`up`'s lines for the HTTP API: each ingress's URL, where it listens, and its key."""
    return [
        f"  API: {ing.get('url')} (ingress {ing.get('index')}, listening on {ing.get('listen')})"
        + (exposure(ing) or "; a key is required (Authorization: Bearer KEY)")
        for ing in ingresses
    ]


def exposure(ing: dict[str, Any]) -> str:
    """ ", no key: ..." for an ingress whose API takes requests without a key ("" otherwise, and
    for an ingress that does not say)."""
    if ing.get("key_required") is not False:
        return ""
    local = str(ing.get("listen") or "").startswith("127.")
    return f", no key: {'anyone on its node' if local else 'anyone who reaches the port'} can send requests"


def _retry_in(control: dict[str, Any], now: float) -> str:
    """When the loop tries again: ``retry_at`` (absolute), or an older controller's ``backoff_s``."""
    left = float(control["retry_at"]) - now if control.get("retry_at") else float(control.get("backoff_s") or 0.0)
    return f" (retry in {left:.0f}s)" if left > 0.5 else ""


def _ago(now: float, at: Any) -> str:
    try:
        return f"{max(0.0, now - float(at)):.0f}s ago"
    except (TypeError, ValueError):
        return "at an unknown time"
