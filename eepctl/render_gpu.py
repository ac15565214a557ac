"""Status lines about ranks that share one GPU: without NVIDIA's MPS their kernels take turns, and
together they serve less than one rank would (docs/operations.md, "Ranks sharing a GPU: run MPS")."""

from __future__ import annotations

from typing import Any


def shared_gpu_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """One line per GPU that two or more ranks share while MPS is down for any of them."""
    by_gpu: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in ranks:
        if r.get("device_uuid") and r.get("state") != "standby":
            by_gpu.setdefault((r.get("node_ip") or r.get("node", ""), r["device_uuid"]), []).append(r)
    lines = []
    for (node, _), rs in sorted(by_gpu.items()):
        if len(rs) < 2 or all(r.get("mps") for r in rs):
            continue
        names = ",".join(str(r["rank"]) for r in sorted(rs, key=lambda r: r["rank"]))
        lines.append(
            f"ranks {names} share one GPU ({rs[0].get('device', 'cuda')} on {node}) without MPS: their "
            "kernels take turns, so together they serve less than one rank; start "
            "`nvidia-cuda-mps-control -d` on that node before the ranks"
        )
    return lines
