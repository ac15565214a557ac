"""The expert reshuffle a transition's commit and a recovery both run: expert weights move into
the operation's new layout over its EPLB communicator.

Moves go from the weight storage to the weight storage, one message per layer and matrix: a
slot's ``w1[l, s]`` / ``w2[l, s]`` are contiguous views, so nothing is concatenated, no receive
buffer is allocated (a fresh one costs a page fault per 4 KiB before a byte lands) and nothing is
copied after. Only a slot that is both read (a source) and overwritten in this reshuffle is
snapshotted first. A reshuffle that fails half way leaves some slots written: the controller then
treats the survivors' experts as untrusted (``TransitionPlan.untrusted``) and restores them from
the weight source.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_ext.elastic.eplb import ExpertMove, plan_moves
from engine_ext.elastic.weight_source import WeightSource
from engine_ext.rank.operation import OpState, comm_members
from engine_ext.rank.shared import RankResources, RankShared

TAG_BASE = 1000  # dense transfers use 100 + position; each expert move i uses TAG_BASE + i * parts + j


class ExpertReshuffle:
    """Moves expert weights into an operation's new layout over its EPLB communicator; experts
    whose every copy died come from the weight source (a checkpoint loader in production)."""

    def __init__(self, res: RankResources, shared: RankShared, weight_source: WeightSource) -> None:
        self.res = res
        self.shared = shared
        self.weight_source = weight_source

    def run(self, op: OpState) -> dict[str, Any]:
        """This rank's sends, receives, local copies and restores of ``op``'s expert moves."""
        plan, model, me = op.plan, self.res.model, self.shared.rank
        old_w, new_w = plan.old_world, plan.new_world
        alive = {p for p, m in enumerate(old_w)
                 if plan.kind != "recover" or (m in new_w and m not in plan.untrusted)}
        moves = plan_moves(plan.old_layout, plan.new_layout, alive, missing_ok=plan.kind == "recover")
        comm = op.eplb_comm
        assert comm is not None
        comm_world = comm_members(plan)

        sends: list[tuple[int, ExpertMove]] = []
        recvs: list[tuple[int, ExpertMove]] = []
        local: list[ExpertMove] = []
        restored: list[ExpertMove] = []
        for i, m in enumerate(moves):
            src_g = old_w[m.src_rank] if m.src_rank >= 0 else -1
            dst_g = new_w[m.dst_rank]
            if m.from_weight_source and dst_g == me:
                restored.append(m)
            elif src_g == me and dst_g == me:
                local.append(m)
            elif src_g == me:
                sends.append((i, m))
            elif dst_g == me and src_g >= 0:
                recvs.append((i, m))
        # Sources read while the same exchange (or a local copy) overwrites them are snapshotted.
        written = {m.dst_slot for m in local + restored} | {m.dst_slot for _, m in recvs}
        read = {m.src_slot for m in local} | {m.src_slot for _, m in sends}
        snap = {s: [t.clone() for t in model.expert_parts(s)] for s in sorted(read & written)}

        def source(slot: int) -> list[torch.Tensor]:
            return snap[slot] if slot in snap else model.expert_parts(slot)

        parts = len(model.expert_parts(0))
        send_msgs = [(t, comm_world.index(new_w[m.dst_rank]), TAG_BASE + i * parts + j)
                     for i, m in sends for j, t in enumerate(source(m.src_slot))]
        recv_msgs = [(t, comm_world.index(old_w[m.src_rank]), TAG_BASE + i * parts + j)
                     for i, m in recvs for j, t in enumerate(model.expert_parts(m.dst_slot))]
        comm.exchange(send_msgs, recv_msgs)
        for m in local:
            for dst, src in zip(model.expert_parts(m.dst_slot), source(m.src_slot)):
                dst.copy_(src)
        for m in restored if not self.res.faults.active("no_weight_source_restore") else []:
            model.load_expert_vector(m.dst_slot, self.from_weight_source(m.logical))
        assert self.res.cfg.slots_per_rank == plan.new_layout.slots_per_rank
        nbytes = lambda msgs: sum(t.numel() * t.element_size() for t, _, _ in msgs)  # noqa: E731
        return {"moves_total": len(moves), "sent": len(sends), "received": len(recvs), "local": len(local),
                "bytes_sent": nbytes(send_msgs), "bytes_received": nbytes(recv_msgs), "snapshotted_slots": len(snap),
                "restored_from_weight_source": sorted({m.logical for m in restored})}

    def from_weight_source(self, logical: int) -> torch.Tensor:
        """One expert's (w1, w2) of every layer, flattened as ``load_expert_vector`` wants it."""
        pairs = [self.weight_source.expert(layer, logical) for layer in range(self.res.cfg.num_layers)]
        w1 = torch.stack([a for a, _ in pairs]).to(self.res.device)
        w2 = torch.stack([b for _, b in pairs]).to(self.res.device)
        return torch.cat([w1.reshape(-1), w2.reshape(-1)])
