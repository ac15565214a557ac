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
from engine_ext.ray.deployment import call

POLL_S = 1.0


def _snapshot(registry: Any) -> dict[str, Any]:
    return call(registry.snapshot.remote(), timeout=30)


def set_count(registry: Any, snap: dict[str, Any], count: int, *, timeout_s: float) -> dict[str, Any]:
    """Ask the API server to keep ``count`` engine cores prepared; its summary once they are."""
    name = str(snap["deployment"])
    info = snap.get("info") or {}
    check_enabled(info, name)
    check_count(info, count)
    record = desired_record(count)
    asked = record[DESIRED_KEY]["asked"]
    call(registry.set_info.remote(record), timeout=30)
    return _followed(registry, name, count, asked, timeout_s=timeout_s)


def _followed(
    registry: Any, name: str, count: int, asked: str, *, timeout_s: float, gone_after_s: float = 0.0
) -> dict[str, Any]:
    """The summary once the API server applied request ``asked``; with ``gone_after_s``, an empty dict
    once its info is that old (the server stopped: nothing of it is held any more)."""
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
        if gone_after_s and time.time() - float(info.get("api_heartbeat") or 0.0) > gone_after_s:
            return {}
        if time.time() >= deadline:
            held = info.get("standby") or {}
            raise TransitionTimeout(
                f"the vLLM server of {name!r} did not hold {count} engine core(s) prepared within {timeout_s:.0f}s "
                f"(its state: {held.get('state')}, prepared DP {held.get('prepared')}); the count stays asked"
            )
        time.sleep(POLL_S)


def release_for_down(registry: Any, *, timeout_s: float, gone_after_s: float = 6.0) -> dict[str, Any] | None:
    """Before `down` removes the registry: a prepare the API server holds (or is making) dropped by
    asking count 0 and waiting for it. None when the server holds nothing or is gone (its info older
    than ``gone_after_s``, three of its 2 s periods: vLLM stopped every engine core it started);
    ``error`` when the drop did not happen in time."""
    snap = _snapshot(registry)
    info = snap.get("info") or {}
    held = info.get("standby")
    if not isinstance(held, dict) or time.time() - float(info.get("api_heartbeat") or 0.0) > gone_after_s:
        return None
    dp = held.get("prepared") or held.get("target")
    if dp is None and not held.get("count"):
        return None
    t0 = time.time()
    record = desired_record(0)
    try:
        call(registry.set_info.remote(record), timeout=30)
        name = str(snap["deployment"])
        done = _followed(
            registry, name, 0, record[DESIRED_KEY]["asked"], timeout_s=timeout_s, gone_after_s=gone_after_s
        )
    except EepError as e:
        return {"prepared_dp": dp, "dropped": False, "error": e.message}
    if not done:
        return None  # the server stopped meanwhile, its cores with it
    waited = round(time.time() - t0, 1)
    return {"prepared_dp": dp, "dropped": True, "drop_s": done.get("drop_s"), "waited_s": waited}
