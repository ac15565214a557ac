"""Changing a deployment's width: a scale's dry-run plan, the scale itself, and the standby pool
of ranks launched ahead that a scale-up adopts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eepctl.core.target import Target, driver
from engine_ext.protocol import UsageError


def check_retire(retire: list[int] | None) -> list[int] | None:
    """``--retire``: distinct rank numbers >= 0 (whether they are members is the controller's check)."""
    if retire is None:
        return None
    if any(r < 0 for r in retire) or len(set(retire)) != len(retire):
        raise UsageError(f"--retire takes distinct rank numbers >= 0, got {','.join(map(str, retire))}")
    return sorted(retire)


def plan(t: Target, dp: int, api_key: str | None = None, retire: list[int] | None = None) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    retire = check_retire(retire)
    return driver(t, api_key).plan(dp, retire)


def scale(
    t: Target,
    dp: int,
    *,
    drain_timeout_s: float,
    timeout_s: float,
    wait: bool,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
    api_key: str | None = None,
    on_op: Callable[[dict[str, Any]], None] = lambda o: None,
    request_id: str | None = None,
    retire: list[int] | None = None,
) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    if timeout_s <= 0 or drain_timeout_s < 0:
        raise UsageError("--timeout must be > 0 and --drain-timeout >= 0")
    if request_id is not None and not (0 < len(request_id) <= 128 and request_id.isprintable()):
        raise UsageError("--request-id must be 1 to 128 printable characters")
    retire = check_retire(retire)
    return driver(t, api_key).scale(
        dp,
        drain_timeout_s=drain_timeout_s,
        timeout_s=timeout_s,
        wait=wait,
        on_event=on_event,
        on_op=on_op,
        request_id=request_id,
        retire=retire,
    )


def standby(t: Target, count: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Resize the deployment's standby (ranks launched ahead, or engine cores prepared, as its driver
    keeps them); returns its summary once it is filled."""
    t.validated()
    if count < 0:
        raise UsageError(f"--count must be >= 0, got {count}")
    return driver(t, None).standby(count, timeout_s=timeout_s)
