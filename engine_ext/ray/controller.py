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
from typing import Any

from engine_ext.config import EngineConfig
from engine_ext.control.orchestrator import Orchestrator
from engine_ext.control.reconciler import TICK_S, Reconciler
from engine_ext.control.request_ids import RequestIds
from engine_ext.protocol import EepError, error_record
from engine_ext.ray import placement
from engine_ext.ray.autoscale_host import AutoscaleHost, autoscale_round, autoscaler_metrics
from engine_ext.ray.completion_request import model_limits
from engine_ext.ray.controller_memory import forget_unheld_ranks, restore_learned, snapshot, sweep_orphans, take_over
from engine_ext.ray.durable import DurableState
from engine_ext.ray.ingress_link import IngressLink
from engine_ext.ray.registry_keeper import RegistryKeeper
from engine_ext.ray.scale_requests import ScaleRequests
from engine_ext.ray.spawner import RaySpawner
from engine_ext.ray.standby import make_pool
from engine_ext.ray.status_publisher import StatusPublisher


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
        self.publisher = StatusPublisher(self, deployment, persist=self._persist)
        self.keeper = RegistryKeeper(
            deployment,
            namespace,
            expected_ranks=lambda: len(self.orch.clients),
            restore=lambda: (self.publisher.info, list(self.orch.history), list(self.publisher.emitted)),
        )
        self.spawner = RaySpawner(
            deployment,
            namespace,
            self.cfg,
            cpus_per_rank,
            gpus_per_rank,
            placement.PlacementSpec.from_dict(placement_d),
        )
        self.orch = self._orchestrator(max_dp, on_rank_failure, gpus_per_rank > 0, ingress)
        self.spawner.pool = (
            make_pool(self.spawner, self.orch.world, self.publisher.forget_rank, standby) if standby > 0 else None
        )
        self._pool_watch: asyncio.Task | None = None
        self.started_at = time.time()
        self.reconciler = Reconciler(
            self.orch,
            deadline_s=health_deadline_s,
            on_tick=self._persist,
            sweep=self._sweep_orphans,
            autoscale=self._autoscale,
        )
        self.durable = DurableState(namespace, deployment)
        self.restarts = 0
        self.took_over: list[str] = []  # what a restarted controller did first
        self._ready = asyncio.Event()  # set once started, or once a restarted controller took over
        self.scales = ScaleRequests(self.cfg, self.orch, self.spawner, self._ready, self._persist)
        self._resume(self.durable.load(), max_dp)

    def _resume(self, saved: dict[str, Any] | None, max_dp: int) -> None:
        """The autoscaler with its policy and decisions as saved, the cost model's points learned from
        the deployment's scales and, when Ray restarted this controller (the saved state says the
        deployment started), the take-over, scheduled on the actor's loop."""
        self.autoscale_host = AutoscaleHost(
            self.deployment,
            max_dp,
            persist=lambda st: self._persist(),
            saved=(saved or {}).get("autoscale"),
            metrics=autoscaler_metrics(self.deployment),
        )
        restore_learned(self.orch, saved)  # the cost model learned from the deployment's own scales
        if saved is not None and saved.get("started"):
            self._resuming = asyncio.get_event_loop().create_task(self._take_over(saved))

    def _orchestrator(self, max_dp: int, on_rank_failure: str, on_gpus: bool, ingress: int) -> Orchestrator:
        """The orchestrator over the spawner's ranks: its events, operations and forgotten ranks
        published, a rank's death handed to its recovery, requests routed through the ingresses."""
        orch = Orchestrator(
            self.deployment,
            self.cfg,
            self.spawner,
            max_dp=max_dp,
            emit=self.publisher.emit,
            record_op=self.publisher.record_op,
            forget_rank=self.publisher.forget_rank,
            on_rank_failure=on_rank_failure,
        )
        self.spawner.on_death = self._on_death
        orch.admission.device = "cuda" if on_gpus else "cpu"  # the cost model's host check
        orch.world.router = IngressLink(
            self.deployment,
            self.namespace,
            ingress,
            fenced=lambda: {  # type: ignore[assignment]
                r: int(f["epoch"]) for r, f in orch.world.fenced.items()
            },
            seen=lambda r, at: self.reconciler.health.heard(r, at),
            limits=model_limits(self.cfg),
        )
        return orch

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
            self.publisher.info = dict((await self.keeper.registry.snapshot.remote()).get("info") or {})
        except Exception:  # noqa: BLE001 - recreation then restores what the controller knows
            self.publisher.info = {"max_dp": self.orch.max_dp, "config": self.cfg.to_dict()}
        self.keeper.start()
        if self.spawner.pool is not None:
            await self.set_standby(self.spawner.pool.size)
        return await self.info()

    async def set_standby(self, count: int) -> dict[str, Any]:
        """``eepctl standby --count``: keep ``count`` ranks launched ahead (0 stops them)."""
        if self.spawner.pool is None:
            self.spawner.pool = make_pool(self.spawner, self.orch.world, self.publisher.forget_rank, count)
        await self.spawner.pool.resize(count)
        if self._pool_watch is None:
            self._pool_watch = asyncio.ensure_future(self.spawner.pool.watch(2.0))
        return self.spawner.pool.summary()

    def writes(self) -> dict[str, int]:
        """How often this controller wrote its durable state and published status (idle: never)."""
        return {"durable": self.durable.writes, "set_info": self.publisher.sent}

    def pid(self) -> int:
        import os

        return os.getpid()

    def tick_record(self) -> dict[str, Any]:
        """The reconcile loop's own record: how long each recent tick took, against its period."""
        r = self.reconciler
        return {"ticks": r.ticks, "tick_s": list(r.tick_seconds), "period_s": r.tick_s}

    async def info(self) -> dict[str, Any]:
        self.publisher.publish()
        return {
            "deployment": self.deployment,
            "dp": self.orch.size,
            "max_dp": self.orch.max_dp,
            "desired_dp": self.orch.desired,
            "on_rank_failure": str(self.orch.on_rank_failure),
            "dead": self.publisher.dead_shown(),
            "ranks": {str(r): c.pid() for r, c in self.orch.clients.items()},
            "running_op": self.orch.busy(),
            "layout": self.orch.layout.to_dict() if self.orch.layout else None,
            "config": self.cfg.to_dict(),
            "history": self.orch.history[-20:],
            "control": self.publisher.info.get("control", {}),
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
        self.publisher.publish()

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
                info=self.publisher.info,
                autoscale=self.autoscale_host.state(),
                standby=pool.size if pool is not None else 0,
                standby_next=pool.next_number if pool is not None else 0,
                requests=self.scales.requests.recent(),
                events=list(self.publisher.emitted)[-300:],
            )
        )
        self.publisher.publish()

    async def _autoscale(self) -> list[str]:
        """One autoscaling round (a policy is set and not off): the decision moves the desired
        size through a normal scale; advisory decisions are only recorded."""
        host = self.autoscale_host
        self.reconciler.tick_s = host.period(TICK_S)  # faster while a policy is on and there is load
        if host.policy is None or str(host.policy.mode) == "off":
            host.learn_costs(self.orch.history[-5:])  # the scales operators ran teach the cost too
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
        self.publisher.info["autoscale"] = host.shown()  # changes when what status says does
        self.reconciler.tick_s = host.period(TICK_S)
        return [f"autoscale {d.id}: {d.action}"] if d is not None and d.act else []

    async def _sweep_orphans(self) -> list[str]:
        return await sweep_orphans(self.orch, self.spawner, self.namespace, self.deployment)

    async def _take_over(self, saved: dict[str, Any]) -> None:
        """This controller was restarted by Ray: take the deployment over from the durable state."""
        self.restarts = int(saved.get("restarts", 0)) + 1
        self.publisher.info = dict(saved.get("info") or {})
        self.publisher.emitted.extend(saved.get("events") or [])
        self.scales.requests = RequestIds(saved.get("requests"))
        try:
            self.took_over = await take_over(self.orch, self.spawner, saved)
        except Exception as e:  # noqa: BLE001 - the loop rebuilds what could not be taken over
            self.reconciler.failed("take over", e)
        self.took_over += await forget_unheld_ranks(self.keeper.handle, set(self.orch.members))
        self.publisher.emit(
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
                self.spawner.pool = make_pool(
                    self.spawner, self.orch.world, self.publisher.forget_rank, int(saved["standby"])
                )
            # numbers go on from the dead controller's: an adopted standby still holds its name
            self.spawner.pool.next_number = max(self.spawner.pool.next_number, int(saved.get("standby_next", 0)))
            await self.set_standby(int(saved["standby"]))
        self.reconciler.start()

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
        self.publisher.publish()
        return {
            "deployment": self.deployment,
            "actions": done or ["nothing to repair"],
            "dp": self.orch.size,
            "desired_dp": self.orch.desired,
            "failed": self.reconciler.failures_since(t0),
        }

    # ---- scaling: ScaleRequests answers ---------------------------------------------------------
    async def plan(self, target: int, retire: list[int] | None = None) -> dict[str, Any]:
        return await self.scales.plan(target, retire)

    async def scale(
        self,
        target: int,
        drain_timeout_s: float,
        timeout_s: float,
        wait: bool,
        request_id: str | None = None,
        retire: list[int] | None = None,
    ) -> dict[str, Any]:
        return await self.scales.scale(target, drain_timeout_s, timeout_s, wait, request_id, retire)

    async def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        return await self.scales.wait_op(op_id, timeout_s)
