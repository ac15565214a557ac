"""Admission of a scale: the one place that decides whether a scale may run.

``Admission.admit`` checks, in this order, that no operation runs (I9), that a recovery under
way has finished and a degraded world has healed (when asked), that the target is in range
(and its MoE workspace leaves the KV budget room for one request),
that the cluster has room for the joiners and that every current rank answers (when asked).
It returns the admitted plan and operation while holding the world's single-flight lock, or
raises the ``EepError`` that says why not; the run that follows never checks again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_ext.capture_memory import kv_budget, kv_budget_error, policy_memory
from engine_ext.config import EngineConfig
from engine_ext.control.cost_learn import LearnedCost
from engine_ext.control.cost_model import predict
from engine_ext.control.scale_plan import ScalePlan, choose_leaving, plan_scale
from engine_ext.control.spawner import Spawner
from engine_ext.control.standby_pool import mark_pool_joiners
from engine_ext.control.world import World, quiet, short_error
from engine_ext.elastic.eplb import ExpertLayout, min_world_size
from engine_ext.elastic.precopy import expert_nbytes, plan_summary, precopy_fit_error, spare_room, split_moves
from engine_ext.elastic.transition_plan import new_op_id
from engine_ext.protocol import Operation, OpState, PreconditionError, UsageError

if TYPE_CHECKING:
    from engine_ext.control.recovery import Recovery


@dataclass
class Admitted:
    """A scale that may run: its plan and operation record. The world's lock is held for it."""

    plan: ScalePlan
    op: Operation


