"""eepctl against a vLLM deployment: vLLM's elastic-EP HTTP endpoints, and scale/plan on top.

A vLLM deployment's registry (created by the engine_ext vLLM plugin, kind "vllm") holds the
API server's URL and the DP bounds; the ranks report into it like reference ranks. vLLM runs
the transition itself: eepctl checks what it can first (single flight, bounds), posts
``/scale_elastic_ep``, follows ``/is_scaling_elastic_ep`` and the ranks' events, and maps
vLLM's answer onto the exit-code table. The API key goes into one header and nowhere else:
not into output, logs, errors, the registry or the operation record.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine_ext.protocol import (
    EepError,
    OpState,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    UsageError,
)

KIND = "vllm"

# What a `scale --dry-run` cannot learn from vLLM: it decides these inside the transition.
NOT_EXPOSED = (
    "expert moves: vLLM's EPLB computes the new placement at commit and does not publish it beforehand",
    "cluster resources for new ranks: vLLM places new engines itself (Ray placement groups) and has no dry run",
    "per-rank workspace need after the reshuffle: vLLM sizes it during warm_and_capture",
    "the drain: which requests are still running when the commit starts",
)
_NOT_ELASTIC_HINT = ("this vLLM server was not started with --enable-elastic-ep and --data-parallel-backend ray, "
                     "so it cannot change its DP size; its log has the cause")


class VllmApi:
    """The few vLLM endpoints eepctl uses. ``httpx`` is imported only here, when a command needs it."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def __repr__(self) -> str:  # never shows the key
        return f"VllmApi({self.base_url!r})"

    def post(self, path: str, payload: dict[str, Any] | None = None, timeout_s: float | None = None) -> tuple[int, Any]:
        """(HTTP status, decoded body). Raises UnreachableError when nothing answers."""
        import httpx

        try:
            resp = httpx.post(self.base_url + path, json=payload if payload is not None else {},
                              headers=self._headers, timeout=timeout_s or self.timeout_s)
        except httpx.TimeoutException:
            raise TransitionTimeout(f"vLLM at {self.base_url} did not answer {path} within "
                                    f"{timeout_s or self.timeout_s:.0f}s") from None
        except httpx.HTTPError as e:
            raise UnreachableError(f"vLLM API server at {self.base_url} is not reachable "
                                   f"({type(e).__name__})") from None
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        return resp.status_code, body

    def is_scaling(self) -> bool:
        """vLLM's own scaling flag. While it scales, vLLM's middleware answers every request,
        this one included, with 503 "currently scaling"; that counts as True."""
        code, body = self.post("/is_scaling_elastic_ep")
        if code == 200 and isinstance(body, dict):
            return bool(body.get("is_scaling_elastic_ep"))
        if code == 503:
            return True
        if code in (401, 403):
            raise UnreachableError(f"vLLM at {self.base_url} refused the API key (HTTP {code}); "
                                   "pass --api-key or set VLLM_API_KEY")
        raise TransitionFailed(f"vLLM at {self.base_url} answered /is_scaling_elastic_ep with HTTP {code}: "
                               f"{message_of(body)}")

    def scale(self, new_size: int, drain_timeout_s: int, timeout_s: float) -> tuple[int, Any]:
        return self.post("/scale_elastic_ep", {"new_data_parallel_size": new_size, "drain_timeout": drain_timeout_s},
                         timeout_s=timeout_s)


def message_of(body: Any) -> str:
    """vLLM's error text from its JSON answer (``{"error": {"message"}}`` or FastAPI's ``{"detail"}``)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if body.get("detail"):
            return str(body["detail"])
        if body.get("message"):
            return str(body["message"])
    text = str(body or "").strip()
    return " ".join(text.split())[:300] or "no message"


def error_for(code: int, body: Any, new_size: int, info: dict[str, Any]) -> EepError:
    """vLLM's answer to /scale_elastic_ep -> the documented exit code (README, docs/vllm-plugin.md)."""
    msg = message_of(body)
    head = f"vLLM refused the scale to DP {new_size}: HTTP {code} {msg}"
    if code == 400:
        low = msg.lower()
        if any(w in low for w in ("already", "cannot scale", "max-dp", "max_dp", "minimum", "in progress")):
            return PreconditionError(head)
        return UsageError(head)
    if code == 408:
        return TransitionTimeout(head)
    if code in (401, 403):
        return UnreachableError(f"vLLM refused the API key (HTTP {code}); pass --api-key or set VLLM_API_KEY")
    if code in (404, 405):
        return PreconditionError(f"this vLLM server has no /scale_elastic_ep endpoint (HTTP {code})")
    if code == 503:
        return PreconditionError(f"vLLM is already scaling (HTTP 503: {msg})")
    if code >= 500:
        hint = f" ({_NOT_ELASTIC_HINT})" if not info.get("elastic_ep") else " (see the vLLM server's log)"
        return TransitionFailed(head + hint)
    return EepError(head)


