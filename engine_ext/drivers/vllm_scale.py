"""Driving a vLLM deployment's DP transition from outside vLLM, and recording it as an operation.

A vLLM deployment's registry (created by the plugin, kind "vllm") holds the API server's URL and
the DP bounds; the ranks report into it like reference ranks. vLLM runs the transition itself:
the driver checks what it can first (single flight, bounds), posts ``/scale_elastic_ep``,
follows ``/is_scaling_elastic_ep`` and the ranks' events, maps vLLM's answer onto the exit-code
table and writes the operation record into the registry. Clients reach it through
``drivers.vllm.VllmDriver``: they pass parameters and render what comes back; they never build or
write operation records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from engine_ext.drivers.vllm_api import NOT_ELASTIC_HINT, VllmApi, error_for, message_of
from engine_ext.elastic.transition_plan import new_op_id
from engine_ext.protocol import (
    DeploymentKind,
    EepError,
    OpState,
    PreconditionError,
    TransitionTimeout,
    UnreachableError,
)

KIND = DeploymentKind.VLLM.value

# What a `scale --dry-run` cannot learn from vLLM: it decides these inside the transition.
NOT_EXPOSED = (
    "expert moves: vLLM's EPLB computes the new placement at commit and does not publish it beforehand",
    "cluster resources for new ranks: vLLM places new engines itself (Ray placement groups) and has no dry run",
    "per-rank workspace need after the reshuffle: vLLM sizes it during warm_and_capture",
    "the drain: which requests are still running when the commit starts",
)
EventSink = Callable[[dict[str, Any]], None]


def _call(ref: Any, timeout: float = 10.0) -> Any:
    from engine_ext.ray.deployment import call

    return call(ref, timeout=timeout)


def info_if_vllm(registry: Any) -> dict[str, Any] | None:
    """The registry's snapshot when it belongs to a vLLM deployment, else None."""
    snap = _call(registry.snapshot.remote())
    return snap if snap.get("kind") == KIND else None


def api_for(snap: dict[str, Any], api_key: str | None, timeout_s: float = 10.0) -> VllmApi:
    """The API server the plugin registered for this deployment."""
    url = (snap.get("info") or {}).get("api_url")
    if not url:
        raise UnreachableError(f"vLLM deployment {snap['deployment']!r} has not registered an API URL "
                               "(is its API server running with EEPCTL_DEPLOYMENT set?)")
    return VllmApi(url, api_key, timeout_s=timeout_s)


def current_size(snap: dict[str, Any]) -> int:
    info = snap.get("info") or {}
    if info.get("dp"):
        return int(info["dp"])
    return max(1, len(snap.get("ranks", [])))


def _bounds_problem(snap: dict[str, Any], target: int) -> str:
    """A bound the driver can check before asking vLLM. For a server without elastic EP vLLM's
    max is just its current size and vLLM itself answers; its refusal is passed on."""
    info = snap.get("info") or {}
    if not info.get("elastic_ep"):
        return ""
    if info.get("max_dp") and target > int(info["max_dp"]):
        return f"target DP {target} is over the deployment's max DP {info['max_dp']} (--elastic-ep-max-dp-size)"
    if info.get("min_dp") and target < int(info["min_dp"]):
        return (f"target DP {target} is under DP {info['min_dp']}, the fewest ranks that hold "
                f"{info.get('num_experts')} experts at this many slots per rank")
    return ""


