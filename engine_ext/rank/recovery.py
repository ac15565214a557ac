"""The rank side of a recovery: a peer died, so this healthy rank degrades (groups aborted,
weights, KV and requests kept) and then rebuilds the world with the other survivors.

Recovery is a transition (DESIGN.md §10): the same pieces as a scale, in order: abort the old
groups, form the new DP group and EPLB communicator before any weight moves (I2), restore the
experts (copy from a surviving replica, else from the weight source), switch groups and layout
at the live position (I1 unchanged, I6), release graphs, re-warm and capture once in lockstep
on the new group (I3, I4, I5, I7), and serve again with the requests it held.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from engine_ext.elastic.comm import StatelessGroup
from engine_ext.elastic.transition_plan import TransitionPlan
from engine_ext.protocol import RankState

if TYPE_CHECKING:
    from engine_ext.rank.engine import RankEngine

# Words a collective or store error carries when the other side went away.
_PEER_WORDS = ("connection reset", "connection closed", "connection refused", "broken pipe", "peer",
               "timed out", "timeout", "was destroyed", "aborted", "socket", "closed by", "eof",
               "gloo", "nccl", "store")


def is_peer_failure(ex: BaseException) -> bool:
    """Whether ``ex`` says a peer (or the store) is gone, rather than that this rank is broken."""
    try:
        import torch.distributed as dist

        if isinstance(ex, (dist.DistError,)):
            return True
    except Exception:  # noqa: BLE001 - an old torch has no DistError
        pass
    text = f"{type(ex).__name__}: {ex}".lower()
    return any(w in text for w in _PEER_WORDS)


class RankRecovery:
    """Degrade on a peer's death; rebuild the world on the controller's recovery plan."""

    def __init__(self, engine: RankEngine) -> None:
        self.engine = engine

    def _abort_groups(self) -> None:
        e = self.engine
        t = e.transition
        with e.lock:
            op, t.op, t.commit_ready = t.op, None, False
            group = e.group
        if op is not None:
            for g in (op.standby, op.eplb_comm):
                if g is not None and g is not group:
                    g.abort()
            op.error = op.error or "aborted: a peer died"
            op.done.set()
        if group is not None:
            group.abort()

    def degrade(self, ex: BaseException | str) -> None:
        """A peer died: stop stepping, abort the groups, keep everything this rank holds."""
        e = self.engine
        e.halting = True
        self._abort_groups()
        if e.state is not RankState.RECOVERING:
            text = str(ex).strip()
            why = ex if isinstance(ex, str) else f"{type(ex).__name__}: {text.splitlines()[0][:200] if text else ''}"
            e.telemetry.set_state(RankState.DEGRADED, f"a peer failed: {why}")

    def _halt(self, timeout_s: float = 10.0) -> None:
        """Stop the step loop wherever it is (a collective, an idle wait) and wait for it."""
        e = self.engine
        e.halting = True
        e.loop.poke()  # wakes an idle wait on a live store; a dead store fails the wait itself
        self._abort_groups()
        thread = e.loop.thread
        if thread is not None and thread.is_alive():
            thread.join(timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"rank {e.rank}: the step loop did not stop in {timeout_s:.0f}s")

    def recover(self, plan: TransitionPlan) -> dict[str, Any]:
        """Rebuild the world of ``plan.new_members`` (the survivors) and serve again."""
        e = self.engine
        op_id = plan.op_id
        t0 = time.time()
        with e.lock:
            e.current_op = op_id
            e.capture_passes = 0
            e.graphs.begin_operation()
        e.telemetry.set_state(RankState.RECOVERING, f"recovering in {op_id}")
        with e.telemetry.phase(op_id, "abort"):
            self._halt()
            # The interrupted step runs again after recovery: the load it recorded so far is not
            # statistics (and would read as warm-up pollution to the I5 check).
            e.model.expert_load.zero_()
        pos = plan.new_pos(e.rank)
        from engine_ext.rank.transition import OpState

        op = OpState(plan, "surviving")
        result: dict[str, Any] = {"rank": e.rank, "position": pos}
        phase_s: dict[str, float] = {"abort": time.time() - t0}
        result["phase_s"] = phase_s
        try:
            t = time.time()
            with e.telemetry.phase(op_id, "regroup", position=pos, size=plan.new_size):
                op.standby = StatelessGroup(plan.rdzv.child("dp"), pos, plan.new_size, timeout_s=plan.timeout_s,
                                            backend=e.cfg.backend, device=e.device)
                op.eplb_comm = StatelessGroup(plan.rdzv.child("eplb"), pos, plan.new_size, timeout_s=plan.timeout_s,
                                              device=e.device)
                op.eplb_comm.barrier()  # the communicator is ready before any weight moves (I2)
            phase_s["regroup"], t = time.time() - t, time.time()
            with e.telemetry.phase(op_id, "restore_experts") as d:
                d.update(e.transition._reshuffle(op))
                result["restored_from_weight_source"] = d.get("restored_from_weight_source", [])
            with e.lock:
                e.group = op.standby
                e.loop.reset_wake()
            e.model.set_layout(plan.new_layout, pos)
            e.eplb.update_layout(plan.new_layout)
            phase_s["restore_experts"], t = time.time() - t, time.time()
            result.update(e.warmup.warm_and_capture(op_id))
            phase_s["warm+capture"] = time.time() - t
        except Exception as ex:
            if op.eplb_comm is not None:
                op.eplb_comm.abort()
            if op.standby is not None and op.standby is not e.group:
                op.standby.abort()
            e.telemetry.set_state(RankState.DEGRADED, f"recovery {op_id} failed: {type(ex).__name__}: {ex}")
            raise
        if op.eplb_comm is not None:
            op.eplb_comm.destroy()
        with e.telemetry.phase(op_id, "resume"):
            with e.lock:
                e.halting = False
                e.current_op = ""
            e.telemetry.set_state(RankState.SERVING)
            e.loop.start()
        result["pause_s"] = time.time() - t0
        return result
