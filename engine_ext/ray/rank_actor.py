"""A DP rank as a Ray actor named by its suffixed identity.

The step loop runs in its own thread inside RankEngine, so control and status calls are
answered while the rank serves (the actor is threaded).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from engine_ext.ray import ray_private
from engine_ext.ray.names import ingress_name, owner_of, registry_name
from engine_ext.records import RankState


class RankActor:
    def __init__(
        self,
        cfg_d: dict[str, Any],
        deployment: str,
        namespace: str,
        rank: int,
        layout_d: dict[str, Any],
        joining: bool,
        device: str,
        ifname: str = "",
        standby: int = -1,
    ) -> None:
        from engine_ext.config import EngineConfig
        from engine_ext.elastic.eplb import ExpertLayout
        from engine_ext.rank.engine import RankEngine

        self.deployment = deployment
        self.namespace = namespace
        self._registry = None
        self._ingresses: dict[int, Any] = {}  # ingress index -> handle (it survives the ingress's restarts)
        self._resolve_after = 0.0
        self._registry_id: str | None = None  # the registry actor last reported to
        self._forever = threading.Event()  # never set: ``until_dead`` returns only by dying
        try:  # Ray metrics (docs/operations.md); best effort, never blocks a rank from starting
            from engine_ext.ray.metrics import RankMetrics

            self._metrics: Any = RankMetrics(deployment)
        except Exception:  # noqa: BLE001
            self._metrics = None
        self.engine = RankEngine(
            EngineConfig.from_dict(cfg_d),
            deployment,
            rank,
            ExpertLayout.from_dict(layout_d),
            joining=joining,
            device=device,
            sink=self._sink,
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            ifname=ifname,
        )
        if standby >= 0:  # launched ahead for the standby pool (engine_ext/rank/standby.py)
            from engine_ext.rank.standby import enter_standby

            enter_standby(self.engine, standby)
        self.engine.start_heartbeat()

    # ---- telemetry: never blocks the step loop ---------------------------------------------------
    def _registry_handle(self) -> Any:
        now = time.time()
        if self._registry is None and now >= self._resolve_after:
            self._resolve_after = now + 2.0
            try:
                self._registry = ray.get_actor(registry_name(self.deployment), namespace=self.namespace)
            except ValueError:
                self._registry = None
        return self._registry

    def _ingress(self, index: int) -> Any:
        h = self._ingresses.get(index)
        if h is None:
            try:
                h = self._ingresses[index] = ray.get_actor(
                    ingress_name(self.deployment, index), namespace=self.namespace
                )
            except ValueError:
                return None
        return h

    def _to_owners(self, kind: str, payload: dict[str, Any], engine: Any) -> None:
        """Tokens and results go to the ingress that owns each request (its id says which), tagged
        with the world they were produced in: an ingress drops what a fenced rank of an older
        world sends (no split brain after a hang or a healed partition)."""
        by_owner: dict[int | None, Any] = {}
        if kind == "results":
            for res in payload["results"]:
                by_owner.setdefault(owner_of(res["request_id"]), []).append(res)
        else:
            for rid, tok in payload["tokens"].items():
                by_owner.setdefault(owner_of(rid), {})[rid] = tok
        for index, part in by_owner.items():
            h = self._ingress(index) if index is not None else None
            if h is None:
                continue  # no ingress of that number: nobody waits for it
            try:
                if kind == "results":
                    h.on_results.remote(part, engine.rank, engine.shared.epoch)
                else:
                    h.on_tokens.remote(part, engine.rank, engine.shared.epoch)
            except Exception:  # noqa: BLE001 - an ingress being restarted: its requests fail retriably
                pass

    def _sink(self, kind: str, payload: dict[str, Any]) -> None:
        if self._metrics is not None:
            if kind == "status":
                self._metrics.on_status(payload)
            elif kind == "event":
                self._metrics.on_event(payload)
        engine = getattr(self, "engine", None)  # None while the engine is being built
        if engine is not None and engine.state is RankState.FENCED:
            return  # the world moved on without this rank: it reports nothing more
        if kind in ("results", "tokens"):
            if engine is not None:
                self._to_owners(kind, payload, engine)
            return
        registry = self._registry_handle()
        if registry is None:  # events stay in the engine's ring and go to the next registry
            return
        try:
            if kind == "status":
                ref = registry.report_status.remote(payload)
                # A new registry (different actor id) gets the events this rank still holds.
                rid = ray_private.actor_id(registry)
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
