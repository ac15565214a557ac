"""The rank side of a transition: prepare (standby groups, EPLB communicator, non-expert
weights), drain, commit at an agreed step (switch groups, reshuffle experts, re-warm), abort.

Existing ranks prepare while their step loop keeps serving on the old group; the commit runs
on the step thread once every rank's header says it is ready, so forward passes pause there.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine_ext.elastic.comm import StatelessGroup
from engine_ext.elastic.eplb import ExpertLayout, plan_moves, transfer_pairs
from engine_ext.elastic.transition_plan import TransitionPlan
from engine_ext.rank.recovery import is_peer_failure
from engine_ext.protocol import RankState

if TYPE_CHECKING:
    from engine_ext.rank.engine import RankEngine


@dataclass
class OpState:
    """One operation as this rank sees it."""

    plan: TransitionPlan
    role: str
    standby: StatelessGroup | None = None
    eplb_comm: StatelessGroup | None = None
    prepared: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    result: dict[str, Any] = field(default_factory=dict)

    def drop_groups(self) -> None:
        for g in (self.standby, self.eplb_comm):
            if g is not None:
                g.destroy()


def comm_members(plan: TransitionPlan) -> tuple[int, ...]:
    """The members of an operation's EPLB communicator, in its rank order: the new world on a
    scale-up and a recovery (the dead cannot send), the old world (the sources) on a scale-down."""
    return plan.old_world if plan.kind == "scale_down" else plan.new_world


class RankTransition:
    """Prepare, drain, commit and abort of one rank."""

    def __init__(self, engine: RankEngine) -> None:
        self.engine = engine
        self.op: OpState | None = None
        self.commit_ready = False

    # ---- prepare --------------------------------------------------------------------------------
    def prepare(self, plan: TransitionPlan) -> dict[str, Any]:
        """Form the standby groups and the EPLB communicator, move non-expert weights (I2)."""
        e = self.engine
        role = plan.role(e.rank)
        op = OpState(plan, role)
        with e.lock:
            self.op = op
            e.current_op = plan.op_id
            e.capture_passes = 0
            e.graphs.begin_operation()
        if role != "joining":
            e.telemetry.set_state(RankState.PREPARING)
        e.faults.hold("prepare", joining=role == "joining")
        try:
            late = e.faults.active("late_eplb_comm")  # broken variant: the communicator comes after the transfer
            with e.telemetry.phase(plan.op_id, "prepare", role=role) as d:
                self._form_groups(op, eplb=not late)
                if not late:
                    d["eplb_comm_ready_at"] = time.time()
            if plan.kind == "scale_up":
                e.faults.hold("transfer")
                with e.telemetry.phase(plan.op_id, "transfer") as d:
                    d.update(self._transfer_dense(op))
            if late:
                with e.telemetry.phase(plan.op_id, "eplb_comm") as d:
                    self._form_groups(op, dp=False)
                    d["eplb_comm_ready_at"] = time.time()
            with e.telemetry.phase(plan.op_id, "prepare_warm_groups"):
                if op.standby is not None:
                    op.standby.barrier()
                op.eplb_comm.barrier()  # type: ignore[union-attr]
        except Exception as ex:
            op.error = f"{type(ex).__name__}: {ex}"
            op.drop_groups()
            if role != "joining" and e.state is RankState.PREPARING:
                e.telemetry.set_state(RankState.SERVING, f"prepare of {plan.op_id} failed")
            raise
        op.prepared.set()
        if role == "joining":
            e.loop.start(self._join_commit_then_serve, name="joiner")
        return {"rank": e.rank, "role": role}

    def _form_groups(self, op: OpState, *, dp: bool = True, eplb: bool = True) -> None:
        """The new world's DP group (standby until commit) and the EPLB communicator: on a
        scale-down the communicator spans the old world, whose ranks are the expert sources."""
        e, plan = self.engine, op.plan
        t = plan.timeout_s
        if dp and op.role != "removing":
            op.standby = StatelessGroup(plan.rdzv.child("dp"), plan.new_pos(e.rank), plan.new_size, timeout_s=t,
                                        backend=e.cfg.backend, device=e.device)
        comm_world = comm_members(plan)
        if eplb:
            op.eplb_comm = StatelessGroup(plan.rdzv.child("eplb"), comm_world.index(e.rank), len(comm_world),
                                          timeout_s=t, device=e.device)

    def _transfer_dense(self, op: OpState) -> dict[str, Any]:
        e, plan = self.engine, op.plan
        pairs = transfer_pairs(plan.old_size, plan.new_size)  # positions; the comm spans the new world
        comm = op.eplb_comm
        if comm is None:  # late_eplb_comm: no channel yet, so no weights move
            return {"skipped": "no EPLB communicator: nothing sent or received"}
        me = plan.new_pos(e.rank)
        vec_len = e.model.dense_vector().numel()
        if me in pairs:
            vec = e.model.dense_vector()
            comm.exchange([(vec, dst, 100 + dst) for dst in pairs[me]], [])
            return {"sent_to": pairs[me], "bytes": vec.numel() * vec.element_size() * len(pairs[me])}
        for src, dsts in pairs.items():
            if me in dsts:
                buf = torch.empty(vec_len, dtype=e.model.dtype, device=e.device)
                comm.exchange([], [(buf, src, 100 + me)])
                e.model.load_dense_vector(buf)
                return {"received_from": src, "bytes": buf.numel() * buf.element_size()}
        return {}

    # ---- drain, commit request, abort -------------------------------------------------------------
    def _prepared_op(self, op_id: str) -> OpState:
        op = self.op
        if op is None or op.plan.op_id != op_id:
            raise RuntimeError(f"no prepared operation {op_id} on rank {self.engine.rank}")
        if not op.prepared.is_set():
            raise RuntimeError(f"operation {op_id} is not prepared on rank {self.engine.rank}")
        return op

    def begin_drain(self, op_id: str) -> None:
        """A removing rank is draining while its requests finish (the router sends it no more)."""
        e = self.engine
        with e.lock:
            op = self._prepared_op(op_id)
            if op.role != "removing":
                raise RuntimeError(f"rank {e.rank} is {op.role} in {op_id}, not removing: nothing to drain")
            e.telemetry.set_state(RankState.DRAINING, f"draining for {op_id}")
        e.faults.hold("drain")

    def request_commit(self, op_id: str) -> None:
        e = self.engine
        with e.lock:
            op = self._prepared_op(op_id)
            self.commit_ready = True
            if op.role == "removing":
                e.telemetry.set_state(RankState.REMOVING)
        e.loop.poke()

    def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        e = self.engine
        op = self.op
        if op is None or op.plan.op_id != op_id:
            raise RuntimeError(f"no operation {op_id} on rank {e.rank}")
        if not op.done.wait(timeout_s):
            raise TimeoutError(f"rank {e.rank} did not finish {op_id} in {timeout_s:.0f}s (state {e.state.value})")
        if op.error:
            raise RuntimeError(op.error)
        return op.result

    def abort(self, op_id: str) -> bool:
        """Roll back a prepared-but-uncommitted operation: drop its groups, keep serving."""
        e = self.engine
        with e.lock:
            op = self.op
            if op is None or op.plan.op_id != op_id or self.commit_ready:
                return False
            self.op = None
            e.current_op = ""
        op.drop_groups()
        if e.state in (RankState.PREPARING, RankState.DRAINING):
            e.telemetry.set_state(RankState.SERVING, f"{op_id} rolled back")
        return True

    # ---- commit (step thread) ---------------------------------------------------------------------
    def commit(self) -> bool:
        """Runs on the step thread once every rank agreed. False when this rank left."""
        e = self.engine
        op = self.op
        assert op is not None
        plan = op.plan
        t0 = time.time()
        e.telemetry.set_state(RankState.COMMITTING)
        e.faults.hold("commit")
        try:
            with e.telemetry.phase(plan.op_id, "commit", role=op.role) as d:
                if plan.kind == "scale_up":
                    self._switch(op)
                    self._receive_mapping(plan.new_layout)
                    self._reshuffle_phase(op)
                    e.eplb.update_layout(plan.new_layout)
                    op.result.update(e.warmup.warm_and_capture(plan.op_id))
                elif op.role == "remaining":
                    self._reshuffle_phase(op)
                    self._switch(op)
                    e.eplb.update_layout(plan.new_layout)
                    op.result.update(e.warmup.warm_and_capture(plan.op_id))
                else:  # removing: serve as a reshuffle source, hand back requests, leave
                    self._reshuffle_phase(op)
                    with e.lock:
                        moved = e.sched.export_all()
                    op.result["moved"] = [dict(r.to_wire(), moved_from=r.moved_from + [e.rank]) for r in moved]
                    op.result["graphs_released"] = e.graphs.release()
                    op.drop_groups()
                    if e.group is not None:
                        e.group.destroy()
                    e.group = None
                d["pause_s"] = time.time() - t0
            op.result["pause_s"] = time.time() - t0
        except Exception as ex:
            op.error = f"commit failed on rank {e.rank}: {type(ex).__name__}: {ex}"
            if is_peer_failure(ex) or e.halting:  # a peer died: this rank is healthy, it waits for recovery
                e.recovery.degrade(ex)
            else:
                e.fail(ex)
            op.done.set()
            return False
        with e.lock:
            self.commit_ready = False
            e.current_op = ""
            if op.role == "removing":
                e.stopping = True
        if op.role == "removing":
            e.telemetry.set_state(RankState.REMOVED, f"removed by {plan.op_id}")
            op.done.set()
            return False
        e.telemetry.set_state(RankState.SERVING)
        op.done.set()
        return True

    def _reshuffle_phase(self, op: OpState) -> None:
        e = self.engine
        e.faults.hold("reshuffle")
        with e.telemetry.phase(op.plan.op_id, "reshuffle") as r:
            r.update(self._reshuffle(op))

    def _reshuffle(self, op: OpState) -> dict[str, Any]:
        """Move expert weights into the new layout over the EPLB communicator."""
        e, plan = self.engine, op.plan
        model = e.model
        old_w, new_w = plan.old_world, plan.new_world
        alive = {p for p, m in enumerate(old_w)
                 if plan.kind != "recover" or (m in new_w and m not in plan.untrusted)}
        moves = plan_moves(plan.old_layout, plan.new_layout, alive, missing_ok=plan.kind == "recover")
        comm = op.eplb_comm
        assert comm is not None
        comm_world = comm_members(plan)
        old_w1, old_w2 = model.w1.clone(), model.w2.clone()

        def old_vec(slot: int) -> torch.Tensor:
            return torch.cat([old_w1[:, slot].reshape(-1), old_w2[:, slot].reshape(-1)])

        sends, recvs, local, restored = [], [], [], []
        vec_len = old_vec(0).numel()
        for i, m in enumerate(moves):
            src_g = old_w[m.src_rank] if m.src_rank >= 0 else -1
            dst_g = new_w[m.dst_rank]
            if m.from_weight_source and dst_g == e.rank:
                restored.append(m)
            elif src_g == e.rank and dst_g == e.rank:
                local.append(m)
            elif src_g == e.rank:
                sends.append((old_vec(m.src_slot), comm_world.index(dst_g), 1000 + i))
            elif dst_g == e.rank and src_g >= 0:
                buf = torch.empty(vec_len, dtype=model.dtype, device=e.device)
                recvs.append((buf, comm_world.index(src_g), 1000 + i, m))
        comm.exchange(sends, [(b, s, t) for b, s, t, _ in recvs])
        for m in local:
            model.load_expert_vector(m.dst_slot, old_vec(m.src_slot))
        for buf, _, _, m in recvs:
            model.load_expert_vector(m.dst_slot, buf)
        for m in restored:
            model.load_expert_vector(m.dst_slot, self._from_weight_source(m.logical))
        assert e.cfg.slots_per_rank == plan.new_layout.slots_per_rank
        return {"moves_total": len(moves), "sent": len(sends), "received": len(recvs), "local": len(local),
                "restored_from_weight_source": sorted({m.logical for m in restored})}

    def _from_weight_source(self, logical: int) -> torch.Tensor:
        """One expert's (w1, w2) of every layer, flattened as ``load_expert_vector`` wants it."""
        e = self.engine
        src = e.weight_source
        pairs = [src.expert(layer, logical) for layer in range(e.cfg.num_layers)]
        w1 = torch.stack([a for a, _ in pairs]).to(e.device)
        w2 = torch.stack([b for _, b in pairs]).to(e.device)
        return torch.cat([w1.reshape(-1), w2.reshape(-1)])

    def _switch(self, op: OpState) -> None:
        """Adopt the standby group as the live DP/EP group and the new layout (I6)."""
        e = self.engine
        old = e.group
        with e.lock:
            e.group = op.standby
            e.loop.reset_wake()
        if old is not None and old is not op.standby:
            old.destroy()
        e.model.set_layout(op.plan.new_layout, op.plan.new_pos(e.rank))

    def _receive_mapping(self, layout: ExpertLayout) -> None:
        """Rank 0 broadcasts the expert mapping; joining ranks learn it, others confirm it."""
        t = torch.tensor(layout.phys_to_logical, dtype=torch.int64)
        self.engine.group.broadcast(t, 0)  # type: ignore[union-attr]
        if tuple(t.tolist()) != layout.phys_to_logical:
            raise RuntimeError("expert mapping from rank 0 differs from the plan")

    def _join_commit_then_serve(self) -> None:
        e = self.engine
        e.eplb.async_started = False
        if not self.commit():
            return
        e.eplb.async_started = True  # joining ranks start EPLB's work only at commit (I2)
        e.loop.run()
