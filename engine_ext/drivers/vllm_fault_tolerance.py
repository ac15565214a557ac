"""vLLM's own fault tolerance (``--enable-fault-tolerance``), read for status and driven by repair.

vLLM 0.32 keeps an engine that raised in its busy loop alive as ``unhealthy`` (or ``dead`` when
its executor failed) and waits for an instruction: ``GET /fault_tolerance/status`` lists each
engine's health, ``POST /fault_tolerance/apply {"instruction": "retry"}`` answers 202 and runs
the recovery in the background; its end shows only in the status (the engine ``healthy`` again,
or ``ft_error`` with the instruction's ``last_ft_request_id``). ``repair`` follows it to that end
and maps the outcome onto the scale exit codes. The API key goes into the header only.
"""

from __future__ import annotations

import time
from typing import Any

from engine_ext.control.vllm_api import engine_health, fault_tolerance_health, message_of
from engine_ext.control.vllm_deployment import api_for
from engine_ext.elastic.transition_plan import new_op_id
from engine_ext.protocol import (
    EepError,
    OpState,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
)

INSTRUCTION = "retry"  # the only one vLLM 0.32 accepts
HEALTHY, UNHEALTHY, DEAD = "healthy", "unhealthy", "dead"


def status(snap: dict[str, Any], *, api_key: str | None, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """vLLM's fault-tolerance status, or None when the server runs without
    ``--enable-fault-tolerance`` (``VllmApi.fault_tolerance``: its errors)."""
    return api_for(snap, api_key, timeout_s).fault_tolerance()


def health(snap: dict[str, Any], *, api_key: str | None) -> dict[str, Any] | None:
    """For `eepctl status`: the fault-tolerance status of a server that has it (None when its
    info says it has none), or ``{"error": why, "engines": []}``."""
    if not (snap.get("info") or {}).get("fault_tolerance"):
        return None
    return fault_tolerance_health(api_for(snap, api_key, timeout_s=5.0))


def repair(snap: dict[str, Any], *, api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """Apply vLLM's recovery instruction to the unhealthy engines and follow it to the end.

    Returns an operation-like record (op_id, state, from_size, to_size, engines, ...). Raises
    PreconditionError (4) without fault tolerance or for a dead engine, TransitionFailed (5)
    when vLLM reports the recovery failed, TransitionTimeout (6) past ``timeout_s``,
    UnreachableError (3) when nothing answers; the record rides in ``detail["operation"]``."""
    name = snap["deployment"]
    size = int((snap.get("info") or {}).get("dp") or max(1, len(snap.get("ranks", []))))
    before = _recoverable_status(snap, name, api_key)
    op = _operation(name, size, before)
    dead = [e for e in before["engines"] if e.get("status") == DEAD]
    if dead:
        return _finish(
            op,
            before,
            PreconditionError(
                f"engine(s) {', '.join(str(e.get('id')) for e in dead)} of {name!r} are dead: vLLM's "
                f"{INSTRUCTION!r} cannot recover them; restart the vLLM server"
            ),
        )
    if not any(e.get("status") == UNHEALTHY for e in before["engines"]):
        op["message"] = "every engine is healthy; nothing to repair"
        op["actions"] = [op["message"]]
        return _finish(op, before, None)
    api = api_for(snap, api_key, min(timeout_s, 30.0))
    code, body = api.post("/fault_tolerance/apply", {"instruction": INSTRUCTION, "params": {}})
    if code != 202:
        err: EepError = (
            UnreachableError(f"vLLM refused the API key (HTTP {code}); pass --api-key or set VLLM_API_KEY")
            if code in (401, 403)
            else TransitionFailed(f"vLLM refused {INSTRUCTION!r}: HTTP {code} {message_of(body)}")
        )
        return _finish(op, before, err)
    op["request_id"] = str(body.get("request_id", "")) if isinstance(body, dict) else ""
    return _follow(op, snap, api_key, before, timeout_s)


def _recoverable_status(snap: dict[str, Any], name: str, api_key: str | None) -> dict[str, Any]:
    """vLLM's fault-tolerance status, once nothing stands in the way of its recovery instruction:
    PreconditionError when the server is down, vLLM's scaling flag is stuck (503 to everything),
    or the server runs without fault tolerance."""
    from engine_ext.control.vllm_reconcile import repair_plan

    plan = repair_plan(snap)  # the controller's findings: a stuck flag blocks the rest (503 to everything)
    down = (((snap.get("info") or {}).get("control") or {}).get("vllm") or {}).get("server_down")
    if down:  # nothing answers any more: say what happened and the one command that brings it back
        raise PreconditionError(
            f"repair of vLLM deployment {name!r}: {down['reason']}; {down['repair']}",
            detail={"plan": plan, "server_down": down},
        )
    if plan and plan[0].startswith("vLLM's scaling flag is stuck"):
        raise PreconditionError(f"repair of vLLM deployment {name!r}: {plan[0]}", detail={"plan": plan})
    before = status(snap, api_key=api_key)
    if before is None:
        raise PreconditionError(
            f"vLLM deployment {name!r} runs without --enable-fault-tolerance: "
            "it has no recovery to apply (restart it to recover)"
        )
    return before


def _operation(name: str, size: int, before: dict[str, Any]) -> dict[str, Any]:
    """The repair's operation-like record, running."""
    return {
        "op_id": new_op_id(),
        "kind": "repair",
        "deployment": name,
        "instruction": INSTRUCTION,
        "from_size": size,
        "to_size": size,
        "state": OpState.RUNNING.value,
        "started": time.time(),
        "finished": None,
        "error": "",
        "error_code": 0,
        "request_id": "",
        "engines_before": engine_health(before),
        "engines_after": {},
    }


def _follow(
    op: dict[str, Any], snap: dict[str, Any], api_key: str | None, before: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Poll the status until the instruction ``op["request_id"]`` ends: every engine healthy, an
    engine's ``ft_error`` for it or an engine dead (TransitionFailed), or ``timeout_s`` passed
    (TransitionTimeout)."""
    name, request_id = op["deployment"], op["request_id"]
    deadline = time.time() + timeout_s
    current = before
    while time.time() < deadline:
        time.sleep(0.5)
        current = status(snap, api_key=api_key) or current
        engines = current["engines"]
        failed = [e for e in engines if e.get("ft_error") and e.get("last_ft_request_id") == request_id]
        if failed or any(e.get("status") == DEAD for e in engines):
            why = "; ".join(
                f"engine {e.get('id')}: {e.get('ft_error') or e.get('status')}"
                for e in failed or [e for e in engines if e.get("status") == DEAD]
            )
            return _finish(op, current, TransitionFailed(f"vLLM's {INSTRUCTION!r} failed on {name!r}: {why}"))
        if all(e.get("status") == HEALTHY for e in engines):
            op["actions"] = [f"applied vLLM's {INSTRUCTION!r} (request {request_id}): every engine healthy"]
            return _finish(op, current, None)
    return _finish(
        op,
        current,
        TransitionTimeout(
            f"{op['op_id']}: vLLM's {INSTRUCTION!r} did not bring every engine of {name!r} back to healthy within "
            f"{timeout_s:.0f}s (`eepctl status -n {name}`)"
        ),
    )


def _finish(op: dict[str, Any], last: dict[str, Any], error: EepError | None) -> dict[str, Any]:
    op.update(
        finished=time.time(),
        engines_after=engine_health(last),
        state=OpState.SUCCEEDED.value
        if error is None
        else OpState.TIMED_OUT.value
        if isinstance(error, TransitionTimeout)
        else OpState.FAILED.value,
    )
    if error is not None:
        op.update(error=error.message, error_code=int(error.exit_code))
        raise type(error)(error.message, detail={"operation": op})
    return op
