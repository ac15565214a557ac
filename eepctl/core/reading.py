"""Reading a deployment: its registry's status snapshot and its operations' events, over the
light read path (eepctl.readpath) when the registry publishes one, else through a Ray driver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eepctl.core.target import Target, connect, deployment_actors
from engine_ext.drivers import status_view
from engine_ext.protocol import UnreachableError
from engine_ext.ray.deployment import call


def status(t: Target) -> dict[str, Any]:
    t.validated()
    return _ray_status_reader(t)()


def _ray_status_reader(t: Target) -> Callable[[], dict[str, Any]]:
    """The registry snapshot through a Ray driver, with the registry handle looked up once."""
    connect(t)
    registry, _ = deployment_actors(t, controller=False)
    if registry is None:
        raise UnreachableError(
            f"the registry of {t.name!r} is gone while its controller still runs; "
            "per-rank status is unavailable until a registry exists again"
        )
    return lambda: status_view(call(registry.snapshot.remote(), timeout=10))


def status_reader(t: Target) -> Callable[[], dict[str, Any]]:
    """A function returning the registry snapshot, with the deployment resolved once: the light
    read path (eepctl.readpath) when the registry publishes one, else the Ray driver."""
    from eepctl import readpath

    t.validated()
    fast = readpath.reader(t.address, t.namespace, t.name)
    if fast is not None:
        return lambda: status_view(fast())
    return _ray_status_reader(t)


def events(t: Target, op_id: str | None = None, since_seq: int = 0) -> dict[str, Any]:
    """The registry's operations and events: over the light read path when it answers, else
    through a Ray driver (which reports a missing deployment or registry)."""
    from eepctl import readpath

    t.validated()
    data = readpath.events(t.address, t.namespace, t.name, op_id, since_seq)
    if data is None:
        connect(t)
        registry, _ = deployment_actors(t, controller=False)
        if registry is None:
            raise UnreachableError(f"the registry of {t.name!r} is gone; operation history is unavailable")
        data = call(registry.events.remote(op_id, since_seq), timeout=10)
    if op_id and not data["operations"] and not data["events"]:
        raise UnreachableError(f"no operation {op_id!r} in deployment {t.name!r}")
    return data
