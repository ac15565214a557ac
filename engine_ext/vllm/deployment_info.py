"""What a vLLM API server publishes about its deployment in the registry's info: its URL as other
hosts reach it, vLLM's DP bounds and expert layout, its own command line (API key hidden) and,
with the plugin's watch, vLLM's scaling and wedged state. Never the API key: only whether one is set.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from engine_ext.vllm.registry_link import KIND, node_name
from engine_ext.vllm.reverse_dns import network_lookups


def public_url(listen_address: str) -> str:
    """The API server's URL as another host reaches it (a wildcard bind becomes this node's IP)."""
    override = os.environ.get("EEPCTL_VLLM_API_URL")
    if override:
        return override
    parts = urlsplit(listen_address)
    host = parts.hostname or ""
    if host in ("", "0.0.0.0", "::"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, "", "", ""))
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


def deployment_info(vllm_config: Any, api_url: str, api_key_required: bool, watch: Any = None) -> dict[str, Any]:
    """What eepctl needs about a vLLM deployment. Never the API key: only whether one is set."""
    pc = getattr(vllm_config, "parallel_config", None)
    mc = getattr(vllm_config, "model_config", None)
    info: dict[str, Any] = {
        "kind": KIND,
        "api_url": api_url,
        "api_pid": os.getpid(),
        "api_node": node_name(),
        "api_heartbeat": time.time(),
        # vLLM's base identity; it gives DP rank r of a DP > 1 deployment "<base>_dp<r>"
        "instance_id": str(getattr(vllm_config, "instance_id", "") or ""),
    }
    if pc is not None:
        dp = int(getattr(pc, "data_parallel_size", 1) or 1)
        info.update(
            {
                "dp": dp,
                "max_dp": int(getattr(pc, "elastic_ep_max_dp_size", None) or dp),
                "elastic_ep": bool(getattr(pc, "enable_elastic_ep", False)),
                "dp_backend": str(getattr(pc, "data_parallel_backend", "") or ""),
                "expert_parallel": bool(getattr(pc, "enable_expert_parallel", False)),
                "eplb": bool(getattr(pc, "enable_eplb", False)),
                "fault_tolerance": bool(getattr(pc, "enable_fault_tolerance", False)),
            }
        )
        try:
            experts = int(mc.get_num_experts()) if mc is not None else 0
            redundant = int(getattr(getattr(pc, "eplb_config", None), "num_redundant_experts", 0) or 0)
            if experts:
                physical = experts + redundant
                info.update(
                    {"num_experts": experts, "num_redundant_experts": redundant, "min_dp": -(-experts * dp // physical)}
                )
        except Exception:  # noqa: BLE001
            pass
        # the addresses the scale's TCPStore connections are made between (engine_ext.vllm.reverse_dns)
        master = str(getattr(pc, "data_parallel_master_ip", "") or "127.0.0.1")
        info["reverse_dns"] = network_lookups(dict.fromkeys((master, "127.0.0.1")))
    if mc is not None:
        info["model"] = str(getattr(mc, "served_model_name", None) or getattr(mc, "model", ""))
    info["api_key_required"] = api_key_required
    info["api_command"] = restart_command()
    if watch is not None:  # the wedged state (None when healthy) and the scales this server ran
        from engine_ext.vllm import api_patches

        info.update(
            wedged=watch.wedge(),
            scaling=api_patches.scaling_flag(),
            scale_in_flight=watch.in_flight,  # vLLM's flag is up only for the commit; a scale runs longer
            scale_calls=watch.calls,
            api_patches=api_patches.status(),
        )
    try:
        import vllm

        info["vllm_version"] = str(vllm.__version__)
    except Exception:  # noqa: BLE001
        pass
    return info


@functools.lru_cache(maxsize=1)
def _own_cmdline() -> list[str]:
    """This process's command line as it was started (read once: the info is refreshed every 2 s)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return [sys.executable, *sys.argv]


def restart_command(cmdline: list[str] | None = None) -> str:
    """The API server's own command line, for the operator to run again after vLLM exited (a dead
    engine core takes the whole server down), with any API key replaced by ``$VLLM_API_KEY``."""
    import shlex

    if cmdline is None:
        cmdline = _own_cmdline()
    out: list[str] = []
    hide = False
    for arg in cmdline:
        if hide:
            out.append("$VLLM_API_KEY")
        elif arg.startswith("--api-key="):
            out.append("--api-key=$VLLM_API_KEY")
        else:
            out.append(shlex.quote(arg))
        hide = arg == "--api-key"
    return " ".join(out)
