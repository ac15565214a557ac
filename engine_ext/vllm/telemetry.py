"""What the wrapped vLLM methods record in one process: phase timings, capture passes per
operation, the rank state while a step runs, and the worker's workspace and graph facts.

``VllmTelemetry`` is the sink the wrappers of ``patches`` call. It never raises into vLLM
and never talks to Ray: a worker process publishes its part through a ``WorkerChannel``
(a small JSON file and an event log beside it, on the node's local disk) that the engine-core
process of the same DP rank reads and reports; where the worker lives inside the engine-core
process (vLLM's uni executor) the reporter reads the sink directly.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_ext.records import Event, to_builtins

log = logging.getLogger("vllm.engine_ext")

STARTUP_OP = "startup"


def runtime_dir(deployment: str) -> Path:
    """Where the worker and engine-core processes of one node meet (per user, per deployment)."""
    base = os.environ.get("EEPCTL_VLLM_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(),
                                                                      f"eepctl-vllm-{os.getuid()}")
    return Path(base) / deployment


def read_workspace() -> dict[str, Any]:
    """Bytes and lock state of vLLM's MoE workspace in this process, or why there is none."""
    try:
        from vllm.v1.worker import workspace as ws
    except Exception as e:  # noqa: BLE001
        return {"workspace_available": False, "workspace_note": f"vllm.v1.worker.workspace: {type(e).__name__}"}
    try:
        if not ws.is_workspace_manager_initialized():
            return {"workspace_available": False,
                    "workspace_note": "no WorkspaceManager in this worker (vLLM's CPU worker never creates one)"}
        manager = ws.current_workspace_manager()
        buffers = list(getattr(manager, "_current_workspaces", []) or [])
        size = sum(int(manager._workspace_size_bytes(t)) for t in buffers)
        return {"workspace_available": True, "workspace_bytes": size, "workspace_locked": bool(manager.is_locked()),
                "workspace_note": ""}
    except Exception as e:  # noqa: BLE001 - private fields may move between releases
        return {"workspace_available": False, "workspace_note": f"unreadable: {type(e).__name__}: {e}"}


@dataclass
class _Op:
    op_id: str
    started: float = field(default_factory=time.time)
    ended: bool = False
    captures: int = 0
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