class Admission:
    """Admits scales to one deployment's world."""

    def __init__(self, world: World, cfg: EngineConfig, spawner: Spawner, recovery: Recovery, max_dp: int) -> None:
        self.world = world
        self.cfg = cfg
        self.spawner = spawner
        self.recovery = recovery
        self.max_dp = max_dp
        self.device = "cpu"  # the ranks' device kind: a cost model is only good for the one it was fitted on
        self.learned = LearnedCost()  # the cost model learned from this deployment's own scales

    async def admit(
        self,
        target: int,
        *,
        op_id: str | None = None,
        settle: bool = False,
        probe_ranks: bool = False,
        retire: list[int] | None = None,
        cause: str = "",
    ) -> Admitted:
        """Admit a scale to ``target`` ranks, or raise. ``settle``: first wait for a recovery under
        way and heal a degraded world. ``probe_ranks``: refuse when a current rank does not answer
        (a transition needs every rank of the old world). ``retire``: the ranks a scale-down removes."""
        if settle and self.world.busy() is None:  # a busy world is refused below, not waited for
            await self.settle_recovery()
        self.refuse_if_busy()
        self.check_target(target)
        await self.world.op_lock.acquire()  # free: nothing awaited since the last check
        try:
            plan = await self.compose(target, op_id, retire)
            op = Operation(plan.op_id, self.world.name, plan.from_size, plan.to_size, plan=plan.to_dict(), cause=cause)
            if not plan.noop:
                reason = self.spawner.check_capacity(
                    max(0, target - self.world.size), [int(j["rank"]) for j in plan.joining]
                )
                if reason:
                    raise PreconditionError(reason)
                if plan.precopy.get("problem"):  # a rank's expert buffers exceed even the commit's room
                    raise PreconditionError(plan.precopy["problem"], detail={"precopy": plan.precopy})
                if probe_ranks:
                    await self.check_ranks()
        except BaseException:
            self.world.op_lock.release()
            raise
        return Admitted(plan, op)

    def refuse_if_busy(self) -> None:
        busy = self.world.busy()
        if busy is not None:
            raise PreconditionError(f"a scale is already running: {busy}; one at a time")

    def check_target(self, size: int) -> None:
        if size < 1:
            raise UsageError(f"--dp must be >= 1, got {size}")
        if size > self.max_dp:
            raise PreconditionError(f"target DP size {size} is over this deployment's max DP {self.max_dp}")
        need = min_world_size(self.cfg.num_experts, self.cfg.slots_per_rank)
        if size < need:
            raise PreconditionError(
                f"{self.cfg.num_experts} experts at {self.cfg.slots_per_rank} slots per rank need at least {need} ranks"
            )
        # A world whose MoE workspace leaves no room for one request would form, report serving
        # and then admit nothing: every request would wait forever (found by benchmarks/curves.py).
        why = kv_budget_error(self.cfg, size)
        if why:
            raise PreconditionError(f"cannot run DP {size}: {why}", detail={"kv_budget": kv_budget(self.cfg, size)})

    async def settle_recovery(self) -> None:
        """A recovery under way finishes first; a degraded world (a member dead and not yet
        recovered) is healed before it is scaled."""
        await self.recovery.wait()
        if any(r in self.recovery.dead for r in self.world.members):
            healed = await self.recovery.recover()
            if healed.get("state") not in (None, OpState.SUCCEEDED.value):
                raise PreconditionError(
                    f"cannot scale {self.world.name!r}: its recovery {healed.get('op_id')} "
                    f"failed ({healed.get('error')}); see `eepctl events`"
                )

    async def compose(self, target: int, op_id: str | None = None, retire: list[int] | None = None) -> ScalePlan:
        """The plan to ``target`` ranks (``target`` already checked), re-balanced by the measured
        loads; a scale-down removes ``retire``, else the ranks with the least work (choose_leaving)."""
        w = self.world
        assert w.layout is not None
        if retire and target >= w.size:
            raise UsageError(f"--retire is for a scale-down; DP {w.size} -> {target} removes no rank")
        loads, work = ([], {}) if target == w.size else await self._loads()
        try:
            leaving = choose_leaving(list(w.members), target, work, retire, keep=w.store_host)
        except ValueError as e:
            raise PreconditionError(str(e)) from None
        plan = self._plan(op_id or new_op_id(), target, loads, leaving, work, retire)
        if not plan.noop and plan.precopy.get("problem") and any(loads):
            # Balancing by load may move a member's every slot; keeping what each member holds
            # moves only what the joiners (or the leavers' experts) need. The EPLB's own
            # rebalance (in place, later) can still balance; the scale should not be refused for it.
            kept = self._plan(plan.op_id, target, [], leaving, work, retire)
            if not kept.precopy.get("problem"):
                kept.precopy["balance_deferred"] = (
                    "kept each member's experts: the load-balanced layout's moves "
                    f"do not fit ({plan.precopy['problem']})"
                )
                plan = kept
        mark_pool_joiners(plan, self.spawner.pool)
        if not plan.noop:
            model, why = self.learned.choose(self.device)
            plan.cost = predict(
                plan.to_dict(),
                expert_nbytes(self.cfg),
                self.cfg.slots_per_rank,
                str(self.cfg.capture_policy),
                any(j.get("from_standby") for j in plan.joining),
                model,
                why,
            )
        return plan

    def _plan(
        self,
        op_id: str,
        target: int,
        loads: list[float],
        leaving: list[int],
        work: dict[int, tuple[float, float]],
        retire: list[int] | None,
    ) -> ScalePlan:
        w = self.world
        assert w.layout is not None
        plan = plan_scale(
            op_id,
            self.cfg.instance_id or w.name,
            w.layout,
            target,
            loads,
            w.members,
            max(w.members, default=-1) + 1,
            leaving,
        )
        for j in plan.leaving:  # why each leaves, for the dry run and the operation record
            requests, kv = work.get(j["rank"], (None, None))
            j.update(
                chosen_by="--retire" if retire else "least work",
                requests=requests if requests != float("inf") else None,
                kv_blocks_used=kv if kv != float("inf") else None,
            )
        plan.capture_memory = policy_memory(self.cfg, target, self.max_dp)  # what reuse costs at the target
        if not plan.noop:
            self._precopy(plan)
        return plan

    def _precopy(self, plan: ScalePlan) -> None:
        """Which expert moves the pre-copy makes and which wait for the commit (what fits a rank's
        spare room while serving; engine_ext/elastic/precopy.py), and why even the commit's room
        would not hold a rank's moves, if it would not."""
        w = self.world
        assert w.layout is not None
        old = list(w.members)
        gone = {int(j["rank"]) for j in plan.leaving}
        new = [m for m in old if m not in gone] + [int(j["rank"]) for j in plan.joining]
        per_rank, moves = split_moves(
            w.layout,
            ExpertLayout.from_dict(plan.layout),
            old,
            new,
            expert_nbytes(self.cfg),
            spare_room(self.cfg, w.size),
        )
        plan.precopy = plan_summary(per_rank, moves)
        problem = precopy_fit_error(self.cfg, w.size, per_rank)
        if problem:
            plan.precopy["problem"] = problem

    async def _loads(self) -> tuple[list[float], dict[int, tuple[float, float]]]:
        """The deployment's expert loads and each rank's work: (requests, KV blocks in use).
        A rank that does not answer counts as busy, so it is not chosen to leave for being quiet."""
        total = [0.0] * self.cfg.num_experts
        work: dict[int, tuple[float, float]] = {}
        for r, c in self.world.clients.items():
            try:
                st = await c.status(timeout=5)
            except Exception:  # noqa: BLE001 - a rank that does not answer is treated as busy
                work[r] = (float("inf"), float("inf"))
                continue
            for e, v in enumerate(st.get("eplb_logical_load", [])):
                total[e] += v
            work[r] = (
                float(st.get("requests_running", 0) + st.get("requests_waiting", 0)),
                float(st.get("kv_blocks_used", 0)),
            )
        return total, work

    async def check_ranks(self, timeout_s: float = 3.0) -> None:
        """Refuse a transition (exit 4) when any current rank does not answer or has failed:
        a transition needs every rank of the old world, and a dead one would only end in a
        rollback after a rendezvous timeout."""
        clients = self.world.clients
        ranks = sorted(clients)
        probes = await asyncio.gather(*(quiet(clients[r].status(timeout=timeout_s)) for r in ranks))
        bad: list[str] = []
        for r, st in zip(ranks, probes):
            if not isinstance(st, dict):
                why = (
                    "did not answer in time" if isinstance(st, asyncio.TimeoutError) else f"is dead ({short_error(st)})"
                )
                bad.append(f"rank {r} {why}")
            elif st.get("state") == "failed":
                bad.append(f"rank {r} failed ({st.get('state_reason') or 'no reason given'})")
        if bad:
            name = self.world.name
            raise PreconditionError(
                f"cannot scale {name!r}: {'; '.join(bad)}; a transition needs every current rank. "
                f"`eepctl repair --name {name}` rebuilds the world without it",
                detail={"bad_ranks": bad},
            )
