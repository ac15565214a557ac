"""What a scale would do, computed before anything moves: who joins or leaves, the non-expert
weight pairs, the expert moves and the new layout. Torch-free; ``eepctl scale --dry-run``
shows it and the operation record keeps it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine_ext.elastic.eplb import ExpertLayout, build_layout, plan_moves, transfer_pairs
from engine_ext.elastic.identity import dp_suffixed


@dataclass
class ScalePlan:
    """The plan of one scale from ``from_size`` to ``to_size`` ranks."""

    op_id: str
    from_size: int
    to_size: int
    joining: list[dict[str, Any]] = field(default_factory=list)
    leaving: list[dict[str, Any]] = field(default_factory=list)
    transfer_pairs: dict[int, list[int]] = field(default_factory=dict)
    expert_moves: list[dict[str, int]] = field(default_factory=list)
    layout: dict[str, Any] = field(default_factory=dict)
    noop: bool = False
    capture_memory: dict[str, Any] = field(default_factory=dict)  # engine_ext.capture_memory.policy_memory
    precopy: dict[str, Any] = field(default_factory=dict)  # engine_ext.elastic.precopy: bytes per rank, fit
    cost: dict[str, Any] = field(default_factory=dict)  # engine_ext.control.cost_model.predict

    def to_dict(self) -> dict[str, Any]:
        return {
            "op_id": self.op_id,
            "from_size": self.from_size,
            "to_size": self.to_size,
            "noop": self.noop,
            "joining": self.joining,
            "leaving": self.leaving,
            "transfer_pairs": {str(k): v for k, v in self.transfer_pairs.items()},
            "expert_moves": self.expert_moves,
            "layout": self.layout,
            "capture_memory": self.capture_memory,
            "precopy": self.precopy,
            **({"cost": self.cost} if self.cost else {}),
        }


def plan_scale(
    op_id: str,
    identity_base: str,
    layout: ExpertLayout,
    target: int,
    loads: list[float],
    members: list[int] | None = None,
    next_rank: int | None = None,
    leaving: list[int] | None = None,
) -> ScalePlan:
    """The plan from ``layout``'s world to ``target`` ranks, re-balanced by the measured ``loads``.

    ``members`` are the current global ranks in position order (after a recovery they are not
    0..N-1) and ``next_rank`` the first joiner's: the one after the last member's, so a number
    freed by a scale-down or a death is taken again. By default no rank ever died. ``leaving``:
    the members a scale-down removes (``choose_leaving``); by default the last ones."""
    cur = layout.world_size
    plan = ScalePlan(op_id, cur, target, noop=(target == cur))
    if plan.noop:
        plan.layout = layout.to_dict()
        return plan
    members = list(range(cur)) if members is None else list(members)
    gone = set(leaving if leaving is not None and target < cur else members[target:])
    kept = [p for p, m in enumerate(members) if m not in gone]
    # Replicas stay where they were when loads tie: the kept ranks' slices, in their new positions.
    previous = (
        layout
        if target > cur
        else ExpertLayout(
            layout.num_logical, layout.slots_per_rank, target, tuple(e for p in kept for e in layout.local_logical(p))
        )
    )
    new = build_layout(layout.num_logical, layout.slots_per_rank, target, loads, previous)
    old_pos: list[int | None] = [*kept, *[None] * (target - len(kept))]  # kept ranks, then joiners
    moves = plan_moves(layout, new, set(range(cur)), old_pos=old_pos)
    first = cur if next_rank is None else next_rank
    if target > cur:
        plan.joining = [
            {"rank": r, "instance_id": dp_suffixed(identity_base, r)} for r in range(first, first + target - cur)
        ]
        plan.transfer_pairs = transfer_pairs(cur, target)
    else:
        plan.leaving = [{"rank": r, "instance_id": dp_suffixed(identity_base, r)} for r in members if r in gone]
    plan.expert_moves = [m.__dict__ for m in moves if m.src_rank != old_pos[m.dst_rank]]
    plan.layout = new.to_dict()
    return plan


def choose_leaving(
    members: list[int],
    target: int,
    load: dict[int, tuple[float, float]],
    retire: list[int] | None = None,
    keep: int | None = None,
) -> list[int]:
    """The members a scale-down to ``target`` removes, sorted.

    ``retire`` (``eepctl scale --retire``) names them: exactly as many as leave, each a member,
    ``keep`` (the store's host) not among them. Otherwise the ranks with the fewest requests, then
    the least KV in use (``load``: rank -> (requests, KV use)), leave, so the least work moves; a
    tie goes to the highest rank number (an idle deployment sheds its last ranks, as before).
    Under capture policy ``reuse`` any rank may leave too: a survivor's kept captures read its EP
    position at replay (``MoEModel.position``), so one that moves down a position routes as its
    new position. Raises ValueError saying what is wrong with ``retire``."""
    count = len(members) - target
    if retire is not None:
        if count <= 0:
            raise ValueError(f"--retire names ranks to remove, but DP {len(members)} -> {target} removes none")
        strangers = sorted(set(retire) - set(members))
        if strangers:
            raise ValueError(
                f"--retire: rank(s) {', '.join(map(str, strangers))} are not members "
                f"(members: {', '.join(map(str, members))})"
            )
        if len(set(retire)) != count:
            raise ValueError(
                f"--retire names {len(set(retire))} rank(s) but DP {len(members)} -> {target} removes {count}"
            )
        if keep in retire:
            raise ValueError(f"--retire: rank {keep} hosts the deployment's rendezvous store and stays; retire others")
        return sorted(set(retire))
    if count <= 0:
        return []
    candidates = [m for m in members if m != keep]
    ranked = sorted(candidates, key=lambda m: (load.get(m, (0.0, 0.0)), -m))
    return sorted(ranked[:count])
