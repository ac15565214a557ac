"""Expert moves into an operation's new layout over its EPLB communicator.

A scale moves them ahead of its commit (``precopy``, in prepare, while the old world serves: expert
weights do not change while serving, so the senders read their live storage) and its commit only
loads what a member received into spare buffers into its slots (``apply``); a recovery, whose
sources just died or may be half moved, moves them in one go (``run``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from engine_ext.elastic.eplb import ExpertMove, plan_moves
from engine_ext.elastic.weight_source import WeightSource
from engine_ext.rank.operation import OpState, PreCopy, comm_members
from engine_ext.rank.shared import RankResources, RankShared

TAG_BASE = 1000  # dense transfers use tags below it (engine_ext/rank/transition.py)


class ExpertReshuffle:
    """Moves expert weights into an operation's new layout over its EPLB communicator; experts
    whose every copy died come from the weight source (a checkpoint loader in production)."""

    def __init__(self, res: RankResources, shared: RankShared, weight_source: WeightSource,
                 pool_blocks: Callable[[int], int] | None = None) -> None:
        self.res = res
        self.shared = shared
        self.weight_source = weight_source
        # Warmup.kv_pool_blocks: the KV blocks the rank's budget leaves beside so many bytes of
        # workspace (and spare buffers): a pre-copy's spare buffers come out of the KV pool.
        self.pool_blocks = pool_blocks

    def _pieces(self, slot: int, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The contiguous per-layer parts of one expert, as sent: storage views, or views of
        ``flat`` (laid out as ``load_expert_vector`` reads it). Sending views of the storage needs
        no packed copy (packing cost seconds per GiB at the senders)."""
        w1, w2 = self.res.model.w1, self.res.model.w2
        layers = w1.shape[0]
        if flat is None:
            return [w[l, slot] for l in range(layers) for w in (w1, w2)]
        n1 = w1[0, 0].numel()
        a = flat[: layers * n1].view(layers, *w1.shape[2:])
        b = flat[layers * n1:].view(layers, *w2.shape[2:])
        return [t[l] for l in range(layers) for t in (a, b)]

    def _schedule(self, op: OpState, moves: list[ExpertMove],
                  into_storage: bool) -> tuple[list, list, list, list, list]:
        """(sends, recvs, local copies, weight-source restores, landing buffers) of this rank."""
        plan, model, me = op.plan, self.res.model, self.shared.rank
        old_w, new_w, comm_world = plan.old_world, plan.new_world, comm_members(plan)
        per_move = 2 * model.w1.shape[0]
        sends, recvs, local, restored, landing = [], [], [], [], []
        vec_len = model.w1[:, 0].numel() + model.w2[:, 0].numel()
        for i, m in enumerate(moves):
            src_g = old_w[m.src_rank] if m.src_rank >= 0 else -1
            dst_g = new_w[m.dst_rank]
            tags = range(TAG_BASE + i * per_move, TAG_BASE + (i + 1) * per_move)
            if m.from_weight_source and dst_g == me:
                restored.append(m)
            elif src_g == me and dst_g == me:
                if m.src_slot != m.dst_slot:  # else the slot keeps its expert: nothing to copy
                    # A copy taken before anything is loaded: another local move may overwrite the slot.
                    local.append((m, model.expert_vector(m.src_slot)))
            elif src_g == me:
                peer = comm_world.index(dst_g)
                sends += [(t, peer, tag) for t, tag in zip(self._pieces(m.src_slot), tags)]
            elif dst_g == me and src_g >= 0:
                peer = comm_world.index(src_g)
                if into_storage:
                    targets = self._pieces(m.dst_slot)
                else:
                    buf = torch.empty(vec_len, dtype=model.dtype, device=self.res.device)
                    landing.append((m, buf))
                    targets = self._pieces(m.dst_slot, buf)
                recvs += [(t, peer, tag) for t, tag in zip(targets, tags)]
        return sends, recvs, local, restored, landing

    def run(self, op: OpState) -> dict[str, Any]:
        """This rank's sends, receives, local copies and restores of ``op``'s expert moves."""
        plan, model = op.plan, self.res.model
        old_w, new_w = plan.old_world, plan.new_world
        alive = {p for p, m in enumerate(old_w)
                 if plan.kind != "recover" or (m in new_w and m not in plan.untrusted)}
        moves = plan_moves(plan.old_layout, plan.new_layout, alive, missing_ok=plan.kind == "recover")
        comm = op.eplb_comm
        assert comm is not None
        t0 = time.perf_counter()
        # A joiner's slots hold placeholders: it receives straight into them (a failed commit
        # drops the joiner). A member's slots serve until the exchange succeeded, so what it
        # receives lands in a buffer and is loaded after: a failed exchange leaves them whole.
        into_storage = plan.role(self.shared.rank) == "joining"
        per_move = 2 * model.w1.shape[0]
        t_clone = time.perf_counter()
        sends, recvs, local, restored, landing = self._schedule(op, moves, into_storage)
        t_pack = time.perf_counter()
        comm.exchange(sends, recvs)
        t_exchange = time.perf_counter()
        for m, vec in local:
            model.load_expert_vector(m.dst_slot, vec)
        for m, buf in landing:
            model.load_expert_vector(m.dst_slot, buf)
        for m in restored if not self.res.faults.active("no_weight_source_restore") else []:
            model.load_expert_vector(m.dst_slot, self.from_weight_source(m.logical))
        assert self.res.cfg.slots_per_rank == plan.new_layout.slots_per_rank
        t_load = time.perf_counter()
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"moves_total": len(moves), "sent": len(sends) // per_move, "received": len(recvs) // per_move,
                "local": len(local), "received_into_storage": into_storage,
                "bytes_sent": nbytes(t for t, _, _ in sends), "bytes_received": nbytes(t for t, _, _ in recvs),
                "restored_from_weight_source": sorted({m.logical for m in restored}),
                # where the time goes (benchmarks/curves.py): clone_s is 0 since the storage is no
                # longer snapshot; pack_s is the local moves' copies and a member's landing
                # buffers (sends go from the storage), then the gloo exchange, and loading the
                # landed and local experts into their slots
                "clone_s": t_clone - t0, "pack_s": t_pack - t_clone, "exchange_s": t_exchange - t_pack,
                "load_s": t_load - t_exchange}

    def from_weight_source(self, logical: int) -> torch.Tensor:
        """One expert's (w1, w2) of every layer, flattened as ``load_expert_vector`` wants it."""
        pairs = [self.weight_source.expert(layer, logical) for layer in range(self.res.cfg.num_layers)]
        w1 = torch.stack([a for a, _ in pairs]).to(self.res.device)
        w2 = torch.stack([b for _, b in pairs]).to(self.res.device)
        return torch.cat([w1.reshape(-1), w2.reshape(-1)])

    # ---- a scale: moves before the commit, the commit only loads -----------------------------------
    def precopy(self, op: OpState) -> dict[str, Any]:
        """Receive the experts the new layout gives this rank while the old world serves: a joiner
        into its slots (placeholders nobody serves from), a member into spare buffers (its slots
        serve until the switch; a failure before it leaves them whole). One exchange per move, in
        the plan's order (every rank walks the same order, so none waits on a move its peer has
        not reached); ``hold:precopy`` keeps a rank after its first of several (mid pre-copy)."""
        plan, res, model = op.plan, self.res, self.res.model
        moves = plan_moves(plan.old_layout, plan.new_layout, set(range(plan.old_size)))
        comm = op.eplb_comm
        assert comm is not None
        per_move = 2 * model.w1.shape[0]
        # "precopy_into_live_slots": a member receives straight into the slots it serves from.
        into_storage = op.role == "joining" or res.faults.active("precopy_into_live_slots")
        t0 = time.perf_counter()
        sends, recvs, local, _, landing = self._schedule(op, moves, into_storage)
        held = local + landing  # local copies are taken now: another move may overwrite their source slot
        spare = sum(buf.numel() * buf.element_size() for _, buf in held)
        self._hold_spare(op, held, spare)
        t_pack = time.perf_counter()
        by_move: dict[int, tuple[list, list]] = {}
        for side, items in ((0, sends), (1, recvs)):
            for item in items:
                by_move.setdefault((item[2] - TAG_BASE) // per_move, ([], []))[side].append(item)
        for k, i in enumerate(sorted(by_move)):
            comm.exchange(*by_move[i])
            if k == 0 and len(by_move) > 1:
                res.faults.hold("precopy")
        t_exchange = time.perf_counter()
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"moves_total": len(moves), "sent": len(sends) // per_move, "received": len(recvs) // per_move,
                "local": len(local), "received_into_storage": into_storage, "exchanges": len(by_move),
                "bytes_sent": nbytes(t for t, _, _ in sends), "bytes_received": nbytes(t for t, _, _ in recvs),
                "spare_bytes": spare, "pack_s": t_pack - t0, "exchange_s": t_exchange - t_pack}

    def _hold_spare(self, op: OpState, held: list, nbytes: int) -> None:
        """Keep the spare buffers in ``op`` and take their bytes out of the KV pool (the rank's
        budget is KV + workspace + spare); ``OpState.free_precopy`` gives them back."""
        res, shared = self.res, self.shared

        def release() -> None:
            with shared.lock:
                if nbytes and self.pool_blocks is not None:
                    res.sched.blocks.resize(self.pool_blocks(res.workspace.nbytes))
                shared.move_bytes_held = 0

        with shared.lock:
            if nbytes and self.pool_blocks is not None:
                res.sched.blocks.resize(self.pool_blocks(res.workspace.nbytes + nbytes))
            shared.move_bytes_held = nbytes
        op.precopy = PreCopy(held, nbytes, time.time(), release)

    def apply(self, op: OpState) -> dict[str, Any]:
        """At the commit: copy what the pre-copy holds in spare buffers into the slots whose expert
        changes (memory to memory: the only expert bytes the pause moves; none on a joiner or on a
        member whose slots keep their experts), then free the buffers."""
        model = self.res.model
        pc = op.precopy
        t0 = time.perf_counter()
        copied = 0
        for m, buf in pc.held if pc is not None else []:
            model.load_expert_vector(m.dst_slot, buf)
            copied += buf.numel() * buf.element_size()
        t_load = time.perf_counter()
        return {"commit_copy_bytes": copied, "load_s": t_load - t0, **op.free_precopy("commit")}
