"""A vLLM deployment as its registry describes it: the API server, the size, the bounds, the wedge.

The plugin writes these facts into the registry (kind "vllm"); both the client (dry run) and the
in-cluster controller (admission, reconcile) read them through these functions. Ray- and httpx-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine_ext.control.vllm_api import VllmApi
from engine_ext.control.vllm_reconcile import prepared_dp
from engine_ext.elastic.transition_plan import new_op_id
from engine_ext.protocol import DeploymentKind, EepError, OpState, TransitionFailed, UnreachableError

KIND = DeploymentKind.VLLM.value


def api_for(snap: dict[str, Any], api_key: str | None, timeout_s: float = 10.0) -> VllmApi:
    """The API server the plugin registered for this deployment."""
    url = (snap.get("info") or {}).get("api_url")
    if not url:
        raise UnreachableError(
            f"vLLM deployment {snap['deployment']!r} has not registered an API URL "
            "(is its API server running with EEPCTL_DEPLOYMENT set?)"
        )
    return VllmApi(url, api_key, timeout_s=timeout_s)


def current_size(snap: dict[str, Any]) -> int:
    info = snap.get("info") or {}
    if info.get("dp"):
        return int(info["dp"])
    return max(1, len(snap.get("ranks", [])))


def bounds_problem(snap: dict[str, Any], target: int) -> str:
    """A bound checked before asking vLLM. For a server without elastic EP vLLM's max is just
    its current size and vLLM itself answers; its refusal is passed on."""
    info = snap.get("info") or {}
    if not info.get("elastic_ep"):
        return ""
    if info.get("max_dp") and target > int(info["max_dp"]):
        return f"target DP {target} is over the deployment's max DP {info['max_dp']} (--elastic-ep-max-dp-size)"
    if info.get("min_dp") and target < int(info["min_dp"]):
        return (
            f"target DP {target} is under DP {info['min_dp']}, the fewest ranks that hold "
            f"{info.get('num_experts')} experts at this many slots per rank"
        )
    return ""


def admission_problem(
    name: str, snap: dict[str, Any], target: int, running: dict[str, Any] | None, scaling: bool, stuck: Any
) -> str:
    """Why a scale of deployment ``name`` to ``target`` is refused before vLLM is asked, or "":
    ``running``, the operation in flight; ``scaling``, vLLM's flag (a wedge in the snapshot's info,
    or ``stuck``, the loop's finding that the flag stays up, says why); a target out of bounds."""
    if running:
        return (
            f"{running['op_id']} is running on {name!r} (DP {running['from_size']} -> "
            f"{running['to_size']}); one scale at a time"
        )
    if scaling:
        wedge = (snap.get("info") or {}).get("wedged")
        if wedge:
            return wedged_message(name, wedge)
        if stuck:
            return f"vLLM deployment {name!r}: {stuck['reason']}; {stuck['repair']}"
        return f"vLLM reports a scale of {name!r} in progress; one scale at a time"
    return bounds_problem(snap, target)


def wedged_message(name: str, wedge: dict[str, Any]) -> str:
    """One line: since when the deployment is wedged, in which phase, and the exact remedy."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(wedge.get("since") or 0)))
    what = (
        f"a scale to DP {wedge['to_size']} failed in {wedge.get('phase')}"
        if wedge.get("to_size")
        else str(wedge.get("cause") or "vLLM's scaling flag stays set")
    )
    err = f" ({wedge['error']})" if wedge.get("error") else ""
    return (
        f"vLLM deployment {name!r} is wedged since {since}: {what}{err} and vLLM kept its scaling flag set, "
        f"so it answers 503 to every request; a scale cannot clear it. Remedy: {wedge.get('remedy')}"
    )


def abandoned(op: dict[str, Any] | None) -> bool:
    """A running operation past its deadline that nobody runs any more (a client of an older
    eepctl that drove it and stopped, or a controller that died)."""
    return bool(op) and float(op.get("deadline", float("inf"))) <= time.time()


def settle_flag(
    op_id: str, flag: Callable[[], bool | None], error: EepError | None, answered: bool, settle_s: float
) -> EepError | None:
    """vLLM's scaling flag at the end of a scale (``flag``: True, False or None when unreadable).
    Still set ``settle_s`` after vLLM answered: the deployment is wedged (503 to everything),
    whatever vLLM answered. Still set at the deadline with no answer: said in the timeout's reason."""
    settle = time.time() + (settle_s if answered else 0.0)
    while flag() is True:
        if time.time() >= settle:
            why = (
                "vLLM's scaling flag is still set at the controller's deadline: it answers 503 to every "
                "request until its scale ends (or, wedged, until its API server restarts)"
                if not answered
                else f"vLLM's scaling flag is still set {settle_s:.0f}s after it answered, so it answers "
                "503 to every request (wedged; restart the vLLM API server)"
            )
            if error is None:
                return TransitionFailed(f"{op_id}: {why}")
            return type(error)(f"{error.message}; {why}")
        time.sleep(0.5)
    return error


def follow_events(call: Callable[..., Any], seq: int, events: list[dict[str, Any]]) -> int:
    """New rank events since ``seq`` appended to ``events`` (vLLM's ranks name their own operation
    ids); ``call`` is the registry's. The last seq seen."""
    try:
        data = call("events", None, seq)
    except EepError:
        return seq
    for ev in data["events"]:
        seq = max(seq, ev["seq"])
        if ev.get("rank", -1) >= 0:
            events.append(ev)
    return seq


def last_seq(call: Callable[..., Any]) -> int:
    try:
        return max((e["seq"] for e in call("events", None, 0)["events"]), default=0)
    except EepError:
        return 0


def phase_summary(events: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """The longest time any rank spent in each phase, and per rank the capture passes and the
    worker warm-up passes that ended ok (each counted where it ran: the model runner's capture,
    the worker's ``compile_or_warm_up_model``)."""
    phases: dict[str, float] = {}
    counts: dict[str, dict[str, int]] = {"capture": {}, "warmup": {}}
    for ev in events:
        phases[ev["phase"]] = max(phases.get(ev["phase"], 0.0), round(ev["end"] - ev["start"], 6))
        if ev["phase"] in counts and ev.get("outcome") == "ok":
            per_rank = counts[ev["phase"]]
            per_rank[str(ev["rank"])] = per_rank.get(str(ev["rank"]), 0) + 1
    return phases, counts["capture"], counts["warmup"]


def workspace(snap: dict[str, Any]) -> dict[str, int]:
    return {str(r["rank"]): int(r.get("workspace_bytes", 0) or 0) for r in snap.get("ranks", [])}


def new_operation(
    snap: dict[str, Any], api_url: str, target: int, timeout_s: float, request_id: str | None, controller: str
) -> dict[str, Any]:
    """A vLLM scale's record as its controller admits it (running, phase prepare)."""
    now = time.time()
    return {
        "op_id": new_op_id(),
        "deployment": snap["deployment"],
        "from_size": current_size(snap),
        "to_size": target,
        "state": OpState.RUNNING.value,
        "phase": "prepare",
        "started": now,
        "finished": None,
        "error": "",
        "error_code": 0,
        "phase_durations": {},
        "serving_pause_s": 0.0,
        "captures_per_rank": {},
        "workspace_before": workspace(snap),
        "workspace_after": {},
        "rank_states": {},
        "deadline": now + timeout_s,
        "plan": {
            "kind": "vllm",
            "api_url": api_url,
            "request_id": request_id or "",
            "controller": controller,
            # the size whose engine cores vLLM held prepared at admission: a scale-up to it is the commit alone
            "prepared_dp": prepared_dp(snap, now),
        },
    }
