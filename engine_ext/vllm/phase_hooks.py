"""Where a vLLM scale's time goes: the hooks that time the phases around vLLM's elastic-EP steps.

A scale involves three kinds of process. The API server's engine client prepares and commits it;
for a scale-up, its ``CoreEngineActorManager`` creates a placement group and an engine-core Ray
actor per new rank. An engine core (one per DP rank) imports vLLM, starts its workers, joins the
new DP group and receives the non-expert weights. Each worker (a Ray actor of its engine core)
builds its groups, constructs and loads the model, allocates the KV cache and runs the elastic
steps ``engine_ext.vllm.patches.CATALOGUE`` already times. The hooks here are catalogued the same
way (found by name, signature-checked, timed, vLLM's result untouched; docs/vllm-plugin.md), one
tuple per process that applies them. Each call becomes an Event under the operation id every rank
derives alike (``vllm-dp<new size>-<coordination store port>``): a joining rank's process start,
imports and model load land in the scale that launched it, not in ``startup``.

Nothing here runs at import; the sinks never raise into vLLM and never talk to Ray (the reporters
of engine_ext.vllm.reporter send what they collect).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine_ext.records import Event, to_builtins
from engine_ext.vllm.patches import GuardedSink, PatchSpec

STARTUP_OP = "startup"
SCALE_UP_LAUNCH_ENV = "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH"  # vLLM sets it for the engine cores a scale-up starts
_ELASTIC = "vllm.distributed.elastic_ep.elastic_execute"
_GPU_WORKER = "vllm.v1.worker.gpu_worker"
_CLIENT = "vllm.v1.engine.core_client"
_UTILS = "vllm.v1.engine.utils"
_STATE = "vllm.distributed.elastic_ep.elastic_state"

# Applied in every worker, into its VllmTelemetry (events under the worker's current operation).
WORKER_HOOKS: tuple[PatchSpec, ...] = (
    PatchSpec("vllm.v1.worker.cpu_worker", "CPUWorker", "init_device", ("self",), "groups", role="phase"),
    PatchSpec(_GPU_WORKER, "Worker", "init_device", ("self",), "groups", role="phase"),
    PatchSpec(_GPU_WORKER, "Worker", "load_model", ("self", "load_dummy_weights"), "load_model", role="phase"),
    PatchSpec(_GPU_WORKER, "Worker", "initialize_from_config", ("self", "kv_cache_config"), "kv_cache", role="phase"),
    PatchSpec(
        "vllm.distributed.elastic_ep.standby_state",
        "",
        "create_standby_groups",
        (
            "new_dp_size",
            "new_world_size_across_dp",
            "master_ip",
            "coord_store_port",
            "use_all2all",
            "enable_eplb",
            "backend",
        ),
        "groups",
        role="phase",
        kind="function",
        seen_in=_ELASTIC,
    ),
    PatchSpec(
        _ELASTIC,
        "ElasticEPScalingExecutor",
        "_warm_target_groups",
        ("self", "dp_group", "ep_group"),
        "prepare_warm_groups",
        role="phase",
    ),
)

# Applied in every engine-core process, into its PhaseSink (``engine_where``). Not a method of the
# engine-core classes themselves: Ray shadows an actor class's methods with its tracing wrappers,
# which hold vLLM's originals, before the plugin loads in that process.
ENGINE_HOOKS: tuple[PatchSpec, ...] = (
    PatchSpec(
        "vllm.v1.executor.ray_executor_v2", "RayExecutorV2", "_init_executor", ("self",), "workers", role="phase"
    ),
    PatchSpec(
        "vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "_init_executor", ("self",), "workers", role="phase"
    ),
    PatchSpec(_STATE, "ElasticEPScalingState", "run_pre_kv_init_states", ("self",), "join", role="phase"),
    PatchSpec(_STATE, "ElasticEPScalingState", "_init_new_dp_group", ("self",), "groups", role="phase"),
)

# Applied in the API server, into its PhaseSink (``api_where``).
API_HOOKS: tuple[PatchSpec, ...] = (
    PatchSpec(
        _UTILS,
        "CoreEngineActorManager",
        "add_dp_placement_groups",
        ("old_vllm_config", "new_data_parallel_size"),
        "placement",
        role="phase",
        kind="static",
    ),
    PatchSpec(
        _UTILS,
        "CoreEngineActorManager",
        "scale_up_elastic_ep",
        ("self", "cur_vllm_config", "new_data_parallel_size", "num_redundant_experts"),
        "launch",
        role="phase",
    ),
    PatchSpec(
        _CLIENT,
        "DPLBAsyncMPClient",
        "_prepare_scale_up_elastic_ep",
        ("self", "new_data_parallel_size", "num_redundant_experts"),
        "api_prepare",
        role="phase",
    ),
    PatchSpec(
        _CLIENT,
        "DPLBAsyncMPClient",
        "_prepare_scale_down_elastic_ep",
        ("self", "new_data_parallel_size"),
        "api_prepare",
        role="phase",
    ),
    PatchSpec(
        _CLIENT,
        "DPLBAsyncMPClient",
        "_commit_scale_up_elastic_ep",
        ("self", "new_data_parallel_size"),
        "api_commit",
        role="phase",
    ),
    PatchSpec(
        _CLIENT,
        "DPLBAsyncMPClient",
        "_commit_scale_down_elastic_ep",
        ("self", "new_data_parallel_size"),
        "api_commit",
        role="phase",
    ),
    PatchSpec(
        "vllm.v1.engine.async_llm",
        "AsyncLLM",
        "_drain_requests_for_elastic_ep",
        ("self", "drain_timeout"),
        "drain",
        role="phase",
    ),
)

ALL_HOOKS = WORKER_HOOKS + ENGINE_HOOKS + API_HOOKS

Where = tuple[str | None, list[int]]  # (operation id, or None for the sink's last; the ranks it concerns)


def op_id(new_size: Any, port: Any) -> str | None:
    """The id every rank of one vLLM transition derives alike (engine_ext.vllm.telemetry too)."""
    return f"vllm-dp{new_size}-{port}" if port else None


def launched_by_scale() -> bool:
    return os.environ.get(SCALE_UP_LAUNCH_ENV, "0") not in ("", "0")


def launch_op(vllm_config: Any) -> str:
    """The operation a process's start belongs to: the scale-up that launched it, else start-up."""
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is None or not launched_by_scale():
        return STARTUP_OP
    return op_id(getattr(pc, "data_parallel_size", None), getattr(pc, "_coord_store_port", None)) or STARTUP_OP


