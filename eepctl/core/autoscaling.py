"""The autoscaling policy a deployment keeps (its controller's loop runs it): set, shown, and the
decisions it took."""

from __future__ import annotations

from typing import Any

from eepctl.core.target import Target, driver
from engine_ext.protocol import UsageError


def check_autoscale_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """Each given policy field's type and range, before the cluster is asked (the controller
    checks the merged policy again)."""
    from engine_ext.control.autoscale_policy import AutoscalePolicy

    lo = changes.get("min_dp", 1)
    probe: dict[str, Any] = {"min_dp": lo, "max_dp": max(lo, changes.get("max_dp", lo)) if isinstance(lo, int) else 1}
    untouched = [
        k for k in ("target_queue", "target_kv", "slo_ttft_ms", "slo_tpot_ms", "target_utilization") if k not in changes
    ]
    if untouched:  # a target the deployment may keep: "at least one target" is the controller's check
        probe[untouched[0]] = 0.5
    try:
        AutoscalePolicy(**{**probe, **changes}).validated()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return changes


def autoscale(t: Target, changes: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
    """Set the autoscaling policy (``changes`` over the one the deployment keeps)."""
    t.validated()
    if not changes:
        raise UsageError("nothing to set: give --min-dp/--max-dp, --mode or a target (or --show)")
    changes = check_autoscale_changes(changes)
    return driver(t, api_key).set_autoscale(changes)


def autoscale_show(t: Target, api_key: str | None = None) -> dict[str, Any]:
    t.validated()
    return driver(t, api_key).autoscale_policy()


def autoscale_decisions(t: Target, since: float = 0.0, api_key: str | None = None) -> dict[str, Any]:
    t.validated()
    return driver(t, api_key).autoscale_decisions(since)
