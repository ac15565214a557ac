"""`eepctl standby`'s summary as text (pure): the reference engine's pool of launched ranks, or a
vLLM server's engine cores prepared ahead (vLLM's prepare for DP + N held open by the plugin)."""

from __future__ import annotations

from typing import Any


def standby_text(name: str, res: dict[str, Any]) -> str:
    line = (
        f"standby pool of {name}: {len(res['ready'])} of {res['size']} ready (standby numbers {res['ready']}), "
        f"{res['taken']} adopted so far"
    )
    if res.get("kind") != "vllm":
        return line + "\n"
    if res.get("prepared_dp"):
        held = f"vLLM's prepare for DP {res['prepared_dp']} held open at DP {res['dp']}"
        if res.get("prepare_s") is not None:
            held += f" (prepared in {res['prepare_s']:.1f}s)"
    else:
        held = f"no prepare held at DP {res['dp']} (max DP {res.get('max_dp')})"
    ranks = ", ".join(f"rank {r['rank']} pid {r['pid']} {r['instance_id']}" for r in res.get("standby_ranks") or [])
    return f"{line}; {held}" + (f"; standby: {ranks}" if ranks else "") + "\n"
