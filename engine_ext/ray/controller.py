"""The controller: a named, detached async actor per deployment.

It owns the rank actors, routes requests (the frontend) and runs scale operations, so a
transition survives the eepctl process that asked for it (``--no-wait``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import ray

from engine_ext.config import EngineConfig
from engine_ext.control.orchestrator import Orchestrator
from engine_ext.protocol import EepError, ExitCode
from engine_ext.ray import placement
from engine_ext.ray.names import registry_name
from engine_ext.ray.spawner import RaySpawner
from engine_ext.ray.standby import make_pool


class Controller:
    def __init__(self, deployment: str, namespace: str, cfg_d: dict[str, Any], max_dp: int,
                 cpus_per_rank: float, gpus_per_rank: float, placement_d: dict[str, Any] | None = None,
                 on_rank_failure: str = "replace", standby: int = 0) -> None:
        self.deployment = deployment
        self.namespace = namespace
        self.cfg = EngineConfig.from_dict(cfg_d)
        self.registry = ray.get_actor(registry_name(deployment), namespace=namespace)
        self._resolved_at = time.time()
        self.spawner = RaySpawner(deployment, namespace, self.cfg, cpus_per_rank, gpus_per_rank,
                                  placement.PlacementSpec.from_dict(placement_d))
        self.orch = Orchestrator(deployment, self.cfg, self.spawner, max_dp=max_dp,
                                 emit=self._emit, record_op=self._record_op, forget_rank=self._forget_rank,
                                 on_rank_failure=on_rank_failure)
        self.spawner.on_death = self._on_death
        self._tasks: dict[str, asyncio.Task] = {}
        self.spawner.pool = make_pool(self.spawner, self.orch.world, self._forget_rank, standby) if standby > 0 else None
        self._pool_watch: asyncio.Task | None = None
        self.started_at = time.time()
        # Registry recreation: what a new registry must be given back (info, ops, own events).
        self._info: dict[str, Any] = {}
        self._emitted: deque[dict[str, Any]] = deque(maxlen=2000)
        self._watchdog: asyncio.Task | None = None
        self.registry_recreated = 0
        try:
            from engine_ext.ray.metrics import DeploymentMetrics

            self._metrics: Any = DeploymentMetrics(deployment)
        except Exception:  # noqa: BLE001 - metrics are best effort
            self._metrics = None

    def _emit(self, event: dict[str, Any]) -> None:
        self._emitted.append(event)
        try:
            self._handle_registry().report_events.remote([event])
        except Exception:
            pass

    def _record_op(self, op: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.on_operation(op, self.orch.size)
        if op.get("finished"):  # size, desired size and dead ranks as `eepctl status` shows them
            self._info_dead()
        try:
            self._handle_registry().record_operation.remote(op)
        except Exception:
            pass

    def _forget_rank(self, rank: int) -> None:
        try:
            self._handle_registry().forget_rank.remote(rank)
        except Exception:
            pass

    def _handle_registry(self) -> Any:
        """The registry handle, re-resolved by name at most every 2 s (it may be recreated)."""
        now = time.time()
        if now - self._resolved_at > 2.0:
            self._resolved_at = now
            try:
                self.registry = ray.get_actor(registry_name(self.deployment), namespace=self.namespace)
            except ValueError:
                pass
        return self.registry

    async def _watch_registry(self, interval_s: float = 1.0) -> None:
        """Recreate the registry (same name, namespace, detached) when it is gone, telling it how
        many ranks to expect (it says it is rebuilding until they report), and give it back the
        deployment info, the operation history and the controller's own events; the ranks
        re-send theirs when they see a new registry (RankActor._sink)."""
        from engine_ext.ray.placement import on_this_node
        from engine_ext.ray.registry import Registry

        name = registry_name(self.deployment)
        while True:
            await asyncio.sleep(interval_s)
            try:
                ray.get_actor(name, namespace=self.namespace)
                continue
            except ValueError:
                pass
            try:
                reg = ray.remote(Registry).options(name=name, namespace=self.namespace, lifetime="detached",
                                                   num_cpus=0, scheduling_strategy=on_this_node()).remote(self.deployment,
                                                                      expected_ranks=len(self.orch.clients))
            except ValueError:  # the old name is not released yet, or someone else recreated it
                continue
            try:
                if self._info:
                    await reg.set_info.remote(self._info)
                for op in list(self.orch.history):
                    await reg.record_operation.remote(op)
                if self._emitted:
                    await reg.report_events.remote(list(self._emitted))
            except Exception:  # noqa: BLE001 - the next round retries with whatever exists then
                continue
            self.registry = reg
            self._resolved_at = time.time()
            self.registry_recreated += 1

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, size: int, timeout_s: float = 300.0) -> dict[str, Any]:
        try:
            await self.orch.start(size, timeout_s)
        except EepError as e:
            return _error(e)
        try:
            self._info = dict((await self.registry.snapshot.remote()).get("info") or {})
        except Exception:  # noqa: BLE001 - recreation then restores what the controller knows
            self._info = {"max_dp": self.orch.max_dp, "config": self.cfg.to_dict()}
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch_registry())
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

    async def info(self) -> dict[str, Any]:
        self._info_dead()
        return {"deployment": self.deployment, "dp": self.orch.size, "max_dp": self.orch.max_dp,
                "desired_dp": self.orch.desired, "on_rank_failure": str(self.orch.on_rank_failure),
                "dead": self._dead_shown(),
                "ranks": {str(r): c.pid() for r, c in self.orch.clients.items()},
                "running_op": self.orch.busy(),
                "layout": self.orch.layout.to_dict() if self.orch.layout else None,
                "config": self.cfg.to_dict(), "history": self.orch.history[-20:]}

    async def stop(self) -> None:
        if self._watchdog is not None:  # `down` kills the registry next: do not bring it back
            self._watchdog.cancel()
            self._watchdog = None
        if self.spawner.pool is not None:
            if self._pool_watch is not None:
                self._pool_watch.cancel()
            await self.spawner.pool.stop()
        await self.orch.stop()

    # ---- serving -------------------------------------------------------------------------------
    def on_results(self, results: list[dict[str, Any]]) -> None:
        self.orch.router.on_results(results)

    def on_tokens(self, tokens: dict[str, list[float]]) -> None:
        self.orch.router.on_tokens(tokens)

    # ---- self-healing --------------------------------------------------------------------------
    def _on_death(self, rank: int, cause: str) -> None:
        self.orch.recovery.on_death(rank, cause)
        self._info_dead()

    def _info_dead(self) -> None:
        """The registry's info carries desired size, policy and dead ranks (``eepctl status``)."""
        extra = {"desired_dp": self.orch.desired, "on_rank_failure": str(self.orch.on_rank_failure),
                 "members": list(self.orch.members),
                 "dead": self._dead_shown(), "control_node": _this_node()}
        self._info.update(extra)
        try:
            self._handle_registry().set_info.remote(self._info)
        except Exception:  # noqa: BLE001 - telemetry is best effort
            pass

    def _dead_shown(self) -> list[dict[str, Any]]:
        """Dead ranks, shown until replaced (the size is back at the desired one)."""
        o = self.orch
        if o.size >= o.desired and o.running_op() is None:
            return []
        return list(o.recovery.dead.values())[-8:]

    async def repair(self) -> dict[str, Any]:
        """Recover what the automatic path could not: dead or unanswering members, then the
        desired size. Says what it did."""
        done: list[str] = []
        await self.orch.recovery.wait()
        op = await self.orch.recovery.recover()
        if op:
            done.append(f"recovered without rank(s) {op.get('dead_ranks')}: {op.get('state')}"
                        + (f" ({op.get('error')})" if op.get("error") else ""))
        if self.orch.desired > self.orch.size and not self.orch.busy():
            res = await self.orch.scale(min(self.orch.desired, self.orch.max_dp))
            done.append(f"scaled DP {res.get('from_size')} -> {res.get('to_size')}: {res.get('state')}")
        self._info_dead()
        return {"deployment": self.deployment, "actions": done or ["nothing to repair"],
                "dp": self.orch.size, "desired_dp": self.orch.desired}

    async def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        t0 = time.time()
        try:
            res = await self.orch.router.submit(prompt, max_tokens)
        except EepError as e:
            return {"error": e.message, "latency_s": time.time() - t0}
        res["latency_s"] = time.time() - t0
        return res

    # ---- scaling -------------------------------------------------------------------------------
    async def plan(self, target: int) -> dict[str, Any]:
        try:
            plan = (await self.orch.plan(target)).to_dict()
            plan["running_op"] = self.orch.busy()
            reason = self.orch.spawner.check_capacity(max(0, target - self.orch.size),
                                                      [int(j["rank"]) for j in plan["joining"]])
            plan["capacity_problem"] = reason
            plan["placement"] = {"policy": self.spawner.spec.policy, "nodes": self.spawner.predicted()}
            return plan
        except EepError as e:
            return _error(e)

    async def scale(self, target: int, drain_timeout_s: float, timeout_s: float, wait: bool) -> dict[str, Any]:
        """Admit a scale (a recovery under way finishes first; a degraded deployment heals first;
        every rank must answer), then run it in a task that outlives this call (``--no-wait``)."""
        try:
            admitted = await self.orch.admit(target, settle=True, probe_ranks=True)
        except EepError as e:
            return _error(e)
        op_id = admitted.op.op_id
        task = asyncio.ensure_future(self.orch.run(admitted, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s))
        self._tasks[op_id] = task
        if not wait:
            return {"op_id": op_id, "state": "running", "accepted": True}
        return await task

    async def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        task = self._tasks.get(op_id)
        if task is None:
            for op in self.orch.history:
                if op["op_id"] == op_id:
                    return op
            return _error_code(ExitCode.UNREACHABLE, f"no operation {op_id}")
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            op = self.orch.running_op()  # its current phase and sizes, for eepctl's live display
            where = ({"phase": op.phase, "from_size": op.from_size, "to_size": op.to_size}
                     if op is not None and op.op_id == op_id else {})
            return {"op_id": op_id, "state": "running", **where}


def _error(e: EepError) -> dict[str, Any]:
    return {"error": {"code": int(e.exit_code), "message": e.message, "detail": e.detail}}


def _error_code(code: ExitCode, message: str) -> dict[str, Any]:
    return {"error": {"code": int(code), "message": message, "detail": {}}}


def _this_node() -> dict[str, str]:
    """The node the control plane runs on (losing it loses the deployment, as losing Ray's head does)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