class VllmTelemetry:
    """The per-process sink of the wrappers. Thread-safe; ``enter``/``exit`` never raise."""

    def __init__(self, max_events: int = 2000) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self._ids = itertools.count(1)
        self._op_numbers = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._op = _Op(STARTUP_OP)
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._timings: dict[str, dict[str, float]] = {}
        self._captures_total = 0
        self._last_capture_s: float | None = None
        self._graphs_live = False
        self._worker_ref: Any = None
        self.channel: WorkerChannel | None = None
        self.updated = 0.0

    # ---- the wrappers' side ---------------------------------------------------------------
    def enter(self, spec: Any, obj: Any, args: tuple, kwargs: dict) -> int | None:
        try:
            return self._enter(spec, obj, args, kwargs)
        except Exception as e:  # noqa: BLE001 - never break vLLM
            log.debug("engine_ext: enter %s failed: %s", getattr(spec, "key", spec), e)
            return None

    def exit(self, token: int | None, error: BaseException | None) -> None:
        if token is None:
            return
        try:
            self._exit(token, error)
        except Exception as e:  # noqa: BLE001
            log.debug("engine_ext: exit failed: %s", e)

    def _depths(self) -> dict[str, int]:
        d = getattr(self._local, "depths", None)
        if d is None:
            d = self._local.depths = {"elastic": 0, "capture": 0}
        return d

    def _enter(self, spec: Any, obj: Any, args: tuple, kwargs: dict) -> int | None:
        depths = self._depths()
        worker = _worker_of(obj)
        counted = not (spec.role == "capture" and depths["capture"] > 0)  # a nested super() call
        depths[spec.role] = depths.get(spec.role, 0) + 1
        detail: dict[str, Any] = {"method": spec.key}
        with self._lock:
            if worker is not None:
                self._remember_worker(worker)
            if spec.role == "elastic":
                key = _op_key(spec, obj, args, kwargs, worker)
                op = self._op
                if op.op_id == STARTUP_OP or op.ended or (key is not None and key != op.op_id):
                    if op.op_id != STARTUP_OP and not op.ended:
                        log.warning("engine_ext: operation %s never committed; %s starts %s",
                                    op.op_id, spec.key, key or "a new one")
                    self._op = _Op(key or f"vllm-{os.getpid()}-{next(self._op_numbers)}")
                if spec.attr == "transfer_weights":
                    # I2: the EPLB communicator over the standby group exists before weights move.
                    detail["eplb_communicator_first"] = "eplb_communicator" in self._op.order
            token = next(self._ids)
            self._calls[token] = _Call(spec.key, spec.phase, spec.state, spec.role, spec.ends_op, time.time(),
                                       time.perf_counter(), self._op.op_id, worker, counted, detail)
        self._publish(force=True)
        return token

    def _exit(self, token: int, error: BaseException | None) -> None:
        depths = self._depths()
        with self._lock:
            call = self._calls.pop(token, None)
            if call is None:
                return
            depths[call.role] = max(0, depths.get(call.role, 1) - 1)
            duration = time.perf_counter() - call.t0
            end = call.start + duration
            t = self._timings.setdefault(call.key, {"calls": 0, "errors": 0, "total_s": 0.0, "last_s": 0.0})
            t["calls"] += 1
            t["total_s"] = round(t["total_s"] + duration, 6)
            t["last_s"] = round(duration, 6)
            detail = dict(call.detail, pid=os.getpid())
            if error is not None:
                t["errors"] += 1
                detail["error"] = f"{type(error).__name__}: {error}"[:300]
            op = self._op if self._op.op_id == call.op_id else None
            if op is not None:
                op.phase_s[call.phase] = round(op.phase_s.get(call.phase, 0.0) + duration, 6)
                if error is None and call.phase not in op.order:
                    op.order.append(call.phase)
            if call.role == "capture" and call.counted and error is None:
                self._captures_total += 1
                self._last_capture_s = round(duration, 6)
                self._graphs_live = True
                if op is not None:
                    op.captures += 1
                detail["capture_pass"] = op.captures if op is not None else None
            if call.phase == "release_graphs" and error is None:
                self._graphs_live = False
            if call.ends_op and op is not None and depths.get("elastic", 0) == 0:
                op.ended = True
            if call.counted:
                ev = Event(op_id=call.op_id, rank=_dp_rank(call.worker), phase=call.phase, start=call.start,
                           end=end, outcome="ok" if error is None else "error", detail=detail)
                self._events.append(to_builtins(ev))
        self._publish(force=True)

    def _remember_worker(self, worker: Any) -> None:
        import weakref

        if self._worker_ref is None or self._worker_ref() is None:
            try:
                self._worker_ref = weakref.ref(worker)
            except TypeError:
                self._worker_ref = lambda w=worker: w
            if self.channel is not None:
                self.channel.start(self)

    # ---- the reporter's side ---------------------------------------------------------------
    def worker(self) -> Any:
        return self._worker_ref() if self._worker_ref is not None else None

    def drain_events(self) -> list[dict[str, Any]]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out

    def snapshot(self) -> dict[str, Any]:
        """The worker's part of a RankStatus (plus a few extra fields the registry keeps)."""
        with self._lock:
            states = [c.state for c in sorted(self._calls.values(), key=lambda c: c.t0) if c.state]
            op = self._op
            snap: dict[str, Any] = {
                "worker_pid": os.getpid(),
                "worker_state": states[-1] if states else "",
                "current_op": op.op_id if not op.ended and op.op_id != STARTUP_OP else "",
                "last_op": op.op_id,
                "captures_this_op": op.captures,
                "op_phase_s": dict(op.phase_s),
                "captures_total": self._captures_total,
                "last_capture_s": self._last_capture_s,
                "hook_calls": {k: dict(v) for k, v in self._timings.items()},
                "updated": time.time(),
            }
            live = self._graphs_live
        worker = self.worker()
        snap.update(read_workspace())
        snap.update(_graph_facts(worker, live))
        if worker is not None:
            snap["device"] = str(getattr(worker, "device", "") or "")
            pc = _parallel_config(worker)
            if pc is not None:
                snap["worker_dp_rank"] = int(getattr(pc, "data_parallel_rank", 0) or 0)
                snap["worker_dp_size"] = int(getattr(pc, "data_parallel_size", 1) or 1)
        try:
            from engine_ext.vllm import patches

            snap["hooks"] = patches.status()
        except Exception:  # noqa: BLE001
            pass
        self.updated = snap["updated"]
        return snap

    def _publish(self, force: bool = False) -> None:
        if self.channel is not None:
            self.channel.publish(self, force=force)


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


