"""What each capture policy holds in MoE workspace per rank, computed without torch (eepctl's
``status`` and ``--dry-run`` read it): ``recapture`` right-sizes for the current world,
``reuse`` holds the bound at max DP from the start. Mirrors ``MoEModel.moe_workspace_bound``
(tests/test_capture_reuse.py checks they agree)."""

from __future__ import annotations

from typing import Any

from engine_ext.config import EngineConfig

_ALIGN = 64
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def workspace_bytes(cfg: EngineConfig, world: int) -> int:
    """The MoE workspace bound at ``world`` ranks: every gathered token on one slot."""
    n = world * cfg.max_num_tokens
    dt = _DTYPE_BYTES[cfg.dtype]
    h, k, f = cfg.hidden_size, cfg.top_k, cfg.expert_hidden
    sizes = [n * h * dt, n * k * 8, n * k * dt, n * h * dt, n * h * dt, n * f * dt]
    return sum(_aligned(s) for s in sizes)


def policy_memory(cfg: EngineConfig, dp: int, max_dp: int, policy: str | None = None) -> dict[str, Any]:
    """Workspace bytes per rank under each policy at DP ``dp``, and what ``reuse`` costs extra."""
    policy = policy or cfg.capture_policy
    recapture = workspace_bytes(cfg, dp)
    reuse = workspace_bytes(cfg, cfg.capture_world or max_dp)
    return {"capture_policy": policy, "recapture_bytes": recapture, "reuse_bytes": reuse,
            "held_bytes": reuse if policy == "reuse" else recapture, "reuse_extra_bytes": reuse - recapture}


def describe(mem: dict[str, Any]) -> str:
    """One line for status and --dry-run."""
    return (f"capture policy {mem['capture_policy']}: workspace {mem['held_bytes']:,} B/rank "
            f"(recapture {mem['recapture_bytes']:,} B, reuse {mem['reuse_bytes']:,} B, "
            f"reuse costs {mem['reuse_extra_bytes']:+,} B/rank)")


def replica_table_width(cfg: EngineConfig) -> int:
    """Under reuse, the replica table's width at capture_world (one expert holding every
    redundant slot), so every layout fits the storage captures read; 0 under recapture."""
    if cfg.capture_policy != "reuse" or cfg.capture_world <= 0:
        return 0
    return max(1, cfg.slots_per_rank * cfg.capture_world - cfg.num_experts + 1)