def dp_rank(vllm_config: Any) -> int:
    try:
        return int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    except (AttributeError, TypeError, ValueError):
        return 0


def process_started() -> float | None:
    """When this process was created (psutil, a vLLM dependency), or None."""
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001
        return None


def imports_event(vllm_config: Any, process: str, op: str | None = None) -> dict[str, Any] | None:
    """The ``imports`` phase of this process: from its creation to the plugin's registration (Python,
    Ray's worker start, vLLM's imports, and what vLLM ran before it loads its plugins)."""
    created = process_started()
    if created is None:
        return None
    now = time.time()
    ev = Event(
        op_id=op or launch_op(vllm_config),
        rank=dp_rank(vllm_config),
        phase="imports",
        start=min(created, now),
        end=now,
        detail={"method": "process start -> plugin", "process": process, "pid": os.getpid()},
    )
    return to_builtins(ev)


def engine_where(spec: PatchSpec, obj: Any, args: tuple, kwargs: dict) -> Where:
    """An engine core's hook: the scale the elastic state serves (``new_parallel_config``), else
    the one that launched this process; the engine's DP rank."""
    cfg = getattr(obj, "vllm_config", None)
    new_pc = getattr(obj, "new_parallel_config", None)
    if new_pc is not None:
        return op_id(getattr(new_pc, "data_parallel_size", None), getattr(new_pc, "_coord_store_port", None)), [
            dp_rank(cfg)
        ]
    return launch_op(cfg), [dp_rank(cfg)]


def api_where(spec: PatchSpec, obj: Any, args: tuple, kwargs: dict) -> Where:
    """An API-server hook, read when the call returns (vLLM opens the scale's coordination store
    inside its prepare): the new ranks for a placement or launch, else -1 (the deployment)."""
    if spec.phase in ("placement", "launch"):
        cfg = args[0] if args else kwargs.get("old_vllm_config", kwargs.get("cur_vllm_config"))
        new = args[1] if len(args) > 1 else kwargs.get("new_data_parallel_size")
        pc = getattr(cfg, "parallel_config", None)
        old = int(getattr(pc, "data_parallel_size", 0) or 0)
        return op_id(new, getattr(pc, "_coord_store_port", None)), list(range(old, int(new or old)))
    if spec.phase == "drain":  # no size in its arguments: the prepare just before it named the scale
        return None, [-1]
    new = args[0] if args else kwargs.get("new_data_parallel_size")
    pc = getattr(getattr(obj, "vllm_config", None), "parallel_config", None)
    return op_id(new, getattr(pc, "_coord_store_port", None)), [-1]


class PhaseSink(GuardedSink):
    """The per-process sink of an engine core's or the API server's hooks (``enter``/``exit``
    never raise: GuardedSink). ``where`` names a finished call's operation and ranks (one event per rank)."""

    def __init__(
        self, where: Callable[[PatchSpec, Any, tuple, dict], Where], process: str, max_events: int = 2000
    ) -> None:
        self._where = where
        self.process = process  # "engine core" or "API server": in each event's detail
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, tuple[PatchSpec, Any, tuple, dict, float, float]] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.last_op = ""
        self.calls: dict[str, dict[str, float]] = {}

    def _enter(self, spec: PatchSpec, obj: Any, args: tuple, kwargs: dict) -> int | None:
        token = next(self._ids)
        with self._lock:
            self._calls[token] = (spec, obj, args, kwargs, time.time(), time.perf_counter())
        return token

    def _exit(self, token: int, error: BaseException | None) -> None:
        with self._lock:
            spec, obj, args, kwargs, start, t0 = self._calls.pop(token)
        duration = time.perf_counter() - t0
        op, ranks = self._where(spec, obj, args, kwargs)
        detail: dict[str, Any] = {"method": spec.key, "process": self.process, "pid": os.getpid()}
        if error is not None:
            detail["error"] = f"{type(error).__name__}: {error}"[:300]
        with self._lock:
            self.last_op = op or self.last_op
            t = self.calls.setdefault(spec.key, {"calls": 0, "errors": 0, "total_s": 0.0})
            t["calls"] += 1
            t["errors"] += error is not None
            t["total_s"] = round(t["total_s"] + duration, 6)
            for rank in ranks:
                self._events.append(
                    to_builtins(
                        Event(
                            op_id=self.last_op or "vllm-unknown",
                            rank=rank,
                            phase=spec.phase,
                            start=start,
                            end=start + duration,
                            outcome="ok" if error is None else "error",
                            detail=dict(detail),
                        )
                    )
                )

    def note(self, event: dict[str, Any] | None) -> None:
        """An event timed outside a hook (a process's ``imports``)."""
        if event is not None:
            with self._lock:
                self._events.append(event)

    def drain_events(self) -> list[dict[str, Any]]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
            return out
