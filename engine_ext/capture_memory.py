"""What each capture policy holds in MoE workspace per rank, computed without torch (eepctl's
``status`` and ``--dry-run`` read it): ``recapture`` right-sizes for the current world,
``reuse`` holds the bound at max DP from the start; ``auto`` (the default) is resolved here into
one of them for a deployment. Mirrors ``MoEModel.moe_workspace_bound`` (tests/test_capture_reuse.py
checks they agree)."""

from __future__ import annotations

from typing import Any

from engine_ext.config import CapturePolicy, EngineConfig

_ALIGN = 64
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def workspace_bytes(cfg: EngineConfig, world: int) -> int:
    """The MoE workspace bound at ``world`` ranks, the larger of the routed path's (every pair of
    every rank routed to one rank) and the gathered path's (every gathered token, captured CUDA
    steps)."""
    t = cfg.max_num_tokens
    n = world * t
    dt = _DTYPE_BYTES[cfg.dtype]
    h, k, f = cfg.hidden_size, cfg.top_k, cfg.expert_hidden
    row = 8 + -(-h * dt // 8) * 8  # engine_ext.model.routed.row_bytes
    routed = [t * k * row, n * min(k, cfg.slots_per_rank) * row, n * h * dt, n * f * dt]
    gathered = [n * h * dt, n * k * 8, n * k * dt, n * h * dt, h * dt, f * dt]
    return max(sum(_aligned(s) for s in routed), sum(_aligned(s) for s in gathered))


def policy_memory(cfg: EngineConfig, dp: int, max_dp: int, policy: str | None = None) -> dict[str, Any]:
    """Workspace bytes per rank under each policy at DP ``dp``, and what ``reuse`` costs extra."""
    policy = policy or cfg.capture_policy
    recapture = workspace_bytes(cfg, dp)
    reuse = workspace_bytes(cfg, cfg.capture_world or max_dp)
    return {
        "capture_policy": policy,
        "recapture_bytes": recapture,
        "reuse_bytes": reuse,
        "held_bytes": reuse if policy == "reuse" else recapture,
        "reuse_extra_bytes": reuse - recapture,
    }


def kv_block_bytes(cfg: EngineConfig) -> int:
    """Bytes of one KV block on a rank (every layer, K and V): ``MoEModel.kv`` per block."""
    return cfg.num_layers * cfg.block_size * 2 * cfg.hidden_size * _DTYPE_BYTES[cfg.dtype]


def kv_budget(cfg: EngineConfig, world: int) -> dict[str, int]:
    """The rank's KV + MoE-workspace budget at ``world`` ranks, as ``rank/warmup.py`` spends it:
    the budget is ``num_blocks`` blocks plus the workspace at world 1; the workspace the policy
    holds at ``world`` (``reuse``: at ``capture_world``) comes out of it, the rest is KV blocks
    (the null block excluded). ``need_blocks``: one request of ``max_model_len``."""
    block = kv_block_bytes(cfg)
    budget = cfg.num_blocks * block + workspace_bytes(cfg, 1)
    held = workspace_bytes(cfg, cfg.capture_world if cfg.capture_policy == "reuse" and cfg.capture_world else world)
    return {
        "budget_bytes": budget,
        "workspace_bytes": held,
        "block_bytes": block,
        "kv_blocks": max(0, (budget - held) // block - 1),
        "need_blocks": cfg.max_blocks_per_seq,
    }


def auto_policy(cfg: EngineConfig, max_dp: int) -> dict[str, Any]:
    """What capture policy ``auto`` takes for a deployment that may reach ``max_dp``: ``reuse``
    where the KV pool left beside reuse's workspace (sized for ``capture_world``, else max DP)
    still holds ``max_num_seqs`` requests of ``max_model_len`` on a rank, so it costs no request
    a rank would admit, only KV blocks beyond those; else ``recapture``, which re-warms and
    captures on every rank in each scale but holds the workspace of the current world only."""
    world = cfg.capture_world or max_dp
    block = kv_block_bytes(cfg)
    budget = cfg.num_blocks * block + workspace_bytes(cfg, 1)
    held = workspace_bytes(cfg, world)
    kv_blocks = max(0, (budget - held) // block - 1)
    need = cfg.max_num_seqs * cfg.max_blocks_per_seq
    return {
        "capture_policy": "reuse" if kv_blocks >= need else "recapture",
        "capture_world": world,
        "reuse_workspace_bytes": held,
        "reuse_kv_blocks": kv_blocks,
        "need_kv_blocks": need,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": cfg.max_model_len,
    }


def size_captures(cfg: EngineConfig, max_dp: int) -> dict[str, Any] | None:
    """Resolve ``auto`` in ``cfg`` (every deployment does, before any rank starts) and size reuse's
    captures for ``max_dp`` (``EngineConfig.size_captures_for``). Returns what ``auto`` weighed
    (``auto_policy``), None where the policy was given by name."""
    choice = None
    if cfg.capture_policy == "auto":
        choice = auto_policy(cfg, max_dp)
        cfg.capture_policy = CapturePolicy(choice["capture_policy"])
    cfg.size_captures_for(max_dp)
    return choice


def up_summary(cfg: EngineConfig, dp: int, max_dp: int, choice: dict[str, Any] | None) -> dict[str, Any]:
    """What a new deployment's (resolved) capture policy holds per rank at DP ``dp``, for ``up``:
    the workspace beside recapture's, the KV blocks left, how it was chosen and how to opt out."""
    mem, kv = policy_memory(cfg, dp, max_dp), kv_budget(cfg, dp)
    other = "recapture" if cfg.capture_policy == "reuse" else "reuse"
    return {
        **mem,
        "capture_world": cfg.capture_world,
        "kv_blocks": kv["kv_blocks"],
        "need_kv_blocks": cfg.max_num_seqs * cfg.max_blocks_per_seq,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": cfg.max_model_len,
        "chosen_by": "auto" if choice else "option",
        "auto": choice,
        "other": f"--capture-policy {other}",
    }


def kv_budget_error(cfg: EngineConfig, world: int) -> str | None:
    """Why a world of ``world`` ranks could serve no request of ``max_model_len`` (the MoE
    workspace leaves too few KV blocks: the world would form and every such request would wait
    forever), or None."""
    b = kv_budget(cfg, world)
    if b["kv_blocks"] >= b["need_blocks"]:
        return None
    return (
        f"at DP {world} the MoE workspace takes {b['workspace_bytes']:,} B of the rank's "
        f"{b['budget_bytes']:,} B KV budget (num_blocks {cfg.num_blocks} x {b['block_bytes']:,} B + the "
        f"workspace at DP 1), leaving {b['kv_blocks']} KV block(s); one request of max_model_len "
        f"{cfg.max_model_len} needs {b['need_blocks']}: raise num_blocks or lower expert_hidden / "
        "max_num_tokens (or capture_world under capture policy reuse)"
    )


def describe(mem: dict[str, Any]) -> str:
    """One line for status and --dry-run."""
    return (
        f"capture policy {mem['capture_policy']}: workspace {mem['held_bytes']:,} B/rank "
        f"(recapture {mem['recapture_bytes']:,} B, reuse {mem['reuse_bytes']:,} B, "
        f"reuse costs {mem['reuse_extra_bytes']:+,} B/rank)"
    )


def replica_table_width(cfg: EngineConfig) -> int:
    """Under reuse, the replica table's width at capture_world (one expert holding every
    redundant slot), so every layout fits the storage captures read; 0 under recapture."""
    if cfg.capture_policy != "reuse" or cfg.capture_world <= 0:
        return 0
    return max(1, cfg.slots_per_rank * cfg.capture_world - cfg.num_experts + 1)


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of the config's ``dtype``."""
    return _DTYPE_BYTES[dtype]
