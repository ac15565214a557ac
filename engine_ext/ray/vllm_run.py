"""One vLLM scale followed to its end, on a thread of the vLLM controller (engine_ext.ray.vllm_controller).

The scale is asked for on a thread of its own (``ask``: the POST to ``/scale_elastic_ep``, or the
autoscaler's order to the plugin in vLLM's API server), answered once vLLM's transition has ended.
Until then, or the operation's deadline, vLLM's scaling flag (``flag``: the endpoint, or the flag
the plugin publishes) and the ranks' events in the registry are followed; then what vLLM reports
is reconciled (a flag left up, each engine's fault-tolerance health) and the operation recorded.
The controller is reached only through ``RunHost``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from engine_ext.control.vllm_api import VllmApi, engine_health, error_for, fault_tolerance_health
from engine_ext.control.vllm_deployment import follow_events, phase_summary, settle_flag, workspace
from engine_ext.protocol import EepError, OpState, TransitionTimeout
from engine_ext.ray.vllm_loop import read_flag


class RunHost(Protocol):
    """What following a scale needs of the controller that runs it."""

    flag_settle_s: float  # how long vLLM may take to lower its scaling flag after it answered

    def call(self, method: str, *args: Any) -> Any:
        """A method of the deployment's registry, answered (EepError when the registry is gone)."""
        ...

    def record(self, op: dict[str, Any]) -> None:
        """Keep ``op`` as the controller's and send it to the registry."""
        ...


def run_scale(
    host: RunHost,
    op: dict[str, Any],
    api: VllmApi,
    drain: int,
    timeout_s: float,
    seq: int,
    info: dict[str, Any],
    ask: Callable[[], tuple[int, Any]] | None = None,
    flag: Callable[[], bool | None] | None = None,
) -> None:
    """Ask vLLM for the scale ``op`` on a thread, follow its flag and the ranks' events until it
    answers or the deadline passes, then reconcile and record ``op`` (updated in place)."""
    answer: dict[str, Any] = {}
    ask = ask or (lambda: api.scale(op["to_size"], drain, timeout_s))
    flag = flag or (lambda: read_flag(api))

    def post() -> None:
        try:
            answer["reply"] = ask()
        except EepError as e:
            answer["error"] = e

    poster = threading.Thread(target=post, name="eep-vllm-post", daemon=True)
    poster.start()
    events: list[dict[str, Any]] = []
    while poster.is_alive() and time.time() < op["deadline"]:
        poster.join(0.5)
        seq = follow_events(host.call, seq, events)
        if poster.is_alive() and op["phase"] != "commit" and flag():
            host.record(dict(op, phase="commit"))  # vLLM raises its flag once prepare is done
            op["phase"] = "commit"
    error: EepError | None
    if poster.is_alive():
        error = TransitionTimeout(
            f"{op['op_id']}: vLLM did not finish the scale to DP {op['to_size']} within "
            f"{timeout_s:.0f}s (the controller's deadline)"
        )
    elif "error" in answer:
        error = answer["error"]
    else:
        code, body = answer["reply"]
        error = None if code == 200 else error_for(code, body, op["to_size"], info)
    error = settle_flag(op["op_id"], flag, error, not poster.is_alive(), host.flag_settle_s)
    time.sleep(0.3)  # the ranks' last reports
    follow_events(host.call, seq, events)
    finish_scale(host, op, api, events, error)


def finish_scale(
    host: RunHost, op: dict[str, Any], api: VllmApi, events: list[dict[str, Any]], error: EepError | None
) -> None:
    """Complete ``op`` with the phases its ranks reported, the deployment after it and its end
    state (``error``: why it failed or timed out), and record it."""
    phases, captures, warmups = phase_summary(events)
    try:
        snap = host.call("snapshot")
        op["workspace_after"] = workspace(snap)
        op["rank_states"] = {str(r["rank"]): r["state"] for r in snap.get("ranks", [])}
        if (snap.get("info") or {}).get("fault_tolerance"):
            op["plan"] = dict(op["plan"], engines_after=engine_health(fault_tolerance_health(api)))
    except EepError:
        pass
    op.update(
        phase_durations=phases,
        captures_per_rank=captures,
        warmups_per_rank=warmups,
        rank_ops=sorted({ev["op_id"] for ev in events}),
        finished=time.time(),
        state=OpState.SUCCEEDED.value
        if error is None
        else OpState.TIMED_OUT.value
        if isinstance(error, TransitionTimeout)
        else OpState.FAILED.value,
    )
    if error is not None:
        op.update(error=error.message, error_code=int(error.exit_code))
    host.record(op)
