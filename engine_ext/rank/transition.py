"""The rank side of a transition: prepare (standby groups, EPLB communicator, non-expert
weights, the expert pre-copy), drain, commit at an agreed step (switch groups, load the experts
the pre-copy holds into their slots, re-warm), abort.

Existing ranks prepare while their step loop keeps serving on the old group; the commit runs
on the step thread once every rank's header says it is ready, so forward passes pause there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_ext.elastic.comm import StatelessGroup
from engine_ext.elastic.eplb import ExpertLayout, transfer_pairs
from engine_ext.elastic.transition_plan import TransitionPlan
from engine_ext.protocol import RankState
from engine_ext.rank.operation import OpState, comm_members
from engine_ext.rank.reshuffle import TAG_BASE, ExpertReshuffle
from engine_ext.rank.shared import RankResources, RankShared
from engine_ext.rank.step_loop import StepLoop
from engine_ext.rank.telemetry import RankTelemetry
from engine_ext.rank.warmup import Warmup

DENSE_TAG = 100  # dense tensor j travels with tag DENSE_TAG + j, below the reshuffle's TAG_BASE


class RankTransition:
    """Prepare, drain, commit and abort of one rank. The operation it runs lives in
    ``RankShared.op`` (recovery abandons it there when a peer dies); ``on_error`` is
    RankRecovery's verdict on a failed commit."""

    def __init__(
        self,
        res: RankResources,
        shared: RankShared,
        telemetry: RankTelemetry,
        loop: StepLoop,
        warmup: Warmup,
        reshuffle: ExpertReshuffle,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.res = res
        self.shared = shared
        self.telemetry = telemetry
        self.loop = loop
        self.warmup = warmup
        self.reshuffle = reshuffle
        self.on_error = on_error

    # ---- prepare --------------------------------------------------------------------------------
    def prepare(self, plan: TransitionPlan) -> dict[str, Any]:
        """Form the standby groups and the EPLB communicator, move non-expert weights (I2)."""
        shared, faults, telemetry = self.shared, self.res.faults, self.telemetry
        role = plan.role(shared.rank)
        op = OpState(plan, role)
        shared.begin_op(plan.op_id, op)
        self.res.graphs.begin_operation(plan.op_id)
        if role != "joining":
            telemetry.set_state(RankState.PREPARING)
        faults.hold("prepare", joining=role == "joining")
        # I2: the communicator exists before any weight moves; the broken variant only reverses the order.
        steps = [self._form_groups, self._transfer_phase]
        if faults.active("late_eplb_comm"):
            steps.reverse()
        try:
            for step in steps:
                step(op)
            precopy = self._precopy_phase(op)
            with telemetry.phase(plan.op_id, "prepare_warm_groups"):
                if op.standby is not None:
                    op.standby.barrier()
                op.eplb_comm.barrier()  # type: ignore[union-attr]
        except Exception as ex:
            op.error = f"{type(ex).__name__}: {ex}"
            op.drop_groups()
            if role != "joining" and shared.state is RankState.PREPARING:
                telemetry.set_state(RankState.SERVING, f"prepare of {plan.op_id} failed")
            raise
        op.prepared.set()
        if role == "joining":
            self.loop.start(self._join_commit_then_serve, name="joiner")
        return {
            "rank": shared.rank,
            "role": role,
            "spare_bytes": op.precopy.nbytes if op.precopy is not None else 0,
            "precopy": precopy,
        }

    def _form_groups(self, op: OpState) -> None:
        """The new world's DP group (standby until commit) and the EPLB communicator: on a
        scale-down the communicator spans the old world, whose ranks are the expert sources."""
        plan, res, me = op.plan, self.res, self.shared.rank
        t = plan.timeout_s
        with self.telemetry.phase(plan.op_id, "prepare", role=op.role) as d:
            if op.role != "removing":
                needed = res.model.exchange_bound(plan.new_size)
                # The broken variant sizes the new world's shared memory for the old world's exchanges.
                sized_for = plan.old_size if res.faults.active("transport_sized_for_old_world") else plan.new_size
                op.standby = StatelessGroup(
                    plan.rdzv.child("dp"),
                    plan.new_pos(me),
                    plan.new_size,
                    timeout_s=t,
                    backend=res.cfg.backend,
                    device=res.device,
                    transport=res.cfg.transport,
                    shm_bytes=res.model.exchange_bound(sized_for),
                    on_setup=lambda: res.faults.hold("shm_setup"),
                )
                # The new world's transport, prepared (every member mapped its shared memory, sized
                # for the new world's exchanges) here, before any weight moves or warm-up
                # collective: I2's evidence for the transport, checked before the transfer.
                d.update(
                    transport=op.standby.transport_kind,
                    transport_attached=op.standby.transport_attached,
                    world=plan.new_size,
                    transport_bytes=op.standby.transport_bytes,
                    transport_needed=needed,
                )
                if not res.faults.active("no_transport_check"):
                    op.standby.check_transport(needed)
            comm_world = comm_members(plan)
            op.eplb_comm = StatelessGroup(
                plan.rdzv.child("eplb"),
                comm_world.index(me),
                len(comm_world),
                timeout_s=t,
                device=res.device,
                transport=res.cfg.transport,
            )

    def _transfer_phase(self, op: OpState) -> None:
        """A scale-up sends the non-expert weights to the joiners over the EPLB communicator."""
        if op.plan.kind != "scale_up":
            return
        self.res.faults.hold("transfer")
        with self.telemetry.phase(op.plan.op_id, "transfer") as d:
            d.update(self._transfer_dense(op))

    def _transfer_dense(self, op: OpState) -> dict[str, Any]:
        """One message per dense tensor, from the sender's weights into the joiner's: no
        concatenation and no receive buffer (engine_ext/rank/reshuffle.py says why)."""
        plan, model = op.plan, self.res.model
        pairs = transfer_pairs(plan.old_size, plan.new_size)  # positions; the comm spans the new world
        comm = op.eplb_comm
        if comm is None:  # I2: the communicator exists before any weight moves
            raise RuntimeError("no eplb_comm: a weight transfer needs the EPLB communicator formed first (I2)")
        me = plan.new_pos(self.shared.rank)
        tensors = list(model.dense.values())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert DENSE_TAG + len(tensors) <= TAG_BASE, "dense tags would meet the reshuffle's"
        if me in pairs:
            comm.exchange([(t, dst, DENSE_TAG + j) for dst in pairs[me] for j, t in enumerate(tensors)], [])
            return {"sent_to": pairs[me], "bytes": nbytes * len(pairs[me])}
        for src, dsts in pairs.items():
            if me in dsts:
                comm.exchange([], [(t, src, DENSE_TAG + j) for j, t in enumerate(tensors)])
                return {"received_from": src, "bytes": nbytes}
        return {}

    def _precopy_phase(self, op: OpState) -> dict[str, Any]:
        """The experts the new layout gives each rank move now, while the old world serves
        (engine_ext/rank/reshuffle.py); the commit only loads what a member holds in spare buffers.
        Returns its seconds and bytes: the operation record sets them beside the plan's prediction."""
        t0 = time.perf_counter()
        with self.telemetry.phase(op.plan.op_id, "precopy", role=op.role) as d:
            d.update(self.reshuffle.precopy(op))
        return {
            "s": time.perf_counter() - t0,
            **{k: d.get(k, 0) for k in ("bytes_received", "bytes_sent", "spare_bytes")},
        }

    # ---- drain, commit request, abort -------------------------------------------------------------
    def _prepared_op(self, op_id: str) -> OpState:
        op = self.shared.op
        if op is None or op.plan.op_id != op_id:
            raise RuntimeError(f"no prepared operation {op_id} on rank {self.shared.rank}")
        if not op.prepared.is_set():
            raise RuntimeError(f"operation {op_id} is not prepared on rank {self.shared.rank}")
        return op

    def begin_drain(self, op_id: str) -> None:
        """A removing rank is draining while its requests finish (the router sends it no more)."""
        shared = self.shared
        with shared.lock:
            op = self._prepared_op(op_id)
            if op.role != "removing":
                raise RuntimeError(f"rank {shared.rank} is {op.role} in {op_id}, not removing: nothing to drain")
            self.telemetry.set_state(RankState.DRAINING, f"draining for {op_id}")
        self.res.faults.hold("drain")

    def request_commit(self, op_id: str) -> None:
        shared = self.shared
        with shared.lock:
            op = self._prepared_op(op_id)
            shared.commit_ready = True
            if op.role == "removing":
                self.telemetry.set_state(RankState.REMOVING)
        self.loop.poke()

    def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        shared = self.shared
        # a failed commit may be abandoned (the rank fenced) before the controller asks: its error
        # is still the answer, not "no operation"
        op = next((o for o in (shared.op, shared.abandoned) if o is not None and o.plan.op_id == op_id), None)
        if op is None:
            raise RuntimeError(f"no operation {op_id} on rank {shared.rank}")
        if not op.done.wait(timeout_s):
            raise TimeoutError(
                f"rank {shared.rank} did not finish {op_id} in {timeout_s:.0f}s (state {shared.state.value})"
            )
        if op.error:
            raise RuntimeError(op.error)
        return op.result

    def abort(self, op_id: str) -> bool:
        """Roll back a prepared-but-uncommitted operation: drop its groups, keep serving."""
        shared = self.shared
        with shared.lock:
            op = shared.op
            if op is None or op.plan.op_id != op_id or shared.commit_ready:
                return False
            shared.take_op()
            shared.finish_op()
        op.drop_groups()
        op.error = op.error or f"{op_id} rolled back"
        op.done.set()  # a late wait_op answers at once
        if shared.state in (RankState.PREPARING, RankState.DRAINING):
            self.telemetry.set_state(RankState.SERVING, f"{op_id} rolled back")
        return True

    # ---- commit (step thread) ---------------------------------------------------------------------
    def commit(self) -> bool:
        """Runs on the step thread once every rank agreed. False when this rank left."""
        shared, telemetry = self.shared, self.telemetry
        op = shared.op
        assert op is not None
        plan = op.plan
        t0 = time.time()
        telemetry.set_state(RankState.COMMITTING)  # at once: a rank lost in its commit is explained by it
        self.res.faults.hold("commit")
        leaving = op.role == "removing"
        try:
            # The rest of its reports wait for the commit's end: they cost CPU the pause needs.
            with telemetry.quiet():
                with telemetry.phase(plan.op_id, "commit", role=op.role) as d:
                    d["parts_s"] = parts = self._commit_steps(op)
                    d["pause_s"] = self._pause_s(op, parts, t0)
                op.result["pause_s"] = d["pause_s"]
                shared.finish_op(stop=leaving)
                if leaving:
                    telemetry.set_state(RankState.REMOVED, f"removed by {plan.op_id}")
                else:
                    telemetry.set_state(RankState.SERVING)
        except Exception as ex:  # noqa: BLE001 - whatever failed, on_error decides what it means
            op.error = f"commit failed on rank {shared.rank}: {type(ex).__name__}: {ex}"
            self.on_error(ex)  # a peer died: this rank is healthy and waits for recovery; else it failed
            op.done.set()
            return False
        op.done.set()
        return not leaving

    @staticmethod
    def _pause_s(op: OpState, parts: dict[str, float], t0: float) -> float:
        """This rank's part of the serving pause. A member stopped serving when its commit began. A
        joiner served nothing before: its commit begins once prepared and waits in the first
        collective (``mapping``) for the members to reach their step boundary, while they still
        serve, so its pause counts from that rendezvous (tests/test_serving_pause.py)."""
        waited = parts.get("switch", 0.0) + parts.get("mapping", 0.0) if op.role == "joining" else 0.0
        return max(0.0, time.time() - t0 - waited)

    def _commit_steps(self, op: OpState) -> dict[str, float]:
        """Switch groups, reshuffle experts and re-warm, in the order the rank's role needs; the
        seconds each part took (the commit is the serving pause: where it goes is reported)."""
        plan, res, shared = op.plan, self.res, self.shared
        parts: dict[str, float] = {}
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            parts[name] = round(now - t, 6)
            t = now

        if plan.kind == "scale_up":
            self._switch(op)
            lap("switch")
            self._receive_mapping(plan.new_layout)  # the first collective: waits for every rank to commit
            lap("mapping")
            self._reshuffle_phase(op)
            lap("reshuffle")
            res.eplb.update_layout(plan.new_layout)
            op.result.update(self.warmup.warm_and_capture(plan.op_id))
            lap("warm_and_capture")
        elif op.role == "remaining":
            self._reshuffle_phase(op)
            lap("reshuffle")
            self._switch(op)
            lap("switch")
            res.eplb.update_layout(plan.new_layout)
            op.result.update(self.warmup.warm_and_capture(plan.op_id))
            lap("warm_and_capture")
        else:  # removing: serve as a reshuffle source, hand back requests, leave
            self._reshuffle_phase(op)
            lap("reshuffle")
            with shared.lock:
                moved = res.sched.export_all()
            op.result["moved"] = [dict(r.to_wire(), moved_from=r.moved_from + [shared.rank]) for r in moved]
            op.result["graphs_released"] = res.graphs.release()
            op.drop_groups()
            old = shared.set_group(None)
            if old is not None:
                old.destroy()
            lap("leave")
        return parts

    def _reshuffle_phase(self, op: OpState) -> None:
        """What of the expert moves could not happen before the switch: a member's spare buffers
        copied into its slots (their bytes bounded by what it received and its local moves)."""
        self.res.faults.hold("reshuffle")
        with self.telemetry.phase(op.plan.op_id, "reshuffle") as r:
            r.update(self.reshuffle.apply(op))

    def _switch(self, op: OpState) -> None:
        """Adopt the standby group as the live DP/EP group and the new layout (I6)."""
        old = self.shared.set_group(op.standby)
        if old is not None and old is not op.standby:
            # Off the pause: nothing uses the old group after the switch, and shutting a gloo
            # group down takes ~20 ms on CPU (measured inside the commit, benchmarks/curves.py).
            threading.Thread(target=old.destroy, name=f"destroy-old-group-{self.shared.rank}", daemon=True).start()
        self.res.model.set_layout(op.plan.new_layout, op.plan.new_pos(self.shared.rank))

    def _receive_mapping(self, layout: ExpertLayout) -> None:
        """Rank 0 broadcasts the expert mapping; joining ranks learn it, others confirm it."""
        t = torch.tensor(layout.phys_to_logical, dtype=torch.int64)
        self.shared.group.broadcast(t, 0)  # type: ignore[union-attr]
        if tuple(t.tolist()) != layout.phys_to_logical:
            raise RuntimeError("expert mapping from rank 0 differs from the plan")

    def _join_commit_then_serve(self) -> None:
        eplb = self.res.eplb
        eplb.async_started = False
        if not self.commit():
            return
        eplb.async_started = True  # joining ranks start EPLB's work only at commit (I2)
        self.loop.run()
