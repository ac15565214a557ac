"""What the expert pre-copy of a transition moves and holds, computed without torch.

Expert weights do not change while a deployment serves, so a transition moves them in its
prepare, while the old world serves: a joiner receives straight into its slots (placeholders
nobody serves from), a member into spare buffers, because its slots serve until the switch. The
commit then only copies each member's spare buffers into the slots whose expert changes. This
module says, per rank, how many bytes that is, so the admission can refuse a pre-copy the rank's
memory budget cannot hold (``precopy_fit_error``) and the dry run can show it. The rank side
(``engine_ext.rank.reshuffle``) holds exactly these bytes.
"""

from __future__ import annotations

from typing import Any

from engine_ext.capture_memory import dtype_bytes, kv_budget
from engine_ext.config import EngineConfig
from engine_ext.elastic.eplb import ExpertLayout, plan_moves


def expert_nbytes(cfg: EngineConfig) -> int:
    """One expert's weights (w1 and w2 of every layer): what one move sends."""
    return cfg.num_layers * 2 * cfg.hidden_size * cfg.expert_hidden * dtype_bytes(cfg.dtype)


def move_bytes(old: ExpertLayout, new: ExpertLayout, old_world: list[int] | tuple[int, ...],
               new_world: list[int] | tuple[int, ...], per_expert: int) -> dict[int, dict[str, int]]:
    """Per global rank: bytes it sends, receives, holds in spare buffers during the pre-copy, and
    copies into its slots at the commit. A joiner (in the new world only) receives into its slots:
    no spare, nothing at the commit; a member holds what it receives and its local moves between
    two of its own slots (the source slot may be overwritten by another move)."""
    joining = set(new_world) - set(old_world)
    out = {r: {"send": 0, "receive": 0, "spare": 0, "commit_copy": 0} for r in (*old_world, *new_world)}
    for m in plan_moves(old, new, set(range(old.world_size))):
        src, dst = old_world[m.src_rank], new_world[m.dst_rank]
        if src == dst and m.src_slot == m.dst_slot:
            continue  # the slot keeps its expert
        if src != dst:
            out[src]["send"] += per_expert
            out[dst]["receive"] += per_expert
        if dst not in joining:
            out[dst]["spare"] += per_expert
            out[dst]["commit_copy"] += per_expert
    return out


def spare_room(cfg: EngineConfig, world: int) -> int:
    """Bytes of the rank's KV budget a spare buffer may take at ``world`` ranks: what the workspace
    leaves beyond the KV blocks of one request of ``max_model_len`` (and the null block), so the
    deployment keeps admitting any request while the move is held."""
    b = kv_budget(cfg, world)
    return max(0, b["budget_bytes"] - b["workspace_bytes"] - (b["need_blocks"] + 1) * b["block_bytes"])


def precopy_fit_error(cfg: EngineConfig, world: int, per_rank: dict[int, dict[str, int]]) -> str | None:
    """Why the pre-copy does not fit some rank's budget (KV + workspace + spare), by how much, or None."""
    room = spare_room(cfg, world)
    over = {r: d["spare"] - room for r, d in per_rank.items() if d["spare"] > room}
    if not over:
        return None
    r = max(over, key=lambda k: over[k])
    return (f"the expert pre-copy does not fit: rank {r} must hold {per_rank[r]['spare']:,} B of spare "
            f"buffers, its KV + workspace budget at DP {world} leaves {room:,} B beside one request of "
            f"max_model_len {cfg.max_model_len}: short by {over[r]:,} B"
            + (f" ({len(over)} ranks short)" if len(over) > 1 else "")
            + "; raise num_blocks or lower expert_hidden")


def plan_summary(per_rank: dict[int, dict[str, int]]) -> dict[str, Any]:
    """The plan's view: bytes per rank (string keys, as JSON wants) and the largest of each kind."""
    return {"per_rank": {str(r): d for r, d in sorted(per_rank.items())},
            **{f"max_{k}_bytes": max((d[k] for d in per_rank.values()), default=0)
               for k in ("send", "receive", "spare", "commit_copy")}}


def describe(summary: dict[str, Any]) -> list[str]:
    """The dry run's lines for a plan's pre-copy (``plan_summary``)."""
    lines = [f"expert pre-copy (in prepare, while serving): up to {summary['max_receive_bytes']:,} B received "
             f"per rank, {summary['max_spare_bytes']:,} B of spare buffers held per rank (out of its KV pool), "
             f"{summary['max_commit_copy_bytes']:,} B copied into slots in the commit"]
    if summary.get("problem"):
        lines.append(f"WARNING: {summary['problem']}")
    return lines
