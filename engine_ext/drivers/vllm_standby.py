"""`eepctl standby --count N` on a vLLM deployment: the count asked through the registry, then followed.

The plugin in vLLM's API server holds vLLM's own prepare for DP + N open (engine_ext.vllm.standby);
it reads the count this writes into the registry's info every 2 s (engine_ext.control.vllm_standby)
and publishes its state there. This waits until that state says the held prepare matches the count
(N = 0: nothing held), it failed (exit 5), or ``timeout_s`` passed (exit 6). A server started
without ``EEPCTL_VLLM_STANDBY`` publishes no such state: refused (exit 4) before anything is written.
"""

from __future__ import annotations

import time
from typing import Any

from engine_ext.control.vllm_standby import DESIRED_KEY, check_count, check_enabled, desired_record, progress, summary
from engine_ext.protocol import EepError, TransitionFailed, TransitionTimeout

POLL_S = 1.0


def _snapshot(registry: Any) -> dict[str, Any]:
    from engine_ext.ray.deployment import call

    return call(registry.snapshot.remote(), timeout=30)


def set_count(registry: Any, snap: dict[str, Any], count: int, *, timeout_s: float) -> dict[str, Any]:
    """Ask the API server to keep ``count`` engine cores prepared; its summary once they are."""
    from engine_ext.ray.deployment import call

    name = str(snap["deployment"])
    info = snap.get("info") or {}
    check_enabled(info, name)
    check_count(info, count)
    record = desired_record(count)
    asked = record[DESIRED_KEY]["asked"]
    call(registry.set_info.remote(record), timeout=30)
    deadline = time.time() + timeout_s
    while True:
        snap = _snapshot(registry)
        info = snap.get("info") or {}
        where = progress(info, count, asked)
        if where == "done":
            return summary(snap, count)
        if where == "failed":
            err = (info.get("standby") or {}).get("error") or "no reason given"
            raise TransitionFailed(f"the vLLM server of {name!r} could not prepare {count} engine core(s): {err}")
        if time.time() >= deadline:
            held = info.get("standby") or {}
            raise TransitionTimeout(
                f"the vLLM server of {name!r} did not hold {count} engine core(s) prepared within {timeout_s:.0f}s "
                f"(its state: {held.get('state')}, prepared DP {held.get('prepared')}); the count stays asked"
            )
        time.sleep(POLL_S)


def release_for_down(registry: Any, *, timeout_s: float) -> dict[str, Any] | None:
    """Before `down` removes the registry: a prepare the API server holds (or is making) dropped by
    asking count 0 and waiting for it. None when the server holds nothing or is gone (its info stale:
    vLLM stopped every engine core it started); ``error`` when the drop did not happen in time."""
    from engine_ext.control.vllm_reconcile import INFO_FRESH_S

    snap = _snapshot(registry)
    info = snap.get("info") or {}
    held = info.get("standby")
    if not isinstance(held, dict) or time.time() - float(info.get("api_heartbeat") or 0.0) > INFO_FRESH_S:
        return None
    dp = held.get("prepared") or held.get("target")
    if dp is None and not held.get("count"):
        return None
    t0 = time.time()
    try:
        done = set_count(registry, snap, 0, timeout_s=timeout_s)
    except EepError as e:
        return {"prepared_dp": dp, "dropped": False, "error": e.message}
    return {"prepared_dp": dp, "dropped": True, "drop_s": done.get("drop_s"), "waited_s": round(time.time() - t0, 1)}
