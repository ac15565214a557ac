"""Actor names of a deployment. Torch- and Ray-free so eepctl can compute them cheaply."""

from __future__ import annotations

from engine_ext.elastic.identity import dp_rank_of, standby_number


def registry_name(deployment: str) -> str:
    return f"eep-registry.{deployment}"


def controller_name(deployment: str) -> str:
    return f"eep-controller.{deployment}"


REGISTRY_PREFIX = "eep-registry."


def is_rank_actor(deployment: str, actor_name: str) -> bool:
    """Whether ``actor_name`` is one of the deployment's rank actors: a DP rank
    (``<name>_dp<r>``) or a standby (``<name>_standby<n>``, which keeps that actor name when a
    scale-up adopts it)."""
    return dp_rank_of(deployment, actor_name) is not None or standby_number(deployment, actor_name) is not None


def vllm_controller_name(deployment: str) -> str:
    """The in-cluster controller that runs a vLLM deployment's scales (engine_ext.ray.vllm_controller)."""
    return f"eep-vllm-controller.{deployment}"


def ingress_name(deployment: str, index: int) -> str:
    """Ingress ``index`` of a reference deployment (engine_ext.ray.ingress): it owns the requests
    whose id starts with ``request_prefix(index)``."""
    return f"eep-ingress.{deployment}.{index}"


def request_prefix(index: int) -> str:
    return f"i{index}/"


def owner_of(request_id: str) -> int | None:
    """The index of the ingress that owns ``request_id`` (None: not an ingress's request)."""
    head, sep, _ = request_id.partition("/")
    return int(head[1:]) if sep and head[:1] == "i" and head[1:].isdigit() else None
