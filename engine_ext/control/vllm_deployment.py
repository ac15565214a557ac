"""A vLLM deployment as its registry describes it: the API server, the size, the bounds, the wedge.

The plugin writes these facts into the registry (kind "vllm"); both the client (dry run) and the
in-cluster controller (admission, reconcile) read them through these functions. Ray- and httpx-free.
"""

from __future__ import annotations

import time
from typing import Any

from engine_ext.control.vllm_api import VllmApi
from engine_ext.protocol import DeploymentKind, UnreachableError

KIND = DeploymentKind.VLLM.value


def api_for(snap: dict[str, Any], api_key: str | None, timeout_s: float = 10.0) -> VllmApi:
    """The API server the plugin registered for this deployment."""
    url = (snap.get("info") or {}).get("api_url")
    if not url:
        raise UnreachableError(f"vLLM deployment {snap['deployment']!r} has not registered an API URL "
                               "(is its API server running with EEPCTL_DEPLOYMENT set?)")
    return VllmApi(url, api_key, timeout_s=timeout_s)


def current_size(snap: dict[str, Any]) -> int:
    info = snap.get("info") or {}
    if info.get("dp"):
        return int(info["dp"])
    return max(1, len(snap.get("ranks", [])))


def bounds_problem(snap: dict[str, Any], target: int) -> str:
    """A bound checked before asking vLLM. For a server without elastic EP vLLM's max is just
    its current size and vLLM itself answers; its refusal is passed on."""
    info = snap.get("info") or {}
    if not info.get("elastic_ep"):
        return ""
    if info.get("max_dp") and target > int(info["max_dp"]):
        return f"target DP {target} is over the deployment's max DP {info['max_dp']} (--elastic-ep-max-dp-size)"
    if info.get("min_dp") and target < int(info["min_dp"]):
        return (f"target DP {target} is under DP {info['min_dp']}, the fewest ranks that hold "
                f"{info.get('num_experts')} experts at this many slots per rank")
    return ""


def wedged_message(name: str, wedge: dict[str, Any]) -> str:
    """One line: since when the deployment is wedged, in which phase, and the exact remedy."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(wedge.get("since") or 0)))
    what = (f"a scale to DP {wedge['to_size']} failed in {wedge.get('phase')}" if wedge.get("to_size")
            else str(wedge.get("cause") or "vLLM's scaling flag stays set"))
    err = f" ({wedge['error']})" if wedge.get("error") else ""
    return (f"vLLM deployment {name!r} is wedged since {since}: {what}{err} and vLLM kept its scaling flag set, "
            f"so it answers 503 to every request; a scale cannot clear it. Remedy: {wedge.get('remedy')}")


def abandoned(op: dict[str, Any] | None) -> bool:
    """A running operation past its deadline that nobody runs any more (a client of an older
    eepctl that drove it and stopped, or a controller that died)."""
    return bool(op) and float(op.get("deadline", float("inf"))) <= time.time()
