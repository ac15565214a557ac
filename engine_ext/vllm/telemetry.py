"""What the wrapped vLLM methods record in the worker's process: phase timings, warm-up and capture
passes (counted where they run, each capture pass with its per-size timings), the rank state
while a step runs, and the worker's workspace and graph facts.

``VllmTelemetry`` is the sink the wrappers of ``patches`` call. It never raises into vLLM and
never talks to Ray: the worker's own reporter thread (engine_ext.vllm.worker_reporter) reads it
and sends the worker's record (``record``) and events to the registry, under whatever executor
started the worker (``uni``: the engine-core process; ``mp``: a child of it; ``ray``: a Ray
actor); the registry merges that record into its rank's (engine_ext.control.worker_records).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_ext.records import Event, to_builtins
from engine_ext.vllm.patches import GuardedSink

log = logging.getLogger("vllm.engine_ext")

STARTUP_OP = "startup"


def read_workspace() -> dict[str, Any]:
    """Bytes and lock state of vLLM's MoE workspace in this process, or why there is none."""
    try:
        from vllm.v1.worker import workspace as ws
    except Exception as e:  # noqa: BLE001
        return {"workspace_available": False, "workspace_note": f"vllm.v1.worker.workspace: {type(e).__name__}"}
    try:
        if not ws.is_workspace_manager_initialized():
            return {
                "workspace_available": False,
                "workspace_note": "no WorkspaceManager in this worker (vLLM's CPU worker never creates one)",
            }
        manager = ws.current_workspace_manager()
        buffers = list(getattr(manager, "_current_workspaces", []) or [])
        size = sum(int(manager._workspace_size_bytes(t)) for t in buffers)
        return {
            "workspace_available": True,
            "workspace_bytes": size,
            "workspace_locked": bool(manager.is_locked()),
            "workspace_note": "",
        }
    except Exception as e:  # noqa: BLE001 - private fields may move between releases
        return {"workspace_available": False, "workspace_note": f"unreadable: {type(e).__name__}: {e}"}


@dataclass
class _Op:
    op_id: str
    started: float = field(default_factory=time.time)
    ended: bool = False
    captures: int = 0
    warmups: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


@dataclass
class _Call:
    key: str
    phase: str
    state: str | None
    role: str
    ends_op: bool
    start: float
    t0: float
    op_id: str
    worker: Any
    counted: bool
    detail: dict[str, Any]
    sized: bool = False  # a capture pass that counts only when the per-size wrapper saw a size
    sizes: dict[str, float] = field(default_factory=dict)  # a capture pass: seconds per captured size


