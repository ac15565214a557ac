"""What the controller publishes to its deployment's registry: the info ``eepctl status`` shows of
the control plane (desired size, policy, members, dead and fenced ranks, the reconcile loop's view,
the standby pool, the ingresses), sent only when it changed; the controller's own events and
operations, which a recreated registry is given back; and the operations' metrics.

The controller owns one ``StatusPublisher`` (``publisher``) and reads through ``host`` what it
shows: ``orch``, ``reconciler``, ``spawner``, ``keeper``, ``restarts`` and ``took_over``.
``persist`` writes the controller's durable state (which keeps ``info`` and ``emitted``)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from typing import Any

import ray


class StatusPublisher:
    def __init__(self, host: Any, deployment: str, persist: Callable[[], None]) -> None:
        self.host = host
        self.persist = persist
        # Registry recreation: what a new registry must be given back (info, ops, own events).
        self.info: dict[str, Any] = {}
        self.emitted: deque[dict[str, Any]] = deque(maxlen=2000)
        self.published: dict[str, Any] = {}
        self.sent = 0  # set_info calls (only when what status shows changed)
        try:
            from engine_ext.ray.metrics import DeploymentMetrics

            self.metrics: Any = DeploymentMetrics(deployment)
        except Exception:  # noqa: BLE001 - metrics are best effort
            self.metrics = None

    def emit(self, event: dict[str, Any]) -> None:
        self.emitted.append(event)
        self.persist()
        try:
            self.host.keeper.handle().report_events.remote([event])
        except Exception:
            pass

    def record_op(self, op: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.on_operation(op, self.host.orch.size)
        if op.get("finished"):  # size, desired size and dead ranks as `eepctl status` shows them
            self.publish()
        self.persist()
        try:
            self.host.keeper.handle().record_operation.remote(op)
        except Exception:
            pass

    def forget_rank(self, rank: int) -> None:
        try:
            self.host.keeper.handle().forget_rank.remote(rank)
        except Exception:
            pass

    def publish(self) -> None:
        """The registry's info carries desired size, policy, dead and fenced ranks and the
        reconcile loop's view (``eepctl status``); sent when it changed."""
        host = self.host
        orch, spawner = host.orch, host.spawner
        control = host.reconciler.view()
        for h in control["health"].values():
            h.pop("age_s", None)  # the registry shows heartbeat ages itself; this changes every tick
        extra = {
            "desired_dp": orch.desired,
            "on_rank_failure": str(orch.on_rank_failure),
            "members": list(orch.members),
            "dead": self.dead_shown(),
            "control_node": _this_node(),
            "standby_pool": spawner.pool.summary() if spawner.pool is not None else None,
            "control": {
                **control,
                "controller_restarts": host.restarts,
                "took_over": host.took_over,
                "stale_removed": spawner.stale_removed,
                "fenced_messages_dropped": orch.router.fenced_dropped,
                "stale_messages_dropped": orch.router.stale_dropped,
            },
            "ingress": orch.router.shown() or self.info.get("ingress", []),
        }
        self.info.update(extra)
        if self.info == self.published:
            return
        self.published = json_copy(self.info)
        self.sent += 1
        try:
            host.keeper.handle().set_info.remote(self.info)
        except Exception:  # noqa: BLE001 - telemetry is best effort
            pass

    def dead_shown(self) -> list[dict[str, Any]]:
        """Dead ranks, shown until replaced (the size is back at the desired one)."""
        o = self.host.orch
        if o.size >= o.desired and o.running_op() is None:
            return []
        return list(o.recovery.dead.values())[-8:]


def json_copy(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


def _this_node() -> dict[str, str]:
    """The node the control plane runs on (losing it loses the deployment, as losing Ray's head does)."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
