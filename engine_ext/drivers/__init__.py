"""Client-side drivers: how a client (eepctl) talks to a deployment of each engine kind.

One interface (``base.Driver``), one implementation per kind: ``reference.ReferenceDriver`` (the
reference engine's controller and registry actors) and ``vllm.VllmDriver`` (a vLLM server's API
and the registry its plugin created). The kind is decided here, once, from what the cluster says;
a client never asks which kind it holds. Importing this package imports neither ray nor httpx.
"""

from __future__ import annotations

from typing import Any

from engine_ext.drivers.base import Driver
from engine_ext.protocol import DeploymentKind

__all__ = ["Driver", "open_deployment", "status_view"]


def open_deployment(name: str, registry: Any, controller: Any, *, api_key: str | None = None) -> Driver:
    """The driver of the deployment whose actor handles these are (either may be None).

    A controller means the reference engine. A registry alone is a vLLM deployment when its
    snapshot says so (the plugin creates no controller), else a reference deployment whose
    controller is gone."""
    if controller is None and registry is not None:
        from engine_ext.drivers.vllm_scale import info_if_vllm

        snap = info_if_vllm(registry)
        if snap is not None:
            from engine_ext.drivers.vllm import VllmDriver

            return VllmDriver(registry, snap, api_key)
    from engine_ext.drivers.reference import ReferenceDriver

    return ReferenceDriver(name, registry, controller)


def status_view(snap: dict[str, Any]) -> dict[str, Any]:
    """A registry snapshot as `status` shows it, whichever path read it: a vLLM deployment's adds
    each engine's health from vLLM's fault tolerance where the server has it."""
    if snap.get("kind") == DeploymentKind.VLLM.value:
        from engine_ext.drivers.vllm import with_health

        return with_health(snap)
    return snap