class VllmTelemetry(GuardedSink):
    """The per-process sink of the wrappers. Thread-safe; ``enter``/``exit`` never raise.

    Roles (``PatchSpec.role``): "elastic" (a step of a transition), "warmup" (the worker's
    ``compile_or_warm_up_model``), "capture" (the model runner's ``capture_model``: one pass) and
    "capture_size" (one size captured inside a pass; timed, no event of its own) and "phase" (a step
    of the worker's start or of a transition, engine_ext.vllm.phase_hooks: timed under the current
    operation). A pass counts only when it captured something: vLLM's ``capture_model`` returns at
    once without graphs."""

    def __init__(self, max_events: int = 2000, startup_op: str = STARTUP_OP) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._op_numbers = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._op = _Op(startup_op)  # a worker a scale-up launched starts in that scale's operation
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._timings: dict[str, dict[str, float]] = {}
        self._captures_total = 0
        self._warmups_total = 0
        self._last_pass: tuple[float, dict[str, float]] | None = None  # (seconds, per size)
        self._last_warmup_s: float | None = None
        self._captured: list[int] = []  # the sizes of the live capture pass ([] once released)
        self._worker_ref: Any = None
        self.started = time.time()
        self.on_worker: Callable[[Any], None] | None = None  # called once, when the worker is first seen
        self.on_change: Callable[[], None] | None = None  # at every phase boundary (wakes the reporter)

    # ---- the wrappers' side (GuardedSink's enter/exit call these) --------------------------
    def _depths(self) -> dict[str, int]:
        d = getattr(self._local, "depths", None)
        if d is None:
            d = self._local.depths = {"elastic": 0, "warmup": 0, "capture": 0, "capture_size": 0}
        return d

    def _enter(self, spec: Any, obj: Any, args: tuple, kwargs: dict) -> int | None:
        depths = self._depths()
        worker = _worker_of(obj)
        counted = not (spec.role in ("warmup", "capture") and depths.get(spec.role, 0) > 0)  # nested super()
        if spec.role == "capture" and kwargs.get("profile_only"):
            counted = False  # the V2 runner's memory profile, not a capture
        depths[spec.role] = depths.get(spec.role, 0) + 1
        detail: dict[str, Any] = {"method": spec.key}
        if spec.role == "capture_size":
            detail["size"] = str(getattr(args[0] if args else kwargs.get("desc"), "num_tokens", "?"))
        first = False
        with self._lock:
            if worker is not None and spec.role != "phase":  # the reporter starts with the warm-up, not before
                first = self._remember_worker(worker)
            if spec.role == "elastic":
                self._start_op(spec, obj, args, kwargs, worker, detail)
            token = next(self._ids)
            self._calls[token] = _Call(
                spec.key,
                spec.phase,
                spec.state,
                spec.role,
                spec.ends_op,
                time.time(),
                time.perf_counter(),
                self._op.op_id,
                worker,
                counted,
                detail,
                sized=bool(getattr(spec, "sized", False)),
            )
        if first and self.on_worker is not None:
            self.on_worker(worker)
        if spec.role != "capture_size":
            self._changed()
        return token

    def _start_op(self, spec: Any, obj: Any, args: tuple, kwargs: dict, worker: Any, detail: dict[str, Any]) -> None:
        key = _op_key(spec, obj, args, kwargs, worker)
        op = self._op
        if op.op_id == STARTUP_OP or op.ended or (key is not None and key != op.op_id):
            if op.op_id != STARTUP_OP and not op.ended:
                log.warning(
                    "engine_ext: operation %s never committed; %s starts %s", op.op_id, spec.key, key or "a new one"
                )
            self._op = _Op(key or f"vllm-{os.getpid()}-{next(self._op_numbers)}")
        if spec.attr == "transfer_weights":
            # I2: the EPLB communicator over the standby group exists before weights move.
            detail["eplb_communicator_first"] = "eplb_communicator" in self._op.order

    def _exit(self, token: int, error: BaseException | None) -> None:
        depths = self._depths()
        with self._lock:
            call = self._calls.pop(token, None)
            if call is None:
                return
            depths[call.role] = max(0, depths.get(call.role, 1) - 1)
            duration = time.perf_counter() - call.t0
            t = self._timings.setdefault(call.key, {"calls": 0, "errors": 0, "total_s": 0.0, "last_s": 0.0})
            t["calls"] += 1
            t["total_s"] = round(t["total_s"] + duration, 6)
            t["last_s"] = round(duration, 6)
            detail = dict(call.detail, pid=os.getpid())
            if error is not None:
                t["errors"] += 1
                detail["error"] = f"{type(error).__name__}: {error}"[:300]
            if call.role == "capture_size":
                self._size_done(call, duration, error)
                return
            op = self._op if self._op.op_id == call.op_id else None
            if op is not None:
                op.phase_s[call.phase] = round(op.phase_s.get(call.phase, 0.0) + duration, 6)
                if error is None and call.phase not in op.order:
                    op.order.append(call.phase)
            emit = call.counted and self._pass_done(call, op, duration, error, detail)
            if call.phase == "release_graphs" and error is None:
                self._captured = []
            if call.ends_op and op is not None and depths.get("elastic", 0) == 0:
                op.ended = True
            if emit:
                rank = _dp_rank(call.worker or self.worker())  # a module function's call: the worker seen before
                ev = Event(
                    op_id=call.op_id,
                    rank=rank,
                    phase=call.phase,
                    start=call.start,
                    end=call.start + duration,
                    outcome="ok" if error is None else "error",
                    detail=detail,
                )
                self._events.append(to_builtins(ev))
        self._changed()

    def _size_done(self, call: _Call, duration: float, error: BaseException | None) -> None:
        """One size captured: its seconds go to the capture pass running in this thread."""
        outer = next(
            (c for c in sorted(self._calls.values(), key=lambda c: -c.t0) if c.role == "capture" and c.counted), None
        )
        if outer is not None and error is None:
            size = call.detail.get("size", "?")
            outer.sizes[size] = round(outer.sizes.get(size, 0.0) + duration, 6)

    def _pass_done(
        self, call: _Call, op: _Op | None, duration: float, error: BaseException | None, detail: dict[str, Any]
    ) -> bool:
        """Count a finished warm-up or capture pass; False for a capture pass that captured nothing."""
        if call.role == "warmup" and error is None:
            self._warmups_total += 1
            self._last_warmup_s = round(duration, 6)
            if op is not None:
                op.warmups += 1
            detail["warmup_pass"] = op.warmups if op is not None else None
        if call.role != "capture":
            return True
        if call.sized and not call.sizes and error is None:
            return False  # vLLM's capture_model returned without capturing (cudagraph mode NONE)
        if error is None:
            self._captures_total += 1
            self._last_pass = (round(duration, 6), dict(call.sizes))
            self._captured = sorted(int(s) for s in call.sizes if s.isdigit())
            if op is not None:
                op.captures += 1
            detail["capture_pass"] = op.captures if op is not None else None
        detail["sizes_s"] = dict(call.sizes)
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _remember_worker(self, worker: Any) -> bool:
        import weakref

        if self._worker_ref is not None and self._worker_ref() is not None:
            return False
        try:
            self._worker_ref = weakref.ref(worker)
        except TypeError:
            self._worker_ref = lambda w=worker: w
        return True

    def note(self, event: dict[str, Any] | None) -> None:
        """An event timed outside a hook (the worker process's ``imports``)."""
        if event is not None:
            with self._lock:
                self._events.append(event)

    # ---- the reporter's side ---------------------------------------------------------------
    def worker(self) -> Any:
        return self._worker_ref() if self._worker_ref is not None else None

    def drain_events(self) -> list[dict[str, Any]]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def snapshot(self) -> dict[str, Any]:
        """The worker's part of its rank's record: every VllmWorkerStatus field but the
        identity ones the reporter adds (engine_ext.vllm.worker_reporter)."""
        with self._lock:
            states = [c.state for c in sorted(self._calls.values(), key=lambda c: c.t0) if c.state]
            op = self._op
            pass_s, sizes = self._last_pass or (None, {})
            snap: dict[str, Any] = {
                "pid": os.getpid(),
                "state": states[-1] if states else "",
                "current_op": op.op_id if not op.ended and op.op_id != STARTUP_OP else "",
                "last_op": op.op_id,
                "captures_this_op": op.captures,
                "warmups_this_op": op.warmups,
                "op_phase_s": dict(op.phase_s),
                "captures_total": self._captures_total,
                "warmups_total": self._warmups_total,
                "last_capture_pass_s": pass_s,
                "capture_times_s": dict(sizes),
                "last_warmup_s": self._last_warmup_s,
                "hook_calls": {k: dict(v) for k, v in self._timings.items()},
                "started": self.started,
                "last_heartbeat": time.time(),
            }
            captured = list(self._captured)
        worker = self.worker()
        snap.update(read_workspace())
        snap.update(_graph_facts(worker, captured))
        if worker is not None:
            snap["device"] = str(getattr(worker, "device", "") or "")
            pc = _parallel_config(worker)
            if pc is not None:
                snap["rank"] = int(getattr(pc, "data_parallel_rank", 0) or 0)
                snap["dp_size"] = int(getattr(pc, "data_parallel_size", 1) or 1)
        try:
            from engine_ext.vllm import patches

            snap["hooks"] = patches.status()
        except Exception:  # noqa: BLE001
            pass
        return snap


