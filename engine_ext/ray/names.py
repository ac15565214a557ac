"""Actor names of a deployment. Torch- and Ray-free so eepctl can compute them cheaply."""

from __future__ import annotations


def registry_name(deployment: str) -> str:
    return f"eep-registry.{deployment}"


def controller_name(deployment: str) -> str:
    return f"eep-controller.{deployment}"


REGISTRY_PREFIX = "eep-registry."
