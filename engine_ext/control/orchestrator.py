"""Deployment control shared by the Ray controller and the process launcher: start, plan,
scale (single flight) and stop.

It talks to ranks only through ``RankClient`` (the typed ``RankControl`` calls), so the same
logic drives Ray actors and plain processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from engine_ext.elastic.eplb import ExpertLayout, build_layout, min_world_size
from engine_ext.elastic.rendezvous import Rendezvous
from engine_ext.elastic.transition_plan import TransitionPlan, new_op_id
from engine_ext.config import EngineConfig
from engine_ext.control.rank_client import RankClient
from engine_ext.control.router import Router
from engine_ext.capture_memory import policy_memory
from engine_ext.control.scale_plan import ScalePlan, plan_scale
from engine_ext.control.standby_pool import mark_pool_joiners
from engine_ext.protocol import (
    EepError,
    Event,
    Operation,
    OpState,
    Phase,
    PreconditionError,
    TransitionFailed,
    UsageError,
    to_builtins,
)


class Spawner(Protocol):
    async def spawn(self, rank: int, layout: ExpertLayout, joining: bool) -> RankClient: ...

    def check_capacity(self, new_ranks: int) -> str | None:
        """None if the cluster can host ``new_ranks`` more ranks, else the reason."""


EventSink = Callable[[dict[str, Any]], None]
RankCall = Callable[[RankClient], Awaitable[Any]]


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
        on_rank_failure: str = "replace",
    ) -> None:
        self.name = name
        self.cfg = cfg
        self.spawner = spawner
        self.max_dp = max_dp
        self.clients: dict[int, RankClient] = {}
        self.router = Router()
        self.layout: ExpertLayout | None = None
        self.store: tuple[str, int] | None = None
        self.epoch = 0
        self.emit = emit or (lambda e: None)
        self.record_op = record_op or (lambda op: None)
        self.forget_rank = forget_rank or (lambda rank: None)
        self.op: Operation | None = None
        self._op_lock = asyncio.Lock()
        # Per-operation facts the failure path needs: did commit start, which ranks did it launch.
        self._commit_started = False
        self._joiners: dict[int, RankClient] = {}
        self.history: list[dict[str, Any]] = []
        # Membership: global ranks (identities, never renamed) in position order; joiners get
        # fresh global ranks, so a dead rank's name is never reused.
        self.members: list[int] = []
        self.next_rank = 0
        self.store_host = 0
        self.stopping = False
        self.desired = 0
        self.on_rank_failure = on_rank_failure
        from engine_ext.control.recovery import Recovery

        self.recovery = Recovery(self)

    @property
    def size(self) -> int:
        return len(self.clients)

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

    # ---- start -------------------------------------------------------------------------------
    async def start(self, size: int, timeout_s: float = 300.0) -> None:
        self.check_target(size)
        reason = self.spawner.check_capacity(size)
        if reason:
            raise PreconditionError(reason)
        self.layout = build_layout(self.cfg.num_experts, self.cfg.slots_per_rank, size)
        rank0 = await self.spawner.spawn(0, self.layout, False)
        clients = {0: rank0}
        try:
            self.store = await rank0.host_store()
            for r in range(1, size):
                clients[r] = await self.spawner.spawn(r, self.layout, False)
            rdzv = self._rdzv("start")
            await self._all(clients, "join", lambda c: c.join(rdzv, size, timeout=timeout_s))
            await self._all(clients, "warm_and_capture", lambda c: c.warm_and_capture("startup", timeout=timeout_s))
            await self._all(clients, "serve", lambda c: c.serve(timeout=60))
        except BaseException:
            for c in clients.values():
                await _quiet(c.kill())
            raise
        self.clients = clients
        self.members = list(range(size))
        self.next_rank = size
        self.store_host = 0
        self.desired = size
        self.router.set_ranks(clients)

    def _rdzv(self, tag: str) -> Rendezvous:
        assert self.store is not None
        self.epoch += 1
        return Rendezvous(self.store[0], self.store[1], f"{self.name}/e{self.epoch}-{tag}")

    async def _all(self, clients: dict[int, RankClient], method: str, call: RankCall) -> dict[int, Any]:
        """``call`` every rank; fail on the first error instead of waiting for the others (a dead
        joiner must not keep the survivors' rollback waiting for a rendezvous timeout)."""
        tasks = {asyncio.ensure_future(call(clients[r])): r for r in sorted(clients)}
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                for t in pending:
                    t.cancel()
                first = min(failed, key=lambda t: tasks[t])
                raise _RankError(tasks[first], method, first.exception(), {tasks[t]: t.exception() for t in failed})
        return {r: t.result() for t, r in tasks.items()}

    # ---- planning ----------------------------------------------------------------------------
    async def _loads(self) -> list[float]:
        total = [0.0] * self.cfg.num_experts
        for c in self.clients.values():
            try:
                st = await c.status(timeout=5)
            except Exception:
                continue
            for e, v in enumerate(st.get("eplb_logical_load", [])):
                total[e] += v
        return total

    async def plan(self, target: int, op_id: str | None = None) -> ScalePlan:
        self.check_target(target)
        assert self.layout is not None
        loads = [] if target == self.size else await self._loads()
        plan = plan_scale(op_id or new_op_id(), self.cfg.instance_id or self.name, self.layout, target, loads,
                          self.members, max(self.members, default=-1) + 1)
        plan.capture_memory = policy_memory(self.cfg, target, self.max_dp)  # what reuse costs at the target
        mark_pool_joiners(plan, getattr(self.spawner, "pool", None))  # engine/standby_pool.py
        return plan

    # ---- scale -------------------------------------------------------------------------------
    def busy(self) -> str | None:
        """The id of the operation holding the single-flight lock, if any (I9)."""
        running = self.running_op()
        if running is not None:
            return f"{running.op_id} (DP {running.from_size}->{running.to_size})"
        return "an operation being planned" if self._op_lock.locked() else None

    def running_op(self) -> Operation | None:
        return self.op if self.op is not None and self.op.state == OpState.RUNNING.value else None

    async def scale(self, target: int, *, drain_timeout_s: float = 30.0, timeout_s: float = 300.0,
                    op_id: str | None = None) -> dict[str, Any]:
        busy = self.busy()
        if busy is not None:
            raise PreconditionError(f"a scale is already running: {busy}; one at a time")
        desired_before, self.desired = self.desired, target
        async with self._op_lock:
            plan = await self.plan(target, op_id)
            op = Operation(plan.op_id, self.name, plan.from_size, plan.to_size, plan=plan.to_dict())
            if plan.noop:
                op.state, op.finished = OpState.SUCCEEDED.value, time.time()
                op.error = f"already at DP {target}; nothing to do"
                self._record(op)
                return to_builtins(op)
            reason = self.spawner.check_capacity(max(0, target - self.size))
            if reason:
                raise PreconditionError(reason)
            self.op = op
            self._record(op)
            try:
                await asyncio.wait_for(self._run(plan, op, drain_timeout_s, timeout_s), timeout=timeout_s)
                op.state = OpState.SUCCEEDED.value
            except asyncio.TimeoutError:
                op.state, op.error_code = OpState.TIMED_OUT.value, 6
                op.error = f"timed out after {timeout_s:.0f}s in phase {op.phase}"
                await self._recover(op)
            except EepError as e:
                op.state, op.error_code, op.error = OpState.FAILED.value, int(e.exit_code), e.message
                await self._recover(op)
            except Exception as e:  # noqa: BLE001 - every failure must be reported, not raised raw
                op.state, op.error_code = OpState.FAILED.value, 5
                op.error = f"{type(e).__name__}: {e}"
                await self._recover(op)
            finally:
                op.finished = time.time()
                if op.state != OpState.SUCCEEDED.value:
                    # A failed scale leaves the desired size as it was: policy `replace` must not
                    # retry, after the recovery, a size that has just failed.
                    self.desired = desired_before
                self._record(op)
            return to_builtins(op)

    def _record(self, op: Operation) -> None:
        d = to_builtins(op)
        if not self.history or self.history[-1]["op_id"] != op.op_id:
            self.history.append(d)
        else:
            self.history[-1] = d
        self.history = self.history[-100:]
        self.record_op(d)

    def _phase(self, op: Operation, phase: Phase, start: float, **detail: Any) -> None:
        end = time.time()
        op.phase_durations[phase.value] = round(op.phase_durations.get(phase.value, 0.0) + end - start, 6)
        self.emit(to_builtins(Event(op.op_id, -1, phase.value, start, end, "ok", detail)))
        self._record(op)

    async def _run(self, plan: ScalePlan, op: Operation, drain_timeout_s: float, timeout_s: float) -> None:
        assert self.layout is not None
        old_size, new_size = plan.from_size, plan.to_size
        new_layout = ExpertLayout.from_dict(plan.layout)
        rdzv = self._rdzv(plan.op_id)
        old_members = list(self.members)
        if new_size > old_size:
            # Joiners take the global ranks right after the last member: positions never move, and
            # numbers freed by a scale-down or a death are taken again (their actors are gone).
            self.next_rank = max(self.members, default=-1) + 1
            new_ranks = list(range(self.next_rank, self.next_rank + new_size - old_size))
            for r in new_ranks:  # a number taken again: its dead predecessor is no longer news
                self.recovery.dead.pop(r, None)
            self.next_rank += len(new_ranks)
            new_members = old_members + new_ranks
        else:
            new_ranks, new_members = [], old_members[:new_size]
        tplan = TransitionPlan(op_id=plan.op_id, kind="scale_up" if new_size > old_size else "scale_down",
                               old_size=old_size, new_size=new_size, rdzv=rdzv, old_layout=self.layout,
                               new_layout=new_layout, timeout_s=timeout_s,
                               old_members=tuple(old_members), new_members=tuple(new_members))
        for c in self.clients.values():
            with_ws = await _quiet(c.status(timeout=5))
            if isinstance(with_ws, dict):
                op.workspace_before[str(c.rank)] = with_ws.get("workspace_bytes", 0)
        joiners: dict[int, RankClient] = {}
        world = dict(self.clients)
        self._commit_started = False
        self._joiners = joiners
        try:
            if new_size > old_size:
                op.phase = Phase.LAUNCH.value
                t = time.time()
                spawned = await asyncio.gather(
                    *(self.spawner.spawn(r, new_layout, True) for r in new_ranks),
                    return_exceptions=True)
                # Keep every rank that did start (the rollback stops them) before failing on one that did not.
                joiners.update({r: c for r, c in zip(new_ranks, spawned)
                                if not isinstance(c, BaseException)})
                for r, c in zip(new_ranks, spawned):
                    if isinstance(c, BaseException):
                        raise TransitionFailed(f"launch of rank {r} failed: {_short(c)}")
                self._phase(op, Phase.LAUNCH, t, ranks=sorted(joiners))
                world.update(joiners)
            else:
                for r in old_members[new_size:]:
                    self.router.excluded.add(r)
            op.phase = Phase.PREPARE.value
            t = time.time()
            await self._all(world, "prepare", lambda c: c.prepare(tplan, timeout=timeout_s))
            self._phase(op, Phase.PREPARE, t)
            if new_size < old_size:
                op.phase = Phase.DRAIN.value
                t = time.time()
                removing = {r: c for r, c in world.items() if r not in new_members}
                await self._all(removing, "begin_drain", lambda c: c.begin_drain(plan.op_id, timeout=timeout_s))
                await self._drain(sorted(removing), drain_timeout_s)
                self._phase(op, Phase.DRAIN, t)
            op.phase = Phase.COMMIT.value
            t = time.time()
            self._commit_started = True
            old_world = {r: c for r, c in world.items() if r in old_members}
            await self._all(old_world, "request_commit", lambda c: c.request_commit(plan.op_id, timeout=30))
            results = await self._all(world, "wait_op", lambda c: c.wait_op(plan.op_id, timeout_s, timeout=timeout_s + 5))
            self._phase(op, Phase.COMMIT, t)
        except _RankError as e:
            raise TransitionFailed(f"phase {op.phase} failed on rank {e.rank}: {_short(e.error)}",
                                   detail={"phase": op.phase, "rank": e.rank}) from None
        # Commit succeeded everywhere: adopt the new world.
        moved: list[dict[str, Any]] = []
        for r, res in results.items():
            moved.extend(res.get("moved", []))
            if r in new_members:
                op.captures_per_rank[str(r)] = int(res.get("captures_this_op", 0))
                op.workspace_after[str(r)] = int(res.get("workspace_after", 0))
                op.serving_pause_s = max(op.serving_pause_s, float(res.get("pause_s", 0.0)))
        leaving = {r: c for r, c in world.items() if r not in new_members}
        self.clients = {r: world[r] for r in new_members}
        self.members = list(new_members)
        self.layout = new_layout
        self.router.set_ranks(self.clients)
        if moved:
            await self.router.resubmit(moved)
        op.phase = Phase.CLEANUP.value
        t = time.time()
        for r, c in leaving.items():
            await _quiet(c.kill())
            self.forget_rank(r)
        self._phase(op, Phase.CLEANUP, t, removed=sorted(leaving), moved_requests=len(moved))

    async def _drain(self, ranks: list[int], timeout_s: float) -> None:
        """Let removing ranks finish their requests; whatever is left moves at commit."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            busy = 0
            for r in ranks:
                st = await _quiet(self.clients[r].status(timeout=5))
                if isinstance(st, dict):
                    busy += st.get("requests_running", 0) + st.get("requests_waiting", 0)
            if busy == 0:
                return
            await asyncio.sleep(0.1)

    async def _recover(self, op: Operation) -> None:
        """Before commit: roll back (drop joiners and standby groups, keep serving).
        During commit: report each rank's state; the deployment stays explainable."""
        commit_started = self._commit_started
        for r in self.members:
            if r not in self.recovery.dead:
                self.router.excluded.discard(r)
        if not commit_started:
            op.phase_durations.setdefault(Phase.ROLLBACK.value, 0.0)
            t = time.time()
            for r, c in list(self.clients.items()):
                await _quiet(c.abort(op.op_id, timeout=10))
            for r, c in self._joiners.items():
                await _quiet(c.kill())  # joining ranks were launched by this op
                self.forget_rank(r)
            if op.state == OpState.FAILED.value:
                op.state = OpState.ROLLED_BACK.value
            if self._joiners:  # their names are free again
                self.next_rank = min(self.next_rank, min(self._joiners))
            self._phase(op, Phase.ROLLBACK, t)
        else:
            # From commit on the world may be half switched: drop the joiners, and rebuild the
            # members' world, restoring every expert slot (weights may be half moved).
            for r, c in self._joiners.items():
                await _quiet(c.kill())
                self.forget_rank(r)
            self.recovery.rebuild(f"{op.op_id} failed after commit began", untrusted=True)
        for r, c in list(self.clients.items()):
            st = await _quiet(c.status(timeout=5))
            op.rank_states[str(r)] = st.get("state", "unreachable") if isinstance(st, dict) else "unreachable"

    # ---- preflight ---------------------------------------------------------------------------
    async def check_ranks(self, timeout_s: float = 3.0) -> None:
        """Refuse a transition (exit 4) when any current rank does not answer or has failed:
        a transition needs every rank of the old world, and a dead one would only end in a
        rollback after a rendezvous timeout."""
        ranks = sorted(self.clients)
        probes = await asyncio.gather(*(_quiet(self.clients[r].status(timeout=timeout_s)) for r in ranks))
        bad: list[str] = []
        for r, st in zip(ranks, probes):
            if not isinstance(st, dict):
                why = "did not answer in time" if isinstance(st, asyncio.TimeoutError) else f"is dead ({_short(st)})"
                bad.append(f"rank {r} {why}")
            elif st.get("state") == "failed":
                bad.append(f"rank {r} failed ({st.get('state_reason') or 'no reason given'})")
        if bad:
            raise PreconditionError(
                f"cannot scale {self.name!r}: {'; '.join(bad)}; a transition needs every current rank. "
                f"`eepctl repair --name {self.name}` rebuilds the world without it",
                detail={"bad_ranks": bad})

    # ---- stop --------------------------------------------------------------------------------
    async def stop(self) -> None:
        self.stopping = True
        for c in self.clients.values():
            await _quiet(c.stop(timeout=5))
        for c in self.clients.values():
            await _quiet(c.kill())
        self.clients = {}


class _RankError(Exception):
    def __init__(self, rank: int, method: str, error: BaseException, errors: dict[int, BaseException]) -> None:
        super().__init__(f"rank {rank} failed in {method}: {error}")
        self.rank, self.method, self.error, self.errors = rank, method, error, errors


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    last = text[-1] if text else type(e).__name__
    return last[:300]


async def _quiet(aw: Awaitable[Any]) -> Any:
    try:
        return await aw
    except Exception as e:  # noqa: BLE001 - best effort (cleanup, status probes)
        return e