def _graph_facts(worker: Any, live: bool) -> dict[str, Any]:
    if worker is None:
        return {}
    cfg = getattr(worker, "vllm_config", None)
    device = str(getattr(worker, "device", "") or "")
    eager = bool(getattr(getattr(cfg, "model_config", None), "enforce_eager", False))
    if not device.startswith("cuda") or eager:
        return {"graph_kind": "none", "graphs_captured": 0, "capture_sizes": []}
    sizes = list(getattr(getattr(cfg, "compilation_config", None), "cudagraph_capture_sizes", None) or [])
    return {"graph_kind": "cuda", "capture_sizes": sizes, "graphs_captured": len(sizes) if live else 0}


class WorkerChannel:
    """A worker process's telemetry for the engine core of its DP rank: ``<pid>.worker.json``
    (rewritten atomically, at every phase boundary and about once a second) and
    ``<pid>.events.jsonl`` (appended), where pid is the engine core's."""

    def __init__(self, directory: Path, owner_pid: int, interval_s: float = 1.0) -> None:
        self.directory = directory
        self.owner_pid = owner_pid
        self.interval_s = interval_s
        self._last = 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._enabled = True

    @property
    def status_path(self) -> Path:
        return self.directory / f"{self.owner_pid}.worker.json"

    @property
    def events_path(self) -> Path:
        return self.directory / f"{self.owner_pid}.events.jsonl"

    def start(self, sink: VllmTelemetry) -> None:
        """Begin the about-once-a-second refresh (workspace size changes between phases)."""
        worker = sink.worker()
        if not getattr(worker, "is_driver_worker", True):  # one worker per DP rank speaks for it
            self._enabled = False
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, args=(sink,), name="eepctl-worker-telemetry",
                                            daemon=True)
            self._thread.start()

    def _loop(self, sink: VllmTelemetry) -> None:
        while self._enabled:
            time.sleep(self.interval_s)
            self.publish(sink, force=False)

    def publish(self, sink: VllmTelemetry, force: bool = False) -> None:
        if not self._enabled or (not force and time.time() - self._last < self.interval_s * 0.5):
            return
        try:
            with self._lock:
                self.directory.mkdir(parents=True, exist_ok=True)
                events = sink.drain_events()
                if events:
                    with open(self.events_path, "a", encoding="utf-8") as f:
                        f.write("".join(json.dumps(e, default=str) + "\n" for e in events))
                snap = sink.snapshot()
                tmp = self.status_path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(snap, default=str), encoding="utf-8")
                os.replace(tmp, self.status_path)
                self._last = time.time()
        except Exception as e:  # noqa: BLE001 - a full disk must not stop serving
            log.debug("engine_ext: worker telemetry not written: %s", e)


class ChannelReader:
    """The engine core's end of ``WorkerChannel``."""

    def __init__(self, directory: Path, owner_pid: int) -> None:
        self.channel = WorkerChannel(directory, owner_pid)
        self._offset = 0

    def clear(self) -> None:
        for p in (self.channel.status_path, self.channel.events_path):
            try:
                p.unlink()
            except OSError:
                pass

    def snapshot(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.channel.status_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def new_events(self) -> list[dict[str, Any]]:
        try:
            with open(self.channel.events_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out
