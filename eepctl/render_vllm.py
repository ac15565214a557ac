"""A vLLM rank's worker as `eepctl status` prints it, one line per rank (pure).

The worker (the driver worker of each DP rank, under whatever executor vLLM started it) reports
its own record; the registry merges it into the rank's (engine_ext.control.worker_records). The
table's columns show the rank; these lines say where its worker runs and what it measured: MoE
workspace, warm-up passes and capture passes with their per-size timings.
"""

from __future__ import annotations

import time
from typing import Any

from eepctl.render_text import human_bytes


def _ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{float(seconds) * 1000:.0f} ms"


def _workspace(r: dict[str, Any]) -> str:
    if not r.get("workspace_available"):
        return f"workspace n/a ({r.get('workspace_note') or 'not reported'})"
    return f"workspace {human_bytes(r.get('workspace_bytes'))} {'locked' if r.get('workspace_locked') else 'unlocked'}"


def _rss(r: dict[str, Any]) -> str:
    return "" if r.get("worker_rss_bytes") is None else f", resident {human_bytes(r['worker_rss_bytes'])}"


def _captures(r: dict[str, Any]) -> str:
    text = f"capture passes {r.get('captures_total', 0)} ({r.get('captures_this_op', 0)} in {r.get('last_op') or '-'})"
    sizes = r.get("capture_times_s") or {}
    if sizes:
        by_size = ", ".join(f"{s}: {_ms(t)}" for s, t in sorted(sizes.items(), key=lambda kv: (len(kv[0]), kv[0])))
        text += f", last {_ms(r.get('last_capture_pass_s'))} [{by_size}]"
    return text


def worker_lines(snap: dict[str, Any]) -> list[str]:
    """One line per vLLM rank whose worker has reported; one saying so for a rank whose has not."""
    out = []
    for r in sorted(snap.get("ranks", []), key=lambda r: r["rank"]):
        if r.get("kind") != "vllm":
            continue
        if not r.get("worker_executor"):
            out.append(f"rank {r['rank']} worker: no report yet")
            continue
        out.append(
            f"rank {r['rank']} worker: {r['worker_executor']} pid {r.get('worker_pid')} "
            f"({float(r.get('worker_age_s') or 0):.1f}s ago){_rss(r)}; {_workspace(r)}; warm-ups "
            f"{r.get('warmups_total', 0)} ({r.get('warmups_this_op', 0)} in {r.get('last_op') or '-'}), "
            f"last {_ms(r.get('last_warmup_s'))}; {_captures(r)}"
        )
    return out


def vllm_lines(snap: dict[str, Any]) -> list[str]:
    """A vLLM deployment's workers, its wedged state and its engines' fault-tolerance health."""
    out: list[str] = worker_lines(snap)
    wedge = (snap.get("info") or {}).get("wedged")
    if wedge:
        since = time.strftime("%H:%M:%S UTC", time.gmtime(float(wedge.get("since") or 0)))
        out.append(
            f"WEDGED since {since} (failing phase: {wedge.get('phase')}): {wedge.get('cause')}"
            f"{'; ' + wedge['error'] if wedge.get('error') else ''}. Remedy: {wedge.get('remedy')}"
        )
    found = ((snap.get("info") or {}).get("control") or {}).get("vllm") or {}
    for key in ("server_down", "flag_stuck", "engines"):  # what the vLLM controller's loop found, what repair would do
        if found.get(key):
            out.append(
                f"controller: {found[key]['reason']}"
                + (f"; repair: {found[key]['repair']}" if found[key].get("repair") else "")
            )
    ft = snap.get("fault_tolerance")
    if ft:
        out.append(
            "fault tolerance: " + (ft.get("error") or ", ".join(_engine_health(e) for e in ft.get("engines", [])))
        )
    return out


def _engine_health(e: dict[str, Any]) -> str:
    """One engine as vLLM's fault tolerance reports it: id, status and the fault, if any."""
    fault = f" ({e['fault_info']})" if e.get("fault_info") else ""
    return f"engine {e.get('id')} {e.get('status')}{fault}"