def wedged_message(name: str, wedge: dict[str, Any]) -> str:
    """One line: since when the deployment is wedged, in which phase, and the exact remedy."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(wedge.get("since") or 0)))
    what = (f"a scale to DP {wedge['to_size']} failed in {wedge.get('phase')}" if wedge.get("to_size")
            else str(wedge.get("cause") or "vLLM's scaling flag stays set"))
    err = f" ({wedge['error']})" if wedge.get("error") else ""
    return (f"vLLM deployment {name!r} is wedged since {since}: {what}{err} and vLLM kept its scaling flag set, "
            f"so it answers 503 to every request; a scale cannot clear it. Remedy: {wedge.get('remedy')}")


def _abandoned(op: dict[str, Any] | None) -> bool:
    """A running operation past its deadline: the client that drove it stopped before the end."""
    return bool(op) and float(op.get("deadline", float("inf"))) <= time.time()


def plan(snap: dict[str, Any], target: int, api_key: str | None = None) -> dict[str, Any]:
    """What `scale --dry-run` can know about a vLLM deployment. Reads only: writes nothing into
    the registry (an abandoned operation is reported, and closed by the next real scale)."""
    from engine_ext.elastic.eplb import transfer_pairs
    from engine_ext.elastic.identity import dp_suffixed

    name = snap["deployment"]
    base = (snap.get("info") or {}).get("instance_id") or name  # vLLM's own, suffixed per DP rank
    cur = current_size(snap)
    api = api_for(snap, api_key)
    scaling = api.is_scaling()
    op = snap.get("operation")
    running = op["op_id"] + (" (abandoned)" if _abandoned(op) else "") if op else ""
    out: dict[str, Any] = {
        "op_id": "dry-run", "kind": KIND, "deployment": name, "api_url": api.base_url,
        "from_size": cur, "to_size": target, "noop": target == cur,
        "elastic_ep": bool((snap.get("info") or {}).get("elastic_ep")),
        "joining": [{"rank": r, "instance_id": dp_suffixed(base, r)} for r in range(cur, target)],
        "leaving": [{"rank": r, "instance_id": dp_suffixed(base, r)} for r in range(target, cur)],
        "transfer_pairs": {str(k): v for k, v in transfer_pairs(cur, target).items()},
        "capacity_problem": _bounds_problem(snap, target),
        "running_op": "vLLM" if scaling else running,
        "not_exposed": list(NOT_EXPOSED),
    }
    if not out["elastic_ep"] and not out["noop"]:
        out["capacity_problem"] = NOT_ELASTIC_HINT
    return out


def scale(registry: Any, snap: dict[str, Any], target: int, *, drain_timeout_s: float, timeout_s: float,
          api_key: str | None = None, on_event: EventSink = lambda e: None) -> dict[str, Any]:
    """Scale a vLLM deployment to ``target`` through its API server; the finished operation
    record (also written into the registry). Raises the exit-code table's error on failure,
    with the record in ``detail["operation"]``."""
    name = snap["deployment"]
    api = api_for(snap, api_key)
    cur = current_size(snap)
    _admit(registry, snap, api, target)
    info = snap.get("info") or {}
    drain = max(1, int(round(drain_timeout_s)))
    if target == cur:  # vLLM answers 200 and does nothing; no operation to record
        code, body = api.scale(target, drain, timeout_s)
        if code != 200:
            raise error_for(code, body, target, info)
        return {"op_id": "-", "deployment": name, "from_size": cur, "to_size": target,
                "state": OpState.SUCCEEDED.value, "message": message_of(body)}
    op = {"op_id": new_op_id(), "deployment": name, "from_size": cur, "to_size": target,
          "state": OpState.RUNNING.value, "phase": "prepare", "started": time.time(), "finished": None, "error": "",
          "error_code": 0, "phase_durations": {}, "serving_pause_s": 0.0, "captures_per_rank": {},
          "workspace_before": _workspace(snap), "workspace_after": {}, "rank_states": {},
          "deadline": time.time() + timeout_s + 60, "plan": {"kind": KIND, "api_url": api.base_url}}
    seq = _last_seq(registry)
    _record(registry, op)
    return _run(registry, api, op, drain, timeout_s, seq, on_event, info)


def _admit(registry: Any, snap: dict[str, Any], api: VllmApi, target: int) -> None:
    """Refuse (PreconditionError) what the driver can see before asking vLLM: another operation,
    vLLM already scaling or wedged, a target out of bounds. An abandoned operation is closed first."""
    name = snap["deployment"]
    running = snap.get("operation")
    if _abandoned(running):  # close it so it cannot wedge the deployment
        _record(registry, dict(running, state=OpState.FAILED.value, finished=time.time(), error_code=5,
                               error="abandoned: the client that started it stopped before vLLM answered"))
        running = None
    if running:
        raise PreconditionError(f"{running['op_id']} is running on {name!r} (DP {running['from_size']} -> "
                                f"{running['to_size']}); one scale at a time")
    if api.is_scaling():
        wedge = (snap.get("info") or {}).get("wedged")
        if wedge:
            raise PreconditionError(wedged_message(name, wedge))
        raise PreconditionError(f"vLLM reports a scale of {name!r} in progress; one scale at a time")
    problem = _bounds_problem(snap, target)
    if problem:
        raise PreconditionError(problem)


def _run(registry: Any, api: VllmApi, op: dict[str, Any], drain: int, timeout_s: float, seq: int,
         on_event: EventSink, info: dict[str, Any]) -> dict[str, Any]:
    """Post the scale on a thread (vLLM answers when the transition has ended) and follow the
    ranks' events and vLLM's flag until then; the finished operation."""
    target, name = op["to_size"], op["deployment"]
    answer: dict[str, Any] = {}

    def post() -> None:
        try:
            answer["reply"] = api.scale(target, drain, timeout_s)
        except EepError as e:
            answer["error"] = e

    worker = threading.Thread(target=post, name="eep-vllm-scale", daemon=True)
    worker.start()
    events: list[dict[str, Any]] = []
    deadline = time.time() + timeout_s
    while worker.is_alive() and time.time() < deadline:
        worker.join(0.5)
        seq = _follow(registry, seq, events, on_event)
        if worker.is_alive():
            try:
                if api.is_scaling() and op["phase"] != "commit":
                    op["phase"] = "commit"  # vLLM raises its flag once prepare is done
                    _record(registry, op)
            except EepError:
                pass
    if worker.is_alive():
        return _finish(registry, op, events, OpState.TIMED_OUT.value,
                       TransitionTimeout(f"{op['op_id']}: vLLM did not finish the scale to DP {target} within "
                                         f"{timeout_s:.0f}s (it may still be running: `eepctl status -n {name}`)"))
    time.sleep(0.3)  # the ranks' last reports
    _follow(registry, seq, events, on_event)
    if "error" in answer:
        err = answer["error"]
    else:
        code, body = answer["reply"]
        err = None if code == 200 else error_for(code, body, target, info)
    state = (OpState.SUCCEEDED.value if err is None else
             OpState.TIMED_OUT.value if isinstance(err, TransitionTimeout) else OpState.FAILED.value)
    return _finish(registry, op, events, state, err)


def _workspace(snap: dict[str, Any]) -> dict[str, int]:
    return {str(r["rank"]): int(r.get("workspace_bytes", 0) or 0) for r in snap.get("ranks", [])}


def _last_seq(registry: Any) -> int:
    try:
        evs = _call(registry.events.remote(None, 0))["events"]
        return max((e["seq"] for e in evs), default=0)
    except EepError:
        return 0


def _follow(registry: Any, seq: int, events: list[dict[str, Any]], on_event: EventSink) -> int:
    """New rank events since ``seq`` (vLLM's ranks name their own operation ids)."""
    try:
        data = _call(registry.events.remote(None, seq))
    except EepError:
        return seq
    for ev in data["events"]:
        seq = max(seq, ev["seq"])
        if ev.get("rank", -1) >= 0:
            events.append(ev)
            on_event(ev)
    return seq


def _record(registry: Any, op: dict[str, Any]) -> None:
    try:
        _call(registry.record_operation.remote(dict(op)))
    except EepError:
        pass


def _finish(registry: Any, op: dict[str, Any], events: list[dict[str, Any]], state: str,
            error: EepError | None) -> dict[str, Any]:
    phases: dict[str, float] = {}
    captures: dict[str, int] = {}
    for ev in events:
        phases[ev["phase"]] = max(phases.get(ev["phase"], 0.0), round(ev["end"] - ev["start"], 6))
        if ev["phase"] == "capture" and ev.get("outcome") == "ok":
            captures[str(ev["rank"])] = captures.get(str(ev["rank"]), 0) + 1
    try:
        snap = _call(registry.snapshot.remote())
        op["workspace_after"] = _workspace(snap)
        op["rank_states"] = {str(r["rank"]): r["state"] for r in snap.get("ranks", [])}
    except EepError:
        pass
    op.update(state=state, finished=time.time(), phase_durations=phases, captures_per_rank=captures,
              rank_ops=sorted({ev["op_id"] for ev in events}))
    if error is not None:
        op.update(error=error.message, error_code=int(error.exit_code))
    _record(registry, op)
    if error is not None:
        raise type(error)(error.message, detail={"operation": op})
    return op