def info_if_vllm(registry: Any, get: Callable[..., Any]) -> dict[str, Any] | None:
    """The registry's snapshot when it belongs to a vLLM deployment, else None."""
    snap = get(registry.snapshot.remote(), timeout=10)
    return snap if snap.get("kind") == KIND else None


def _api(snap: dict[str, Any], api_key: str | None) -> VllmApi:
    url = (snap.get("info") or {}).get("api_url")
    if not url:
        raise UnreachableError(f"vLLM deployment {snap['deployment']!r} has not registered an API URL "
                               "(is its API server running with EEPCTL_DEPLOYMENT set?)")
    return VllmApi(url, api_key)


def _current_size(snap: dict[str, Any]) -> int:
    info = snap.get("info") or {}
    if info.get("dp"):
        return int(info["dp"])
    return max(1, len(snap.get("ranks", [])))


def _bounds_problem(snap: dict[str, Any], target: int) -> str:
    """A bound eepctl can check before asking vLLM. For a server without elastic EP vLLM's
    max is just its current size and vLLM itself answers; eepctl passes its refusal on."""
    info = snap.get("info") or {}
    if not info.get("elastic_ep"):
        return ""
    if info.get("max_dp") and target > int(info["max_dp"]):
        return f"target DP {target} is over the deployment's max DP {info['max_dp']} (--elastic-ep-max-dp-size)"
    if info.get("min_dp") and target < int(info["min_dp"]):
        return (f"target DP {target} is under DP {info['min_dp']}, the fewest ranks that hold "
                f"{info.get('num_experts')} experts at this many slots per rank")
    return ""


def _running_op(snap: dict[str, Any], registry: Any, get: Callable[..., Any]) -> dict[str, Any] | None:
    """The operation the registry holds as running; one past its deadline (the eepctl that ran it
    stopped before the end) is closed as failed so it cannot wedge the deployment."""
    op = snap.get("operation")
    if not op:
        return None
    if float(op.get("deadline", float("inf"))) > time.time():
        return op
    _record(registry, get, dict(op, state=OpState.FAILED.value, finished=time.time(), error_code=5,
                                error="abandoned: the eepctl that started it stopped before vLLM answered"))
    return None


def plan(t: Any, dp: int, registry: Any, snap: dict[str, Any], get: Callable[..., Any],
         api_key: str | None = None) -> dict[str, Any]:
    """What `scale --dry-run` can know about a vLLM deployment; nothing changes."""
    from engine_ext.elastic.eplb import transfer_pairs
    from engine_ext.elastic.identity import dp_suffixed

    cur = _current_size(snap)
    api = _api(snap, api_key)
    scaling = api.is_scaling()
    running = _running_op(snap, registry, get)
    out: dict[str, Any] = {
        "op_id": "dry-run", "kind": KIND, "deployment": t.name, "api_url": api.base_url,
        "from_size": cur, "to_size": dp, "noop": dp == cur,
        "elastic_ep": bool((snap.get("info") or {}).get("elastic_ep")),
        "joining": [{"rank": r, "instance_id": dp_suffixed(t.name, r)} for r in range(cur, dp)],
        "leaving": [{"rank": r, "instance_id": dp_suffixed(t.name, r)} for r in range(dp, cur)],
        "transfer_pairs": {str(k): v for k, v in transfer_pairs(cur, dp).items()},
        "capacity_problem": _bounds_problem(snap, dp),
        "running_op": "vLLM" if scaling else (running["op_id"] if running else ""),
        "not_exposed": list(NOT_EXPOSED),
    }
    if not out["elastic_ep"] and not out["noop"]:
        out["capacity_problem"] = _NOT_ELASTIC_HINT
    return out


