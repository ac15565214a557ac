"""A DP rank as a Ray actor named by its suffixed identity.

The step loop runs in its own thread inside RankEngine, so control and status calls are
answered while the rank serves (the actor is threaded).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from engine_ext.ray.names import controller_name, registry_name
from engine_ext.records import RankState


class RankActor:
    def __init__(self, cfg_d: dict[str, Any], deployment: str, namespace: str, rank: int,
                 layout_d: dict[str, Any], joining: bool, device: str, ifname: str = "", standby: int = -1) -> None:
        from engine_ext.elastic.eplb import ExpertLayout
        from engine_ext.config import EngineConfig
        from engine_ext.rank.engine import RankEngine

        self.deployment = deployment
        self.namespace = namespace
        self._registry = None
        self._controller = None
        self._resolve_after = 0.0
        self._registry_id: str | None = None  # the registry actor last reported to
        self._forever = threading.Event()  # never set: ``until_dead`` returns only by dying
        try:  # Ray metrics (docs/operations.md); best effort, never blocks a rank from starting
            from engine_ext.ray.metrics import RankMetrics

            self._metrics: Any = RankMetrics(deployment)
        except Exception:  # noqa: BLE001
            self._metrics = None
        self.engine = RankEngine(EngineConfig.from_dict(cfg_d), deployment, rank, ExpertLayout.from_dict(layout_d),
                                 joining=joining, device=device, sink=self._sink,
                                 node_id=ray.get_runtime_context().get_node_id(),
                                 node_ip=ray.util.get_node_ip_address(), ifname=ifname)
        if standby >= 0:  # launched ahead for the standby pool (engine_ext/rank/standby.py)
            from engine_ext.rank.standby import enter_standby

            enter_standby(self.engine, standby)
        self.engine.start_heartbeat()

    # ---- telemetry: never blocks the step loop ---------------------------------------------------
    def _handles(self) -> tuple[Any, Any]:
        now = time.time()
        if (self._registry is None or self._controller is None) and now >= self._resolve_after:
            self._resolve_after = now + 2.0
            try:
                self._registry = ray.get_actor(registry_name(self.deployment), namespace=self.namespace)
            except ValueError:
                self._registry = None
            try:
                self._controller = ray.get_actor(controller_name(self.deployment), namespace=self.namespace)
            except ValueError:
                self._controller = None
        return self._registry, self._controller

    def _sink(self, kind: str, payload: dict[str, Any]) -> None:
        if self._metrics is not None:
            if kind == "status":
                self._metrics.on_status(payload)
            elif kind == "event":
                self._metrics.on_event(payload)
        engine = getattr(self, "engine", None)  # None while the engine is being built
        if engine is not None and engine.state is RankState.FENCED:
            return  # the world moved on without this rank: it reports nothing more
        registry, controller = self._handles()
        if kind in ("results", "tokens"):
            # Tagged with the world they were produced in: the controller drops what a fenced
            # rank of an older world sends (no split brain after a hang or a healed partition).
            if controller is not None and engine is not None:
                if kind == "results":
                    controller.on_results.remote(payload["results"], engine.rank, engine.shared.epoch)
                else:
                    controller.on_tokens.remote(payload["tokens"], engine.rank, engine.shared.epoch)
            return
        if registry is None:  # events stay in the engine's ring and go to the next registry
            return
        try:
            if kind == "status":
                ref = registry.report_status.remote(payload)
                # A new registry (different actor id) gets the events this rank still holds.
                rid = registry._actor_id.hex()
                if rid != self._registry_id:
                    self._registry_id = rid
                    registry.report_events.remote(self.engine.recent_events())
                self._check(ref)
            else:
                registry.report_events.remote([payload])
        except Exception:
            self._registry = None

    def _check(self, ref: Any) -> None:
        def done(fut: Any) -> None:
            try:
                fut.result()
            except Exception:
                self._registry = None  # dead registry: re-resolve on the next report

        ref.future().add_done_callback(done)

    # ---- control -------------------------------------------------------------------------------
    def call(self, method: str, *args: Any) -> Any:
        """Run one ``RankControl`` method on the engine (the only entry for controller calls)."""
        from engine_ext.control.rank_client import RANK_METHODS

        if method not in RANK_METHODS:
            raise AttributeError(f"rank has no method {method!r}")
        return getattr(self.engine, method)(*args)

    def until_dead(self) -> None:
        """Never returns: the controller keeps one call pending per rank, and its ObjectRef
        raises RayActorError the moment this process dies (the Ray death signal)."""
        self._forever.wait()

    def pid(self) -> int:
        import os

        return os.getpid()
