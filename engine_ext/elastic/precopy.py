"""What the expert pre-copy of a transition moves and holds, computed without torch.

Expert weights do not change while a deployment serves, so a transition moves them in its
prepare, while the old world serves: a joiner receives straight into its slots (placeholders
nobody serves from), a member into spare buffers, because its slots serve until the switch. A
member's spare buffers come out of its KV pool, beside one request of ``max_model_len``
(``spare_room``): the moves that do not fit there wait for the commit, which receives them (and
the local slot-to-slot copies left) into buffers carved from the idle MoE workspace and the rest
of the KV pool (``commit_room``: in the pause no step runs and no request is admitted), then
loads every buffer into its slot. This module splits the moves (``split_moves``: the plan's
``precopy.moves``, which every rank follows), says per rank how many experts and bytes each side
moves, and why a scale cannot fit even with the commit's room (``precopy_fit_error``). The rank
side (``engine_ext.rank.reshuffle``) holds exactly these bytes.
"""

from __future__ import annotations

from typing import Any

from engine_ext.capture_memory import dtype_bytes, kv_budget
from engine_ext.config import EngineConfig
from engine_ext.elastic.eplb import ExpertLayout, old_positions, plan_moves


def expert_nbytes(cfg: EngineConfig) -> int:
    """One expert's weights (w1 and w2 of every layer): what one move sends."""
    return cfg.num_layers * 2 * cfg.hidden_size * cfg.expert_hidden * dtype_bytes(cfg.dtype)


def spare_room(cfg: EngineConfig, world: int) -> int:
    """Bytes of the rank's KV budget a spare buffer may take while serving at ``world`` ranks: what
    the workspace leaves beyond the KV blocks of one request of ``max_model_len`` (and the null
    block), so the deployment keeps admitting any request while the move is held."""
    b = kv_budget(cfg, world)
    return max(0, b["budget_bytes"] - b["workspace_bytes"] - (b["need_blocks"] + 1) * b["block_bytes"])


def commit_room(cfg: EngineConfig, world: int) -> int:
    """Bytes a member may hold in the commit (its pre-copied spare buffers and the commit's own): the
    MoE workspace, idle until the re-warm after the load, and the whole KV pool (no request is
    admitted or stepped in the pause: the one-request reserve is free)."""
    b = kv_budget(cfg, world)
    return b["workspace_bytes"] + b["kv_blocks"] * b["block_bytes"]


def split_moves(
    old: ExpertLayout,
    new: ExpertLayout,
    old_world: list[int] | tuple[int, ...],
    new_world: list[int] | tuple[int, ...],
    per_expert: int,
    room: int,
) -> tuple[dict[int, dict[str, int]], list[int]]:
    """Per global rank what it sends, receives and holds, and the moves (indices into ``plan_moves``)
    the pre-copy makes. Into a joiner (new world only): every move, into its slots, nothing held. Into
    a member: received experts first, then its local moves between two of its own slots (a copy
    taken now: another move may overwrite the source slot), while their spare buffers fit ``room``;
    the rest move in the commit. Keys: send, receive, spare (held from the pre-copy to the commit),
    precopied / in_commit (experts), commit_moved (bytes received or copied in the commit),
    commit_copy (bytes loaded into slots in the commit), commit_held (held at the commit)."""
    joining = set(new_world) - set(old_world)
    keys = ("send", "receive", "spare", "precopied", "in_commit", "commit_moved", "commit_copy", "commit_held")
    out = {r: dict.fromkeys(keys, 0) for r in (*old_world, *new_world)}
    moves = plan_moves(old, new, set(range(old.world_size)), old_pos=old_positions(old_world, new_world))
    into_member: dict[int, list[tuple[bool, int]]] = {}  # dst -> (local, index), receives first
    chosen = []
    for i, m in enumerate(moves):
        src, dst = old_world[m.src_rank], new_world[m.dst_rank]
        if src == dst and m.src_slot == m.dst_slot:
            continue  # the slot keeps its expert
        if src != dst:
            out[src]["send"] += per_expert
            out[dst]["receive"] += per_expert
        if dst in joining:
            chosen.append(i)
            out[dst]["precopied"] += 1
        else:
            into_member.setdefault(dst, []).append((src == dst, i))
    for dst, items in into_member.items():
        d = out[dst]
        for _, i in sorted(items):
            if d["spare"] + per_expert <= room:
                d["spare"] += per_expert
                d["precopied"] += 1
                chosen.append(i)
            else:
                d["commit_moved"] += per_expert
                d["in_commit"] += 1
            d["commit_copy"] += per_expert
        d["commit_held"] = d["spare"] + d["commit_moved"]
    return out, sorted(chosen)


def precopy_fit_error(cfg: EngineConfig, world: int, per_rank: dict[int, dict[str, int]]) -> str | None:
    """Why some member cannot hold its moves even in the commit (``commit_room``), by how much, or None.
    What the pre-copy's room leaves out moves in the commit: that alone refuses nothing."""
    room = commit_room(cfg, world)
    over = {r: d["commit_held"] - room for r, d in per_rank.items() if d["commit_held"] > room}
    if not over:
        return None
    r = max(over, key=lambda k: over[k])
    return (
        f"the expert moves do not fit: rank {r} must hold {per_rank[r]['commit_held']:,} B of expert "
        f"buffers in the commit ({per_rank[r]['spare']:,} B pre-copied + {per_rank[r]['commit_moved']:,} B "
        f"moved in the commit), its MoE workspace + KV pool at DP {world} hold {room:,} B: short by "
        f"{over[r]:,} B"
        + (f" ({len(over)} ranks short)" if len(over) > 1 else "")
        + "; raise num_blocks or lower expert_hidden"
    )


def plan_summary(per_rank: dict[int, dict[str, int]], moves: list[int]) -> dict[str, Any]:
    """The plan's view: per rank (string keys, as JSON wants), the largest of each kind, and the
    pre-copied moves' indices (the ranks follow them)."""
    return {
        "per_rank": {str(r): d for r, d in sorted(per_rank.items())},
        "moves": moves,
        **{
            f"max_{k}_bytes": max((d[k] for d in per_rank.values()), default=0)
            for k in ("send", "receive", "spare", "commit_moved", "commit_copy")
        },
        "experts_precopied": sum(d["precopied"] for d in per_rank.values()),
        "experts_in_commit": sum(d["in_commit"] for d in per_rank.values()),
    }


def describe(summary: dict[str, Any]) -> list[str]:
    """The dry run's lines for a plan's pre-copy (``plan_summary``)."""
    lines = [
        f"expert pre-copy (in prepare, while serving): {summary.get('experts_precopied', 0)} experts, up to "
        f"{summary['max_receive_bytes']:,} B received per rank, {summary['max_spare_bytes']:,} B of spare "
        f"buffers held per rank (out of its KV pool)",
        f"moved in the commit (did not fit the pre-copy's room): {summary.get('experts_in_commit', 0)} experts, "
        f"up to {summary.get('max_commit_moved_bytes', 0):,} B per rank; "
        f"{summary['max_commit_copy_bytes']:,} B loaded into slots per rank",
    ]
    for r, d in summary.get("per_rank", {}).items():
        if d.get("in_commit"):
            lines.append(
                f"  rank {r}: {d['precopied']} pre-copied ({d['spare']:,} B), {d['in_commit']} in the "
                f"commit ({d['commit_moved']:,} B)"
            )
    if summary.get("balance_deferred"):
        lines.append(f"layout: {summary['balance_deferred']}")
    if summary.get("problem"):
        lines.append(f"WARNING: {summary['problem']}")
    return lines
