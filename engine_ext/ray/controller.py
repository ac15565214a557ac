"""The controller: a named, detached async actor per deployment, restarted by Ray when it dies.

It owns the rank actors, tells the ingresses the world (engine_ext.ray.ingress_link: requests
enter, are routed and answered there, never here), runs scale operations (so a transition
survives the eepctl process that asked for it) and runs the reconcile loop
(engine_ext.control.reconciler). Its state is durable (engine_ext.ray.durable): a restarted
controller re-attaches to the live ranks and settles what was running
(engine_ext.ray.controller_memory).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import ray
from engine_ext.config import EngineConfig
from engine_ext.control.orchestrator import Orchestrator
from engine_ext.control.reconciler import TICK_S, Reconciler
from engine_ext.control.request_ids import RequestIds
from engine_ext.faults import controller_holds
from engine_ext.protocol import EepError, PreconditionError, UnreachableError, error_record
from engine_ext.ray import placement
from engine_ext.ray.autoscale_host import AutoscaleHost, autoscale_round, autoscaler_metrics
from engine_ext.ray.completion_request import model_limits
from engine_ext.ray.controller_memory import forget_unheld_ranks, snapshot, sweep_orphans, take_over
from engine_ext.ray.durable import DurableState
from engine_ext.ray.ingress_link import IngressLink
from engine_ext.ray.registry_keeper import RegistryKeeper
from engine_ext.ray.spawner import RaySpawner
from engine_ext.ray.standby import make_pool


class Controller:
    def __init__(
        self,
        deployment: str,
        namespace: str,
        cfg_d: dict[str, Any],
        max_dp: int,
        cpus_per_rank: float,
        gpus_per_rank: float,
        placement_d: dict[str, Any] | None = None,
        on_rank_failure: str = "replace",
        standby: int = 0,
        health_deadline_s: float = 5.0,
        ingress: int = 1,
    ) -> None:
        self.deployment = deployment
        self.namespace = namespace
        self.cfg = EngineConfig.from_dict(cfg_d)
        self.keeper = RegistryKeeper(
            deployment,
            namespace,
            expected_ranks=lambda: len(self.orch.clients),
            restore=lambda: (self._info, list(self.orch.history), list(self._emitted)),
        )
        self.spawner = RaySpawner(
            deployment,
            namespace,
            self.cfg,
            cpus_per_rank,
            gpus_per_rank,
            placement.PlacementSpec.from_dict(placement_d),
        )
        self.orch = Orchestrator(
            deployment,
            self.cfg,
            self.spawner,
            max_dp=max_dp,
            emit=self._emit,
            record_op=self._record_op,
            forget_rank=self._forget_rank,
            on_rank_failure=on_rank_failure,
        )
        self.spawner.on_death = self._on_death
        self.orch.admission.device = "cuda" if gpus_per_rank > 0 else "cpu"  # the cost model's host check
        self.orch.world.router = IngressLink(
            deployment,
            namespace,
            ingress,
            fenced=lambda: {  # type: ignore[assignment]
                r: int(f["epoch"]) for r, f in self.orch.world.fenced.items()
            },
            seen=lambda r, at: self.reconciler.health.heard(r, at),
            limits=model_limits(self.cfg),
        )
        self._tasks: dict[str, asyncio.Task] = {}
        self.spawner.pool = (
            make_pool(self.spawner, self.orch.world, self._forget_rank, standby) if standby > 0 else None
        )
        self._pool_watch: asyncio.Task | None = None
        self.started_at = time.time()
        # Registry recreation: what a new registry must be given back (info, ops, own events).
        self._info: dict[str, Any] = {}
        self._emitted: deque[dict[str, Any]] = deque(maxlen=2000)
        self.reconciler = Reconciler(
            self.orch,
            deadline_s=health_deadline_s,
            on_tick=self._persist,
            sweep=self._sweep_orphans,
            autoscale=self._autoscale,
        )
        self.durable = DurableState(namespace, deployment)
        self.restarts = 0
        self.requests = RequestIds()  # `scale --request-id`
        self.took_over: list[str] = []  # what a restarted controller did first
        self._published: dict[str, Any] = {}
        self.info_sent = 0  # set_info calls (only when what status shows changed)
        self._ready = asyncio.Event()  # set once started, or once a restarted controller took over
        saved = self.durable.load()
        self.autoscale_host = AutoscaleHost(
            deployment,
            max_dp,
            persist=lambda st: self._persist(),
            saved=(saved or {}).get("autoscale"),
            metrics=autoscaler_metrics(deployment),
        )
        if saved is not None and saved.get("started"):
            self._resuming = asyncio.get_event_loop().create_task(self._take_over(saved))
        try:
            from engine_ext.ray.metrics import DeploymentMetrics

            self._metrics: Any = DeploymentMetrics(deployment)
        except Exception:  # noqa: BLE001 - metrics are best effort
            self._metrics = None

    def _emit(self, event: dict[str, Any]) -> None:
        self._emitted.append(event)
        self._persist()
        try:
            self.keeper.handle().report_events.remote([event])
        except Exception:
            pass

    def _record_op(self, op: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.on_operation(op, self.orch.size)
        if op.get("finished"):  # size, desired size and dead ranks as `eepctl status` shows them
            self._info_dead()
        self._persist()
        try:
            self.keeper.handle().record_operation.remote(op)
        except Exception:
            pass

    def _forget_rank(self, rank: int) -> None:
        try:
            self.keeper.handle().forget_rank.remote(rank)
        except Exception:
            pass

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, size: int, timeout_s: float = 300.0) -> dict[str, Any]:
        try:
            await self.orch.start(size, timeout_s)
        except EepError as e:
            return error_record(e)
        self._ready.set()
        self._persist()
        self.reconciler.start()
        try:
            self._info = dict((await self.keeper.registry.snapshot.remote()).get("info") or {})
        except Exception:  # noqa: BLE001 - recreation then restores what the controller knows
            self._info = {"max_dp": self.orch.max_dp, "config": self.cfg.to_dict()}
        self.keeper.start()
        if self.spawner.pool is not None:
            await self.set_standby(self.spawner.pool.size)
        return await self.info()

    async def set_standby(self, count: int) -> dict[str, Any]:
        """``eepctl standby --count``: keep ``count`` ranks launched ahead (0 stops them)."""
        if self.spawner.pool is None:
            self.spawner.pool = make_pool(self.spawner, self.orch.world, self._forget_rank, count)
        await self.spawner.pool.resize(count)
        if self._pool_watch is None:
            self._pool_watch = asyncio.ensure_future(self.spawner.pool.watch(2.0))
        return self.spawner.pool.summary()

    def writes(self) -> dict[str, int]:
        """How often this controller wrote its durable state and published status (idle: never)."""
        return {"durable": self.durable.writes, "set_info": self.info_sent}

    def pid(self) -> int:
        import os

        return os.getpid()

    def tick_record(self) -> dict[str, Any]:
        """The reconcile loop's own record: how long each recent tick took, against its period."""
        r = self.reconciler
        return {"ticks": r.ticks, "tick_s": list(r.tick_seconds), "period_s": r.tick_s}

    async def info(self) -> dict[str, Any]:
        self._info_dead()
        return {
            "deployment": self.deployment,
            "dp": self.orch.size,
            "max_dp": self.orch.max_dp,
            "desired_dp": self.orch.desired,
            "on_rank_failure": str(self.orch.on_rank_failure),
            "dead": self._dead_shown(),
            "ranks": {str(r): c.pid() for r, c in self.orch.clients.items()},
            "running_op": self.orch.busy(),
            "layout": self.orch.layout.to_dict() if self.orch.layout else None,
            "config": self.cfg.to_dict(),
            "history": self.orch.history[-20:],
            "control": self._info.get("control", {}),
        }

    async def stop(self) -> None:
        self.reconciler.stop()
        self.durable.delete()  # `down`: nothing is left to take over
        self.orch.world.stopping = True
        self.keeper.stop()
        if self.spawner.pool is not None:
            if self._pool_watch is not None:
                self._pool_watch.cancel()
            await self.spawner.pool.stop()
        await self.orch.stop()

    # ---- autoscaling: the AutoscaleHost answers ------------------------------------------------
    def set_autoscale(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self.autoscale_host.set_autoscale(changes)

    def autoscale_show(self) -> dict[str, Any]:
        return self.autoscale_host.autoscale_show()

    def autoscale_decisions(self, since: float = 0.0, limit: int = 200) -> dict[str, Any]:
        return self.autoscale_host.autoscale_decisions(since, limit)

    # ---- serving: the ingresses hold the requests ---------------------------------------------
    def heard_fenced(self, rank: int) -> None:
        """An ingress dropped what a fenced rank sent (it came back): tell it again, end it again."""
        self.orch.refence(rank)

    # ---- self-healing --------------------------------------------------------------------------
    def _on_death(self, rank: int, cause: str) -> None:
        self.orch.recovery.on_death(rank, cause)
        self._info_dead()

    def _info_dead(self) -> None:
        """The registry's info carries desired size, policy, dead and fenced ranks and the
        reconcile loop's view (``eepctl status``); sent when it changed."""
        control = self.reconciler.view()
        for h in control["health"].values():
            h.pop("age_s", None)  # the registry shows heartbeat ages itself; this changes every tick
        extra = {
            "desired_dp": self.orch.desired,
            "on_rank_failure": str(self.orch.on_rank_failure),
            "members": list(self.orch.members),
            "dead": self._dead_shown(),
            "control_node": _this_node(),
            "standby_pool": self.spawner.pool.summary() if self.spawner.pool is not None else None,
            "control": {
                **control,
                "controller_restarts": self.restarts,
                "took_over": self.took_over,
                "stale_removed": self.spawner.stale_removed,
                "fenced_messages_dropped": self.orch.router.fenced_dropped,
                "stale_messages_dropped": self.orch.router.stale_dropped,
            },
            "ingress": self.orch.router.shown() or self._info.get("ingress", []),
        }
        self._info.update(extra)
        if self._info == self._published:
            return
        self._published = json_copy(self._info)
        self.info_sent += 1
        try:
            self.keeper.handle().set_info.remote(self._info)
        except Exception:  # noqa: BLE001 - telemetry is best effort
            pass

    def _persist(self) -> None:
        """Write the durable state (when it changed) and publish what status shows."""
        if not self._ready.is_set() or self.orch.world.stopping:
            return  # nothing to take over before start; `down` deletes it
        pool = self.spawner.pool
        self.durable.save(
            snapshot(
                self.orch,
                started=True,
                restarts=self.restarts,
                info=self._info,
                autoscale=self.autoscale_host.state(),
                standby=pool.size if pool is not None else 0,
                standby_next=pool.next_number if pool is not None else 0,
                requests=self.requests.recent(),
                events=list(self._emitted)[-300:],
            )
        )
        self._info_dead()

    async def _autoscale(self) -> list[str]:
        """One autoscaling round (a policy is set and not off): the decision moves the desired
        size through a normal scale; advisory decisions are only recorded."""
        host = self.autoscale_host
        self.reconciler.tick_s = host.period(TICK_S)  # faster while a policy is on and there is load
        if host.policy is None or str(host.policy.mode) == "off":
            return []

        async def act(decision: Any) -> dict[str, Any]:
            return await self.orch.scale(int(decision.recommendation), cause="autoscale")

        d = await autoscale_round(
            host,
            self.orch,
            act,  # the probe's answers: one status call per rank a tick
            statuses=self.reconciler.health.statuses(list(self.orch.members)),
            standby=self.set_standby,
        )
        self._info["autoscale"] = host.shown()  # changes when what status says does
        self.reconciler.tick_s = host.period(TICK_S)
        return [f"autoscale {d.id}: {d.action}"] if d is not None and d.act else []

    async def _sweep_orphans(self) -> list[str]:
        return await sweep_orphans(self.orch, self.spawner, self.namespace, self.deployment)

    async def _take_over(self, saved: dict[str, Any]) -> None:
        """This controller was restarted by Ray: take the deployment over from the durable state."""
        self.restarts = int(saved.get("restarts", 0)) + 1
        self._info = dict(saved.get("info") or {})
        self._emitted.extend(saved.get("events") or [])
        self.requests = RequestIds(saved.get("requests"))
        try:
            self.took_over = await take_over(self.orch, self.spawner, saved)
        except Exception as e:  # noqa: BLE001 - the loop rebuilds what could not be taken over
            self.reconciler.failed("take over", e)
        self.took_over += await forget_unheld_ranks(self.keeper.handle, set(self.orch.members))
        self._emit(
            {
                "op_id": "",
                "rank": -1,
                "phase": "controller_restarted",
                "start": time.time(),
                "end": time.time(),
                "outcome": "ok",
                "detail": {"restarts": self.restarts, "actions": self.took_over},
            }
        )
        self._ready.set()
        self._persist()
        self.keeper.start()
        if int(saved.get("standby", 0)) > 0:
            if self.spawner.pool is None:
                self.spawner.pool = make_pool(self.spawner, self.orch.world, self._forget_rank, int(saved["standby"]))
            # numbers go on from the dead controller's: an adopted standby still holds its name
            self.spawner.pool.next_number = max(self.spawner.pool.next_number, int(saved.get("standby_next", 0)))
            await self.set_standby(int(saved["standby"]))
        self.reconciler.start()

    def _dead_shown(self) -> list[dict[str, Any]]:
        """Dead ranks, shown until replaced (the size is back at the desired one)."""
        o = self.orch
        if o.size >= o.desired and o.running_op() is None:
            return []
        return list(o.recovery.dead.values())[-8:]

    async def repair(self) -> dict[str, Any]:
        """Bring the deployment to its desired state now, whatever is wrong (dead, failed,
        silent or degraded members, no healthy rank left, a size below the desired one), and say
        what was done: the reconcile loop's actions, run at once and without backoff."""
        await self._ready.wait()
        t0 = time.time()
        done: list[str] = []
        await self.orch.recovery.wait()
        op = await self.orch.recovery.recover()
        if op:
            done.append(
                f"recovered without rank(s) {op.get('dead_ranks')}: {op.get('state')}"
                + (f" ({op.get('error')})" if op.get("error") else "")
            )
        for _ in range(3):
            self.reconciler.reset_backoff()
            actions = await self.reconciler.tick()
            await self.orch.recovery.wait()
            done += actions
            if not actions:
                break
        self._info_dead()
        return {
            "deployment": self.deployment,
            "actions": done or ["nothing to repair"],
            "dp": self.orch.size,
            "desired_dp": self.orch.desired,
            "failed": self.reconciler.failures_since(t0),
        }

    # ---- scaling -------------------------------------------------------------------------------
    async def plan(self, target: int, retire: list[int] | None = None) -> dict[str, Any]:
        try:
            plan = (await self.orch.plan(target, retire=retire)).to_dict()
            plan["running_op"] = self.orch.busy()
            reason = self.orch.spawner.check_capacity(
                max(0, target - self.orch.size), [int(j["rank"]) for j in plan["joining"]]
            )
            plan["capacity_problem"] = reason
            plan["placement"] = {"policy": self.spawner.spec.policy, "nodes": self.spawner.predicted()}
            return plan
        except EepError as e:
            return error_record(e)

    async def scale(
        self,
        target: int,
        drain_timeout_s: float,
        timeout_s: float,
        wait: bool,
        request_id: str | None = None,
        retire: list[int] | None = None,
    ) -> dict[str, Any]:
        """Admit a scale (a recovery under way finishes first; a degraded deployment heals first;
        every rank must answer), then run it in a task that outlives this call (``--no-wait``).
        A scale-down removes ``retire``, else the ranks with the least work. The controller
        enforces ``timeout_s`` (before commit: roll back; from commit on: recover).
        ``request_id``: a retry with the same id gets the same operation, never a second one."""
        await self._ready.wait()
        try:
            await self.requests.first_settled(request_id, target)  # a retry during its admission: its answer
            if request_id and request_id in self.requests.ops:
                return await self._same_request(request_id, target, wait)
            hold_s = self.cfg.fault_delay_s if controller_holds(self.cfg.faults, "admit") else 0.0
            admitted = await self.requests.admit(
                request_id,
                target,
                lambda: self.orch.admit(target, settle=True, probe_ranks=True, retire=retire),
                hold_s,
            )
        except EepError as e:
            return error_record(e)
        op_id = admitted.op.op_id
        self._tasks[op_id] = asyncio.ensure_future(
            self.orch.run(admitted, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s)
        )
        self.requests.end(request_id, op_id=op_id)
        self._persist()
        if not wait:
            return {"op_id": op_id, "state": "running", "accepted": True}
        return await self._tasks[op_id]

    async def _same_request(self, request_id: str, target: int, wait: bool) -> dict[str, Any]:
        op_id = self.requests.ops[request_id]
        known = next((op for op in reversed(self.orch.history) if op["op_id"] == op_id), None)
        if known is not None and known.get("to_size") != target:
            return error_record(
                PreconditionError(
                    f"request id {request_id!r} was used for {op_id} "
                    f"(DP {known.get('from_size')}->{known.get('to_size')}), not DP {target}"
                )
            )
        if not wait or op_id not in self._tasks:
            return {
                **(known or {"op_id": op_id}),
                "op_id": op_id,
                "accepted": True,
                "repeated": True,
                **({} if known is None or known.get("finished") else {"state": "running"}),
            }
        return await self.wait_op(op_id, 1e9)

    async def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        try:  # a restarted controller answers once it took the operation over (its outcome is then known)
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            return {"op_id": op_id, "state": "running"}
        task = self._tasks.get(op_id)
        if task is None:
            for op in self.orch.history:
                if op["op_id"] == op_id:
                    return op
            return error_record(UnreachableError(f"no operation {op_id}"))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            op = self.orch.running_op()  # its current phase and sizes, for eepctl's live display
            where = (
                {"phase": op.phase, "from_size": op.from_size, "to_size": op.to_size}
                if op is not None and op.op_id == op_id
                else {}
            )
            return {"op_id": op_id, "state": "running", **where}


def json_copy(d: dict[str, Any]) -> dict[str, Any]:
    import json

    return json.loads(json.dumps(d, default=str))


def _this_node() -> dict[str, str]:
    """The node the control plane runs on (losing it loses the deployment, as losing Ray's head does)."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
