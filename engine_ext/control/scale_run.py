"""The run of one admitted scale: launch, prepare, drain, commit, adopt the new world, clean up;
on failure, roll back (before commit) or hand the world to the recovery (from commit on).

It checks nothing the admission (engine_ext.control.admission) already checked.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from engine_ext.control.cost_model import measured, relative_errors, within_range
from engine_ext.control.rank_client import RankClient
from engine_ext.control.redispatch import redispatch
from engine_ext.control.scale_plan import ScalePlan
from engine_ext.control.spawner import Spawner
from engine_ext.control.world import RankCallFailed, World, quiet, short_error
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.transition_plan import TransitionPlan
from engine_ext.protocol import EepError, Operation, OpState, Phase, TransitionFailed, to_builtins

if TYPE_CHECKING:
    from engine_ext.control.recovery import Recovery


class ScaleRun:
    """One scale from ``plan.from_size`` to ``plan.to_size`` ranks, recorded in ``op``."""

    def __init__(
        self,
        world: World,
        spawner: Spawner,
        recovery: Recovery,
        plan: ScalePlan,
        op: Operation,
        *,
        drain_timeout_s: float,
        timeout_s: float,
    ) -> None:
        self.world, self.spawner, self.recovery = world, spawner, recovery
        self.plan, self.op = plan, op
        self.drain_timeout_s, self.timeout_s = drain_timeout_s, timeout_s
        self.growing = plan.to_size > plan.from_size
        self.old_members = list(world.members)
        # Joiners take the global ranks right after the last member (the plan's): positions never
        # move, and numbers freed by a scale-down or a death are taken again (their actors are gone).
        self.new_ranks = [int(j["rank"]) for j in plan.joining] if self.growing else []
        self.leaving = [int(j["rank"]) for j in plan.leaving]  # the scale-down's choice (scale_plan.choose_leaving)
        self.new_members = (
            self.old_members + self.new_ranks
            if self.growing
            else [m for m in self.old_members if m not in self.leaving]
        )
        self.joiners: dict[int, RankClient] = {}  # ranks this run launched (the rollback stops them)
        self.prepared: dict[str, dict[str, Any]] = {}  # each rank's prepare answer: its pre-copy's seconds, bytes
        self.commit_started = False

    async def execute(self) -> None:
        """Run under the timeout; a failure is recorded in ``op`` and cleaned up, never raised."""
        op = self.op
        try:
            await asyncio.wait_for(self.run(), timeout=self.timeout_s)
            op.state = OpState.SUCCEEDED.value
        except asyncio.TimeoutError:
            op.state, op.error_code = OpState.TIMED_OUT.value, 6
            op.error = f"timed out after {self.timeout_s:.0f}s in phase {op.phase}"
            await self.recover()
        except EepError as e:
            op.state, op.error_code, op.error = OpState.FAILED.value, int(e.exit_code), e.message
            await self.recover()
        except Exception as e:  # noqa: BLE001 - every failure must be reported, not raised raw
            op.state, op.error_code = OpState.FAILED.value, 5
            op.error = f"{type(e).__name__}: {e}"
            await self.recover()

    def _transition_plan(self) -> TransitionPlan:
        w, plan = self.world, self.plan
        assert w.layout is not None
        return TransitionPlan(
            op_id=plan.op_id,
            kind="scale_up" if self.growing else "scale_down",
            old_size=plan.from_size,
            new_size=plan.to_size,
            rdzv=w.rendezvous(plan.op_id),
            old_layout=w.layout,
            new_layout=ExpertLayout.from_dict(plan.layout),
            timeout_s=self.timeout_s,
            old_members=tuple(self.old_members),
            new_members=tuple(self.new_members),
            precopy_moves=tuple(plan.precopy["moves"]) if "moves" in plan.precopy else None,
        )

    async def run(self) -> None:
        tplan = self._transition_plan()
        for r in self.new_ranks:  # a number taken again: its dead predecessor is no longer news
            self.recovery.dead.pop(r, None)
        for c in self.world.clients.values():
            with_ws = await quiet(c.status(timeout=5))
            if isinstance(with_ws, dict):
                self.op.workspace_before[str(c.rank)] = with_ws.get("workspace_bytes", 0)
        world = dict(self.world.clients)
        try:
            if self.growing:
                world.update(await self._launch(tplan.new_layout))
            else:
                for r in self.leaving:
                    self.world.router.exclude(r)
            await self._prepare(world, tplan)
            if not self.growing:
                await self._drain(world)
            results = await self._commit(world)
        except RankCallFailed as e:
            raise TransitionFailed(
                f"phase {self.op.phase} failed on rank {e.rank}: {short_error(e.error)}",
                detail={"phase": self.op.phase, "rank": e.rank},
            ) from None
        await self._adopt(world, results, tplan.new_layout, tplan.rdzv.epoch)

    async def _launch(self, layout: ExpertLayout) -> dict[int, RankClient]:
        self.world.enter_phase(self.op, Phase.LAUNCH.value)
        t = time.time()
        spawned = await asyncio.gather(
            *(self.spawner.spawn(r, layout, True) for r in self.new_ranks), return_exceptions=True
        )
        # Keep every rank that did start (the rollback stops them) before failing on one that did not.
        self.joiners.update({r: c for r, c in zip(self.new_ranks, spawned) if not isinstance(c, BaseException)})
        for r, c in zip(self.new_ranks, spawned):
            if isinstance(c, BaseException):
                raise TransitionFailed(f"launch of rank {r} failed: {short_error(c)}")
        self.world.phase_done(self.op, Phase.LAUNCH.value, t, ranks=sorted(self.joiners))
        return dict(self.joiners)

    async def _prepare(self, world: dict[int, RankClient], tplan: TransitionPlan) -> None:
        self.world.enter_phase(self.op, Phase.PREPARE.value)
        t = time.time()
        prepared = await World.call_all(world, "prepare", lambda c: c.prepare(tplan, timeout=self.timeout_s))
        # What each rank's expert pre-copy holds until the commit (or the rollback) frees it.
        self.op.move_memory = {
            str(r): {"spare_bytes": int(res.get("spare_bytes", 0)), "held_since": t}
            for r, res in sorted(prepared.items())
            if isinstance(res, dict)
        }
        self.prepared = {str(r): res for r, res in prepared.items() if isinstance(res, dict)}
        self.world.phase_done(self.op, Phase.PREPARE.value, t)

    async def _drain(self, world: dict[int, RankClient]) -> None:
        """Let removing ranks finish their requests; whatever is left moves at commit."""
        self.world.enter_phase(self.op, Phase.DRAIN.value)
        t = time.time()
        removing = {r: c for r, c in world.items() if r not in self.new_members}
        await World.call_all(removing, "begin_drain", lambda c: c.begin_drain(self.plan.op_id, timeout=self.timeout_s))
        deadline = time.time() + self.drain_timeout_s
        while time.time() < deadline:
            busy = 0
            for r in sorted(removing):
                st = await quiet(self.world.clients[r].status(timeout=5))
                if isinstance(st, dict):
                    busy += st.get("requests_running", 0) + st.get("requests_waiting", 0)
            if busy == 0:
                break
            await asyncio.sleep(0.1)
        self.world.phase_done(self.op, Phase.DRAIN.value, t)

    async def _commit(self, world: dict[int, RankClient]) -> dict[int, Any]:
        self.world.enter_phase(self.op, Phase.COMMIT.value)
        t = time.time()
        self.commit_started = True
        op_id, timeout_s = self.plan.op_id, self.timeout_s
        old_world = {r: c for r, c in world.items() if r in self.old_members}
        await World.call_all(old_world, "request_commit", lambda c: c.request_commit(op_id, timeout=30))
        results = await World.call_all(world, "wait_op", lambda c: c.wait_op(op_id, timeout_s, timeout=timeout_s + 5))
        self.world.phase_done(self.op, Phase.COMMIT.value, t)
        return results

    async def _adopt(
        self, world: dict[int, RankClient], results: dict[int, Any], layout: ExpertLayout, epoch: int
    ) -> None:
        """Commit succeeded everywhere: adopt the new world, re-submit moved requests, stop leavers."""
        op, w = self.op, self.world
        moved: list[dict[str, Any]] = []
        for r, res in results.items():
            moved.extend(res.get("moved", []))
            if r in self.new_members:
                op.captures_per_rank[str(r)] = int(res.get("captures_this_op", 0))
                op.workspace_after[str(r)] = int(res.get("workspace_after", 0))
                op.serving_pause_s = max(op.serving_pause_s, float(res.get("pause_s", 0.0)))
            if str(r) in op.move_memory and isinstance(res.get("move_memory"), dict):
                op.move_memory[str(r)].update(res["move_memory"])
        if self.plan.cost:  # predicted beside measured, for `eepctl events`
            op.cost = {"predicted": self.plan.cost, "measured": measured(to_builtins(op), self.prepared)}
            op.cost["error"] = relative_errors(op.cost["predicted"], op.cost["measured"])
            op.cost["within_range"] = within_range(op.cost["predicted"], op.cost["measured"])
        leaving = {r: c for r, c in world.items() if r not in self.new_members}
        w.adopt({r: world[r] for r in self.new_members}, layout, epoch)
        if moved:
            await w.router.resubmit(moved)
        w.enter_phase(op, Phase.CLEANUP.value)
        t = time.time()
        if self.growing:  # the joiners take their share of the requests queued on the old ranks
            op.redispatched_requests = await redispatch(w, self.old_members, len(self.new_members))
        for r, c in leaving.items():
            await quiet(c.kill())
            w.forget_rank(r)
        w.phase_done(
            op,
            Phase.CLEANUP.value,
            t,
            removed=sorted(leaving),
            moved_requests=len(moved),
            redispatched_requests=op.redispatched_requests,
        )

    async def recover(self) -> None:
        """Before commit: roll back (drop joiners and standby groups, keep serving).
        From commit on: drop the joiners and have the recovery rebuild the members' world,
        restoring every expert slot (weights may be half moved). Either way the operation
        records each rank's state: the deployment stays explainable."""
        w, op = self.world, self.op
        for r in w.members:
            if r not in self.recovery.dead:
                w.router.include(r)
        if not self.commit_started:
            op.phase_durations.setdefault(Phase.ROLLBACK.value, 0.0)
            t = time.time()
            for c in list(w.clients.values()):
                await quiet(c.abort(op.op_id, timeout=10))
            await self._stop_joiners()
            for held in op.move_memory.values():  # the ranks' abort freed their spare buffers
                held.setdefault("freed_at", time.time())
                held.setdefault("freed_by", "rollback")
            if op.state == OpState.FAILED.value:
                op.state = OpState.ROLLED_BACK.value
            w.phase_done(op, Phase.ROLLBACK.value, t)
        else:
            await self._stop_joiners()
            self.recovery.rebuild(f"{op.op_id} failed after commit began", untrusted=True)
        op.rank_states.update(await w.rank_states())

    async def _stop_joiners(self) -> None:
        for r, c in self.joiners.items():
            await quiet(c.kill())  # joining ranks were launched by this run
            self.world.forget_rank(r)
