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

__all__ = ["Driver", "endpoints", "open_deployment", "request_key", "served_model", "status_view"]


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


def endpoints(snap: dict[str, Any]) -> list[str]:
    """The HTTP endpoints (OpenAI's completions API) a deployment takes requests on, as its
    registry snapshot names them: each ingress's URL (reference), the API server (vLLM)."""
    info = snap.get("info") or {}
    if snap.get("kind") == DeploymentKind.VLLM.value:
        return [str(info["api_url"]).rstrip("/")] if info.get("api_url") else []
    shown = sorted(info.get("ingress") or [], key=lambda i: int(i.get("index") or 0))
    return [str(i["url"]).rstrip("/") for i in shown if i.get("url")]


def request_key(snap: dict[str, Any] | None, api_key: str | None) -> str | None:
    """The key requests carry: ``--api-key``, else the kind's own variable: VLLM_API_KEY for a
    vLLM server, EEPCTL_API_KEY for a reference deployment's ingresses (a vLLM key is never sent
    to them)."""
    import os

    if api_key:
        return api_key
    vllm = bool(snap) and snap.get("kind") == DeploymentKind.VLLM.value  # type: ignore[union-attr]
    return os.environ.get("VLLM_API_KEY" if vllm else "EEPCTL_API_KEY") or None


def served_model(snap: dict[str, Any] | None, name: str, url: str, api_key: str | None) -> str:
    """The model name requests carry: a vLLM server's (from its registry info, else its
    ``/v1/models``); a reference ingress serves one model, named after the deployment."""
    if not snap or snap.get("kind") != DeploymentKind.VLLM.value:
        return name
    model = (snap.get("info") or {}).get("model")
    if model:
        return str(model)
    from engine_ext.control.vllm_api import VllmApi

    return VllmApi(url, api_key).served_model()
