"""The rank side of a recovery: a peer died, so this healthy rank degrades (groups aborted,
weights, KV and requests kept) and then rebuilds the world with the other survivors.

Recovery is a transition (DESIGN.md §10): the same pieces as a scale, in order: abort the old
groups, form the new DP group and EPLB communicator before any weight moves (I2), restore the
experts (copy from a surviving replica, else from the weight source), switch groups and layout
at the live position (I1 unchanged, I6), release graphs, re-warm and capture once in lockstep
on the new group (I3, I4, I5, I7), and serve again with the requests it held.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from engine_ext.elastic.comm import GroupError, StatelessGroup
from engine_ext.elastic.transition_plan import TransitionPlan
from engine_ext.protocol import RankState
from engine_ext.rank.operation import OpState
from engine_ext.rank.reshuffle import ExpertReshuffle
from engine_ext.rank.shared import RankResources, RankShared
from engine_ext.rank.step_loop import StepLoop
from engine_ext.rank.telemetry import RankTelemetry
from engine_ext.rank.warmup import Warmup


def is_peer_failure(ex: BaseException) -> bool:
    """Whether ``ex`` says a peer (or the store) is gone, rather than that this rank is broken:
    read from the exception's type (a group's GroupError, torch.distributed's DistError, a
    connection or timeout error), on ``ex`` or on the exceptions it was raised from."""
    import torch.distributed as dist

    seen: set[int] = set()
    cur: BaseException | None = ex
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (GroupError, dist.DistError, ConnectionError, TimeoutError)):
            return True
        seen.add(id(cur))
        cur = cur.__cause__
    return False


class RankRecovery:
    """Degrade on a peer's death; rebuild the world on the controller's recovery plan."""

    def __init__(
        self,
        res: RankResources,
        shared: RankShared,
        telemetry: RankTelemetry,
        loop: StepLoop,
        warmup: Warmup,
        reshuffle: ExpertReshuffle,
    ) -> None:
        self.res = res
        self.shared = shared
        self.telemetry = telemetry
        self.loop = loop
        self.warmup = warmup
        self.reshuffle = reshuffle

    def on_error(self, ex: BaseException) -> None:
        """A step or a commit failed: a peer died (or recovery aborted the group), so degrade and
        wait for recovery; else this rank is broken, so fail."""
        if self.shared.halting.is_set() or (is_peer_failure(ex) and not self.res.faults.active("no_degrade")):
            self.degrade(ex)
        else:
            self.fail(ex)

    def fail(self, ex: BaseException) -> None:
        """The rank cannot go on: say why and stop stepping. Its requests are not failed: the
        controller's reconcile loop fences the rank on its next probe and they continue, with
        their tokens so far, on the world rebuilt without it."""
        self.shared.halting.set()
        self.telemetry.set_state(RankState.FAILED, f"{type(ex).__name__}: {ex}")
        self.telemetry.failure(self.shared.current_op or "serving", ex)

    def _abort_groups(self) -> None:
        shared = self.shared
        op = shared.take_op()
        group = shared.group
        abort = not self.res.faults.active("no_group_abort")
        if op is not None:
            if abort:
                op.abort_groups(keep=group)
            op.error = op.error or "aborted: a peer died"
            op.done.set()
        if group is not None and abort:
            group.abort()

    def degrade(self, ex: BaseException | str) -> None:
        """A peer died: stop stepping, abort the groups, keep everything this rank holds."""
        self.shared.halting.set()
        self._abort_groups()
        if self.shared.state is not RankState.RECOVERING:
            text = str(ex).strip()
            why = ex if isinstance(ex, str) else f"{type(ex).__name__}: {text.splitlines()[0][:200] if text else ''}"
            self.telemetry.set_state(RankState.DEGRADED, f"a peer failed: {why}")

    def fence(self, reason: str) -> None:
        """Excluded from the world: stop stepping and say so at once; the groups are dropped in
        the background (dropping a gloo group blocks while a collective waits on a silent peer)."""
        self.shared.halting.set()
        self.telemetry.set_state(RankState.FENCED, reason)
        threading.Thread(target=self._abort_groups, name=f"fence-{self.shared.rank}", daemon=True).start()

    def _halt(self, timeout_s: float = 10.0) -> None:
        """Stop the step loop wherever it is (a collective, an idle wait) and wait for it."""
        self.shared.halting.set()
        # Wakes an idle wait on a live store (a dead store fails the wait itself), before the
        # groups are dropped; waited for briefly only: a store behind a partition holds the call
        # until its own timeout (the sleeper is then abandoned by ``join``).
        poke = threading.Thread(target=self.loop.poke, name=f"poke-{self.shared.rank}", daemon=True)
        poke.start()
        poke.join(0.5)
        self._abort_groups()
        grace = math.inf if self.res.faults.active("no_sleeper_abandon") else 1.0
        if not self.loop.join(timeout_s, idle_grace_s=grace):
            raise RuntimeError(f"rank {self.shared.rank}: the step loop did not stop in {timeout_s:.0f}s")

    def _regroup(self, op: OpState, pos: int) -> None:
        """The survivors' DP group and EPLB communicator, ready before any weight moves (I2)."""
        plan, res = op.plan, self.res
        op.standby = StatelessGroup(
            plan.rdzv.child("dp"),
            pos,
            plan.new_size,
            timeout_s=plan.timeout_s,
            backend=res.cfg.backend,
            device=res.device,
            transport=res.cfg.transport,
            shm_bytes=res.model.exchange_bound(plan.new_size),
        )
        op.eplb_comm = StatelessGroup(
            plan.rdzv.child("eplb"),
            pos,
            plan.new_size,
            timeout_s=plan.timeout_s,
            device=res.device,
            transport=res.cfg.transport,
        )
        op.eplb_comm.barrier()

    def recover(self, plan: TransitionPlan) -> dict[str, Any]:
        """Rebuild the world of ``plan.new_members`` (the survivors) and serve again."""
        shared, res, telemetry = self.shared, self.res, self.telemetry
        op_id = plan.op_id
        t0 = time.time()
        shared.begin_op(op_id)
        res.graphs.begin_operation(op_id)
        telemetry.set_state(RankState.RECOVERING, f"recovering in {op_id}")
        with telemetry.phase(op_id, "abort") as d:
            abandoned = self.loop.abandoned
            self._halt()
            if self.loop.abandoned > abandoned:
                d["step_loop"] = "left asleep on a store that did not answer (its host cut off)"
            # The interrupted step runs again after recovery: the load it recorded so far is not
            # statistics (and would read as warm-up pollution to the I5 check).
            res.model.expert_load.zero_()
        pos = plan.new_pos(shared.rank)
        op = OpState(plan, "surviving")
        result: dict[str, Any] = {"rank": shared.rank, "position": pos}
        phase_s: dict[str, float] = {"abort": time.time() - t0}
        result["phase_s"] = phase_s
        try:
            t = time.time()
            res.faults.hold("regroup")
            with telemetry.phase(op_id, "regroup", position=pos, size=plan.new_size):
                self._regroup(op, pos)
            phase_s["regroup"], t = time.time() - t, time.time()
            with telemetry.phase(op_id, "restore_experts") as d:
                d.update(self.reshuffle.run(op))
                result["restored_from_weight_source"] = d.get("restored_from_weight_source", [])
            shared.set_group(op.standby)
            res.model.set_layout(plan.new_layout, pos)
            res.eplb.update_layout(plan.new_layout)
            phase_s["restore_experts"], t = time.time() - t, time.time()
            result.update(self.warmup.warm_and_capture(op_id))
            phase_s["warm+capture"] = time.time() - t
        except Exception as ex:
            op.abort_groups(keep=shared.group)
            if shared.current_op == op_id:  # not when a later recovery (a peer died in this one) took over
                telemetry.set_state(RankState.DEGRADED, f"recovery {op_id} failed: {type(ex).__name__}: {ex}")
            raise
        if op.eplb_comm is not None:
            op.eplb_comm.destroy()
        with telemetry.phase(op_id, "resume"):
            with shared.lock:
                shared.halting.clear()
                shared.current_op = ""
            telemetry.set_state(RankState.SERVING)
            self.loop.start()
        result["pause_s"] = time.time() - t0
        return result
