"""Deployment control shared by the Ray controller and the process launcher: start, plan,
scale (single flight) and stop.

It talks to ranks only through ``RankClient`` (the typed ``RankControl`` calls), so the same
logic drives Ray actors and plain processes. The state it changes lives in ``World``
(engine_ext.control.world), shared with the recovery through that class's methods; a scale is
admitted in ``Admission`` (engine_ext.control.admission) and run by ``ScaleRun``
(engine_ext.control.scale_run).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from engine_ext.config import EngineConfig, RankFailurePolicy
from engine_ext.control.admission import Admission, Admitted
from engine_ext.control.rank_client import RankClient
from engine_ext.control.recovery import Growth, Recovery
from engine_ext.control.router import Router
from engine_ext.control.scale_plan import ScalePlan
from engine_ext.control.scale_run import ScaleRun
from engine_ext.control.spawner import Spawner
from engine_ext.control.world import EventSink, World, quiet, short_error
from engine_ext.elastic.eplb import ExpertLayout, build_layout, min_world_size
from engine_ext.elastic.transition_plan import new_op_id
from engine_ext.protocol import Event, Operation, OpState, PreconditionError, to_builtins

__all__ = ["Orchestrator", "Spawner"]  # Spawner: engine_ext.control.spawner


class Orchestrator:
    """Owns one deployment's ranks and runs its transitions, one at a time (I9)."""

    def __init__(
        self,
        name: str,
        cfg: EngineConfig,
        spawner: Spawner,
        *,
        max_dp: int,
        emit: EventSink | None = None,
        record_op: Callable[[dict[str, Any]], Any] | None = None,
        forget_rank: Callable[[int], Any] | None = None,
        on_rank_failure: str = RankFailurePolicy.REPLACE,
    ) -> None:
        self.name = name
        self.cfg = cfg
        self.spawner = spawner
        self.max_dp = max_dp
        self.on_rank_failure = RankFailurePolicy.parse(on_rank_failure, "on_rank_failure")
        self.desired = 0  # the size asked for last; policy replace grows back to it after a death
        self.world = World(name, emit=emit, record_op=record_op, forget_rank=forget_rank)
        self.recovery = Recovery(self.world, cfg, self.regrow)
        self.admission = Admission(self.world, cfg, spawner, self.recovery, max_dp)
        self.fenced_clients: dict[int, RankClient] = {}  # to tell (and end) a fenced rank that comes back

    # ---- the world, read-only (World owns it) --------------------------------------------------
    @property
    def size(self) -> int:
        return self.world.size

    @property
    def members(self) -> list[int]:
        return self.world.members

    @property
    def clients(self) -> dict[int, RankClient]:
        return self.world.clients

    @property
    def layout(self) -> ExpertLayout | None:
        return self.world.layout

    @property
    def router(self) -> Router:
        return self.world.router

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.world.history

    def busy(self) -> str | None:
        """The operation holding the single-flight lock, if any (I9)."""
        return self.world.busy()

    def running_op(self) -> Operation | None:
        return self.world.running_op()

    def check_target(self, size: int) -> None:
        self.admission.check_target(size)

    # ---- start -------------------------------------------------------------------------------
    async def start(self, size: int, timeout_s: float = 300.0) -> None:
        self.check_target(size)
        reason = self.spawner.check_capacity(size)
        if reason:
            raise PreconditionError(reason)
        await self.form_world(size, "startup", timeout_s)
        self.desired = size

    async def form_world(self, size: int, op_id: str, timeout_s: float) -> None:
        """Launch ranks 0..size-1 from the weight source, form their group, warm, capture and
        serve them, and adopt them as the world (start, and a rebuild from nothing)."""
        w = self.world
        layout = build_layout(self.cfg.num_experts, self.cfg.slots_per_rank, size)
        rank0 = await self.spawner.spawn(0, layout, False)
        clients = {0: rank0}
        try:
            w.move_store(await rank0.host_store(), 0)
            # the other ranks launch together: their start-ups (imports, engine build) overlap
            rest = await asyncio.gather(
                *(self.spawner.spawn(r, layout, False) for r in range(1, size)), return_exceptions=True
            )
            clients.update({r: c for r, c in enumerate(rest, 1) if not isinstance(c, BaseException)})
            failed = next((c for c in rest if isinstance(c, BaseException)), None)
            if failed is not None:
                raise failed
            rdzv = w.rendezvous(op_id)
            await World.call_all(clients, "join", lambda c: c.join(rdzv, size, timeout=timeout_s))
            await World.call_all(clients, "warm_and_capture", lambda c: c.warm_and_capture(op_id, timeout=timeout_s))
            await World.call_all(clients, "serve", lambda c: c.serve(timeout=60))
        except BaseException:
            for c in clients.values():
                await quiet(c.kill())
            raise
        w.adopt(clients, layout, rdzv.epoch)

    # ---- planning and scaling ------------------------------------------------------------------
    async def plan(self, target: int, op_id: str | None = None, retire: list[int] | None = None) -> ScalePlan:
        """What a scale to ``target`` would do (``--dry-run``); admits nothing."""
        self.check_target(target)
        return await self.admission.compose(target, op_id, retire)

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
        """Admit a scale (engine_ext.control.admission); ``run`` it next, which releases the lock."""
        return await self.admission.admit(
            target, op_id=op_id, settle=settle, probe_ranks=probe_ranks, retire=retire, cause=cause
        )

    async def run(
        self, admitted: Admitted, *, drain_timeout_s: float = 30.0, timeout_s: float = 300.0
    ) -> dict[str, Any]:
        """Run an admitted scale to its end; the operation record says how it ended."""
        w, plan, op = self.world, admitted.plan, admitted.op
        try:
            desired_before, self.desired = self.desired, plan.to_size
            if plan.noop:
                op.state, op.finished = OpState.SUCCEEDED.value, time.time()
                op.error = f"already at DP {plan.to_size}; nothing to do"
                w.record(op)
                return to_builtins(op)
            w.op = op
            w.record(op)
            try:
                await ScaleRun(
                    w, self.spawner, self.recovery, plan, op, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s
                ).execute()
            finally:
                op.finished = time.time()
                if op.state != OpState.SUCCEEDED.value:
                    # A failed scale leaves the desired size as it was: policy `replace` must not
                    # retry, after the recovery, a size that has just failed.
                    self.desired = desired_before
                w.record(op)
                # what it cost teaches the deployment's own cost model (engine_ext.control.cost_learn)
                self.admission.learned.observe(to_builtins(op), str(self.cfg.capture_policy), self.admission.device)
            return to_builtins(op)
        finally:
            w.op_lock.release()

    async def scale(
        self,
        target: int,
        *,
        drain_timeout_s: float = 30.0,
        timeout_s: float = 300.0,
        op_id: str | None = None,
        retire: list[int] | None = None,
        cause: str = "",
    ) -> dict[str, Any]:
        """Admit and run a scale to ``target`` ranks (``cause``: why the controller starts it, the
        operation record's); raises when it is not admitted."""
        admitted = await self.admit(target, op_id=op_id, retire=retire, cause=cause)
        return await self.run(admitted, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s)

    def growth_target(self) -> int:
        """The size policy ``replace`` grows back to now; 0 when no growth is due (policy shrink,
        stopping, at the desired size, no serving rank, or another operation holds the lock)."""
        w = self.world
        target = min(self.desired, self.max_dp)
        if (
            self.on_rank_failure != RankFailurePolicy.REPLACE
            or w.stopping
            or target <= w.size
            or not w.router.clients
            or w.op_lock.locked()
        ):
            return 0
        return target

    async def regrow(self) -> Growth:
        """Policy ``replace``'s one growth path, taken after a recovery and by the reconcile loop:
        a normal scale to ``growth_target()`` once the new ranks can be placed. No scale starts
        without capacity or when admission refuses it (the reconcile loop says why and retries)."""
        w, target = self.world, self.growth_target()
        if not target:
            return Growth()
        reason = self.spawner.check_capacity(target - w.size)
        if reason:
            return Growth(target, no_capacity=reason)
        try:
            return Growth(target, op=await self.scale(target, cause="replace"))
        except PreconditionError as e:
            return Growth(target, refused=e.message)

    # ---- health: fence, rebuild ---------------------------------------------------------------
    async def fence(self, rank: int, reason: str) -> None:
        """Exclude an unhealthy member by epoch, tell it so when it can hear, end its process
        when it can be reached, and recover the world without it."""
        w = self.world
        client = w.clients.get(rank)
        if client is None or rank in w.fenced and rank in self.recovery.dead:
            return
        epoch = w.fence(rank, reason)
        self.fenced_clients[rank] = client
        now = time.time()
        w.emit(
            to_builtins(
                Event(
                    w.op.op_id if w.op is not None else "",
                    rank,
                    "fence",
                    now,
                    now,
                    "ok",
                    {"epoch": epoch, "reason": reason},
                )
            )
        )
        asyncio.ensure_future(quiet(client.fence(epoch, reason, timeout=2)))  # a hung rank never answers
        # Not awaited: a rank cut off by a partition dies only when its node is reachable again,
        # and the recovery without it must not wait for that.
        asyncio.ensure_future(quiet(client.kill()))
        self.recovery.on_death(rank, f"fenced at epoch {epoch}: {reason}")

    def refence(self, rank: int) -> None:
        """A fenced rank was heard from (it came back: SIGCONT, a healed partition): tell it
        again and end it again, at most every few seconds."""
        client = self.fenced_clients.get(rank)
        fenced = self.world.fenced.get(rank)
        if client is None or fenced is None or time.time() - fenced.get("told", 0.0) < 3.0:
            return
        fenced["told"] = time.time()
        asyncio.ensure_future(quiet(client.fence(int(fenced["epoch"]), str(fenced["reason"]), timeout=2)))
        asyncio.ensure_future(quiet(client.kill()))

    async def rebuild(self, reason: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """No healthy world is left (every member dead, or a recovery that failed): launch the
        desired size afresh from the weight source, as a recorded ``rebuild`` operation. Requests
        wait in the router meanwhile and resume, with their tokens so far, on the new world."""
        w = self.world
        async with w.op_lock:
            size = max(self.desired, min_world_size(self.cfg.num_experts, self.cfg.slots_per_rank))
            size = min(size, self.max_dp)
            old = list(w.members)
            op = Operation(
                new_op_id(), self.name, len(old), size, kind="rebuild", dead_ranks=old, plan={"reason": reason}
            )
            w.op = op
            w.router.pause()
            w.router.reroute(set(old))  # what the old ranks held continues on the new world
            op.rerouted_requests = w.router.rerouted - self.recovery.rerouted_base
            w.record(op)
            t = time.time()
            try:
                for r in old:
                    await quiet(w.clients[r].kill())
                    w.forget_rank(r)
                await asyncio.wait_for(self.form_world(size, op.op_id, timeout_s), timeout_s)
                self.recovery.dead.clear()
                self.recovery.failed_reason = ""
                w.phase_done(op, "rebuild", t, members=list(w.members))
                op.state = OpState.SUCCEEDED.value
                await w.router.resume()
            except Exception as e:  # noqa: BLE001 - recorded; the reconcile loop retries with backoff
                op.state, op.error_code = OpState.FAILED.value, 5
                op.error = f"rebuild failed: {type(e).__name__}: {short_error(e)}"
                w.router.unhealthy = f"no healthy rank; {op.error}"
            finally:
                op.finished = time.time()
                self.recovery.rerouted_base = w.router.rerouted
                w.record(op)
            return to_builtins(op)

    # ---- stop --------------------------------------------------------------------------------
    async def stop(self) -> None:
        await self.world.stop()
