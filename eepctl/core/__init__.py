"""What eepctl does, without the command framework: each function returns plain data.

eepctl is a client: actors are created by engine_ext.ray.deployment; a deployment is planned,
scaled, repaired and sent requests through its driver (engine_ext.drivers, whose kind this package
never asks); load comes from eepctl.loadgen. Ray is imported inside the functions that talk to the
cluster; torch never is. One module per concept: ``target`` (which deployment, how it is reached),
``lifecycle`` (up, down, repair), ``reading`` (status, events), ``traffic`` (generate, load),
``scaling`` (plan, scale, the standby pool), ``autoscaling`` (the policy and its decisions).
"""

from __future__ import annotations

from eepctl.core.autoscaling import autoscale, autoscale_decisions, autoscale_show, check_autoscale_changes
from eepctl.core.lifecycle import check_repair, down, repair, up, wait_serving
from eepctl.core.reading import events, status, status_reader
from eepctl.core.scaling import check_retire, plan, scale, standby
from eepctl.core.target import Target
from eepctl.core.traffic import generate, load, requests
from eepctl.loadgen import DEFAULT_PROMPTS, percentiles
from engine_ext.drivers.reference import check_outcome
from engine_ext.ray.deployment import list_deployments

__all__ = [
    "DEFAULT_PROMPTS",
    "Target",
    "autoscale",
    "autoscale_decisions",
    "autoscale_show",
    "check_autoscale_changes",
    "check_outcome",
    "check_repair",
    "check_retire",
    "down",
    "events",
    "generate",
    "list_deployments",
    "load",
    "percentiles",
    "plan",
    "repair",
    "requests",
    "scale",
    "standby",
    "status",
    "status_reader",
    "up",
    "wait_serving",
]