def scale(t: Any, dp: int, registry: Any, snap: dict[str, Any], get: Callable[..., Any], *,
          drain_timeout_s: float, timeout_s: float, wait: bool, api_key: str | None = None,
          on_event: Callable[[dict[str, Any]], None] = lambda e: None) -> dict[str, Any]:
    """Scale a vLLM deployment through its API server and record the operation in the registry."""
    if not wait:
        raise UsageError("--no-wait is not available for a vLLM deployment: vLLM answers /scale_elastic_ep "
                         "only when the transition has ended")
    api = _api(snap, api_key)
    cur = _current_size(snap)
    running = _running_op(snap, registry, get)
    if running:
        raise PreconditionError(f"{running['op_id']} is running on {t.name!r} (DP {running['from_size']} -> "
                                f"{running['to_size']}); one scale at a time")
    if api.is_scaling():
        raise PreconditionError(f"vLLM reports a scale of {t.name!r} in progress; one scale at a time")
    problem = _bounds_problem(snap, dp)
    if problem:
        raise PreconditionError(problem)
    info = snap.get("info") or {}
    if dp == cur:  # vLLM answers 200 and does nothing; no operation to record
        code, body = api.scale(dp, max(1, int(round(drain_timeout_s))), timeout_s)
        if code != 200:
            raise error_for(code, body, dp, info)
        return {"op_id": "-", "deployment": t.name, "from_size": cur, "to_size": dp,
                "state": OpState.SUCCEEDED.value, "message": message_of(body)}
    op = {"op_id": f"op-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}", "deployment": t.name,
          "from_size": cur, "to_size": dp, "state": OpState.RUNNING.value, "phase": "prepare",
          "started": time.time(), "finished": None, "error": "", "error_code": 0, "phase_durations": {},
          "serving_pause_s": 0.0, "captures_per_rank": {}, "workspace_before": _workspace(snap),
          "workspace_after": {}, "rank_states": {}, "deadline": time.time() + timeout_s + 60,
          "plan": {"kind": KIND, "api_url": api.base_url}}
    seq = _last_seq(registry, get)
    _record(registry, get, op)
    answer: dict[str, Any] = {}

    def post() -> None:
        try:
            answer["reply"] = api.scale(dp, max(1, int(round(drain_timeout_s))), timeout_s)
        except EepError as e:
            answer["error"] = e

    worker = threading.Thread(target=post, name="eepctl-vllm-scale", daemon=True)
    worker.start()
    events: list[dict[str, Any]] = []
    deadline = time.time() + timeout_s
    while worker.is_alive() and time.time() < deadline:
        worker.join(0.5)
        seq = _follow(registry, get, seq, events, on_event)
        if worker.is_alive():
            try:
                if api.is_scaling() and op["phase"] != "commit":
                    op["phase"] = "commit"  # vLLM raises its flag once prepare is done
                    _record(registry, get, op)
            except EepError:
                pass
    if worker.is_alive():
        return _finish(registry, get, op, events, OpState.TIMED_OUT.value,
                       TransitionTimeout(f"{op['op_id']}: vLLM did not finish the scale to DP {dp} within "
                                         f"{timeout_s:.0f}s (it may still be running: `eepctl status -n {t.name}`)"))
    time.sleep(0.3)  # the ranks' last reports
    seq = _follow(registry, get, seq, events, on_event)
    if "error" in answer:
        err = answer["error"]
        state = OpState.TIMED_OUT.value if isinstance(err, TransitionTimeout) else OpState.FAILED.value
        return _finish(registry, get, op, events, state, err)
    code, body = answer["reply"]
    if code == 200:
        return _finish(registry, get, op, events, OpState.SUCCEEDED.value, None)
    err = error_for(code, body, dp, info)
    state = OpState.TIMED_OUT.value if isinstance(err, TransitionTimeout) else OpState.FAILED.value
    return _finish(registry, get, op, events, state, err)


def _workspace(snap: dict[str, Any]) -> dict[str, int]:
    return {str(r["rank"]): int(r.get("workspace_bytes", 0) or 0) for r in snap.get("ranks", [])}


def _last_seq(registry: Any, get: Callable[..., Any]) -> int:
    try:
        evs = get(registry.events.remote(None, 0), timeout=10)["events"]
        return max((e["seq"] for e in evs), default=0)
    except EepError:
        return 0


def _follow(registry: Any, get: Callable[..., Any], seq: int, events: list[dict[str, Any]],
            on_event: Callable[[dict[str, Any]], None]) -> int:
    """New rank events since ``seq`` (vLLM's ranks name their own operation ids)."""
    try:
        data = get(registry.events.remote(None, seq), timeout=10)
    except EepError:
        return seq
    for ev in data["events"]:
        seq = max(seq, ev["seq"])
        if ev.get("rank", -1) >= 0:
            events.append(ev)
            on_event(ev)
    return seq


def _record(registry: Any, get: Callable[..., Any], op: dict[str, Any]) -> None:
    try:
        get(registry.record_operation.remote(dict(op)), timeout=10)
    except EepError:
        pass


def _finish(registry: Any, get: Callable[..., Any], op: dict[str, Any], events: list[dict[str, Any]],
            state: str, error: EepError | None) -> dict[str, Any]:
    phases: dict[str, float] = {}
    captures: dict[str, int] = {}
    for ev in events:
        phases[ev["phase"]] = max(phases.get(ev["phase"], 0.0), round(ev["end"] - ev["start"], 6))
        if ev["phase"] == "capture" and ev.get("outcome") == "ok":
            captures[str(ev["rank"])] = captures.get(str(ev["rank"]), 0) + 1
    try:
        snap = get(registry.snapshot.remote(), timeout=10)
        op["workspace_after"] = _workspace(snap)
        op["rank_states"] = {str(r["rank"]): r["state"] for r in snap.get("ranks", [])}
    except EepError:
        pass
    op.update(state=state, finished=time.time(), phase_durations=phases, captures_per_rank=captures,
              rank_ops=sorted({ev["op_id"] for ev in events}))
    if error is not None:
        op.update(error=error.message, error_code=int(error.exit_code))
    _record(registry, get, op)
    if error is not None:
        raise type(error)(error.message, detail={"operation": op})
    return op