def _worker_of(obj: Any) -> Any:
    """The vLLM worker behind a wrapped call: the executor's weakly held worker, or obj itself."""
    ref = getattr(obj, "worker_ref", None)
    if callable(ref):
        try:
            return ref()
        except Exception:  # noqa: BLE001
            return None
    return obj if hasattr(obj, "vllm_config") else None


def _parallel_config(worker: Any) -> Any:
    cfg = getattr(worker, "vllm_config", None)
    return getattr(cfg, "parallel_config", None) if cfg is not None else None


def _dp_rank(worker: Any) -> int:
    pc = _parallel_config(worker)
    try:
        return int(getattr(pc, "data_parallel_rank", 0) or 0) if pc is not None else 0
    except (TypeError, ValueError):
        return 0


def _op_key(spec: Any, obj: Any, args: tuple, kwargs: dict, worker: Any) -> str | None:
    """An operation id every rank of one vLLM transition derives alike: the target size and the
    port of the coordination store vLLM opens for that transition."""
    req = args[0] if spec.attr == "prepare_reconfiguration" and args else getattr(obj, "reconfig_request", None)
    pc = _parallel_config(worker)
    new = port = None
    if req is not None:
        new, port = getattr(req, "new_data_parallel_size", None), getattr(req, "coord_store_port", None)
    elif pc is not None:
        new, port = getattr(pc, "data_parallel_size", None), getattr(pc, "_coord_store_port", None)
    if spec.attr == "commit_scale_down":
        new = args[0] if args else kwargs.get("new_dp_size", new)
    return f"vllm-dp{new}-{port}" if port else None


def _graph_facts(worker: Any, captured: list[int]) -> dict[str, Any]:
    """Graph kind, the sizes the config captures, and the sizes the live capture pass captured
    (measured by the per-size wrapper; none on CPU or with --enforce-eager)."""
    if worker is None:
        return {}
    cfg = getattr(worker, "vllm_config", None)
    device = str(getattr(worker, "device", "") or "")
    eager = bool(getattr(getattr(cfg, "model_config", None), "enforce_eager", False))
    if not captured and (not device.startswith("cuda") or eager):
        return {"graph_kind": "none", "graphs_captured": 0, "capture_sizes": [], "capture_sizes_expected": []}
    expected = list(getattr(getattr(cfg, "compilation_config", None), "cudagraph_capture_sizes", None) or [])
    return {
        "graph_kind": "cuda",
        "capture_sizes": captured,
        "graphs_captured": len(captured),
        "capture_sizes_expected": expected,
    }
