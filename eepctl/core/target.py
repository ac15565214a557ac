"""Which deployment a command addresses, and how the core reaches it: the Ray connection, its
registry and controller actors, its driver (engine_ext.drivers, which decides the kind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eepctl import cluster
from engine_ext.drivers import Driver, open_deployment
from engine_ext.protocol import DEFAULT_NAMESPACE, UnreachableError, validate_name
from engine_ext.ray.deployment import list_deployments
from engine_ext.ray.names import controller_name, registry_name


@dataclass
class Target:
    """Which cluster, namespace and deployment a command addresses."""

    address: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    name: str = "moe"

    def validated(self) -> Target:
        validate_name(self.name)
        validate_name(self.namespace, "namespace")
        return self


def connect(t: Target) -> str:
    return cluster.connect(t.address, t.namespace)


def deployment_actors(t: Target, controller: bool = True) -> tuple[Any, Any]:
    """(registry, controller) handles; read-only commands skip the controller handle, whose
    class import is heavier."""
    from engine_ext.ray.deployment import actor

    registry = actor(registry_name(t.name), t.namespace)
    ctl = actor(controller_name(t.name), t.namespace) if controller or registry is None else None
    if registry is None and ctl is None:
        known = list_deployments(t.namespace)
        hint = f" (deployments here: {', '.join(known)})" if known else " (none exist in this namespace)"
        raise UnreachableError(f"deployment {t.name!r} not found in namespace {t.namespace!r}{hint}")
    return registry, ctl


def driver(t: Target, api_key: str | None) -> Driver:
    """Connect, find the deployment's actors, and open its driver (the kind is decided there)."""
    connect(t)
    registry, controller = deployment_actors(t)
    return open_deployment(t.name, registry, controller, api_key=api_key)
