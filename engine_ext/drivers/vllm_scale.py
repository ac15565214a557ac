"""A client's side of a vLLM deployment's DP transition: the dry run, and asking for a scale.

A vLLM deployment's registry (created by the plugin, kind "vllm") holds the API server's URL and
the DP bounds; the ranks report into it like reference ranks. vLLM runs the transition itself and
the deployment's in-cluster controller (engine_ext.ray.vllm_controller) owns the operation: it
admits, posts ``/scale_elastic_ep``, follows vLLM and records. This client only asks it and
follows the record, so killing the client does not leave the operation without an owner.
Clients reach it through ``drivers.vllm.VllmDriver``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine_ext.control.vllm_api import NOT_ELASTIC_HINT
from engine_ext.control.vllm_deployment import (
    KIND,
    abandoned,
    api_for,
    bounds_problem,
    current_size,
)
from engine_ext.protocol import EepError, OpState, TransitionTimeout

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
    running = op["op_id"] + (" (abandoned)" if abandoned(op) else "") if op else ""
    out: dict[str, Any] = {
        "op_id": "dry-run",
        "kind": KIND,
        "deployment": name,
        "api_url": api.base_url,
        "from_size": cur,
        "to_size": target,
        "noop": target == cur,
        "elastic_ep": bool((snap.get("info") or {}).get("elastic_ep")),
        "joining": [{"rank": r, "instance_id": dp_suffixed(base, r)} for r in range(cur, target)],
        "leaving": [{"rank": r, "instance_id": dp_suffixed(base, r)} for r in range(target, cur)],
        "transfer_pairs": {str(k): v for k, v in transfer_pairs(cur, target).items()},
        "capacity_problem": bounds_problem(snap, target),
        "running_op": "vLLM" if scaling else running,
        "not_exposed": list(NOT_EXPOSED),
    }
    if not out["elastic_ep"] and not out["noop"]:
        out["capacity_problem"] = NOT_ELASTIC_HINT
    return out


def scale(
    registry: Any,
    snap: dict[str, Any],
    target: int,
    *,
    drain_timeout_s: float,
    timeout_s: float,
    wait: bool,
    api_key: str | None = None,
    request_id: str | None = None,
    on_event: EventSink = lambda e: None,
    on_op: EventSink = lambda o: None,
) -> dict[str, Any]:
    """Ask the deployment's in-cluster controller (engine_ext.ray.vllm_controller) to scale to
    ``target``: the accepted operation (not ``wait``) or the finished one, followed here while it
    runs there. Raises the exit-code table's error on a refusal or a failure (record in
    ``detail["operation"]``); the operation goes on, and ends, without this client."""
    from engine_ext.drivers.reference import check_outcome, raise_if_error
    from engine_ext.ray.vllm_controller import controller_for

    controller = controller_for(snap["deployment"])
    seq = _last_seq(registry)
    accepted = raise_if_error(
        _call(controller.scale.remote(target, drain_timeout_s, timeout_s, request_id, api_key), timeout=60)
    )
    if not wait or accepted["state"] != OpState.RUNNING.value:
        return accepted if not wait else check_outcome(accepted)
    op_id = accepted["op_id"]
    deadline = float(accepted.get("deadline") or time.time() + timeout_s) + 60  # the controller's own, then some
    while True:
        result = raise_if_error(_call(controller.wait_op.remote(op_id, 0.5), timeout=30))
        on_op(result)
        seq = _follow(registry, seq, on_event)
        if result["state"] != OpState.RUNNING.value:
            break
        if time.time() > deadline:
            raise TransitionTimeout(
                f"{op_id} still running after {timeout_s:.0f}s; its controller did not end it "
                f"(`eepctl events --op {op_id}`)"
            )
    _follow(registry, seq, on_event)
    return check_outcome(result)


def _last_seq(registry: Any) -> int:
    try:
        evs = _call(registry.events.remote(None, 0))["events"]
        return max((e["seq"] for e in evs), default=0)
    except EepError:
        return 0


def _follow(registry: Any, seq: int, on_event: EventSink) -> int:
    """Pass on new rank events since ``seq`` for the live display (vLLM's ranks name their own
    operation ids); the last seq seen."""
    try:
        data = _call(registry.events.remote(None, seq))
    except EepError:
        return seq
    for ev in data["events"]:
        seq = max(seq, ev["seq"])
        if ev.get("rank", -1) >= 0:
            on_event(ev)
    return seq
