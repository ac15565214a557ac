"""`eepctl status` rendered: the per-rank table, ranks needing attention first, and the lines
under it (self-healing, control plane, ingresses, autoscaler, nodes, pools, warnings)."""

from __future__ import annotations

from typing import Any

from eepctl.render_control import control_lines, ingress_lines
from eepctl.render_gpu import shared_gpu_lines
from eepctl.render_text import human_bytes, natural_width, rich_text
from eepctl.render_vllm import vllm_lines


def capture_cell(r: dict[str, Any]) -> str:
    """Capture kind, sizes, the last pass's duration, replays and refused stale replays; "n/a" only
    for a rank with no graphs at all (a vLLM rank run eagerly), with why."""
    kind = r.get("graph_kind") or "cpu-static"
    if kind == "none":
        return "n/a (eager vLLM: CPU or --enforce-eager)"
    sizes = r.get("capture_sizes") or []
    cell = f"{kind} {len(sizes)} sizes"
    last_pass = r.get("last_capture_pass_s")
    if last_pass is None:
        last_pass = r.get("last_capture_s")
    return cell + (f" {last_pass * 1000:.0f} ms" if last_pass is not None else "")


def replays_cell(r: dict[str, Any]) -> str:
    """Replays, and replays refused against a reallocated buffer (I3), which must stay 0."""
    if r.get("graph_kind") == "none":
        return "-"
    stale = r.get("stale_replays_refused", 0)
    return f"{r.get('graph_replays', 0)}" + (f" ({stale} STALE)" if stale else "")


# Ranks needing attention first: failed, stale, any other state than serving, then serving.
_ATTENTION = {"failed": 0, "stale": 1}


def attention_order(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(ranks, key=lambda r: (_ATTENTION.get(r["state"], 3 if r["state"] == "serving" else 2), r["rank"]))


def filter_ranks(snap: dict[str, Any], states: list[str] | None = None, node: str | None = None) -> dict[str, Any]:
    """The snapshot with only the ranks in ``states`` (any, when empty) on ``node`` (the node id,
    its IP or the full "node/ip"); the summary still describes the whole deployment."""
    wanted = {s.strip() for item in states or [] for s in item.split(",") if s.strip()}

    def keep(r: dict[str, Any]) -> bool:
        where = {r.get("node", ""), *r.get("node", "").split("/"), r.get("node_ip", ""), node_label(r)}
        node_id = r.get("node_id", "")
        return (not wanted or r["state"] in wanted) and (
            not node or node in where or bool(node_id and node_id.startswith(node))
        )

    ranks = [r for r in snap["ranks"] if keep(r)]
    return {**snap, "ranks": ranks, "filtered": len(ranks) != len(snap["ranks"])}


def eplb_share(snap: dict[str, Any], rank: int) -> str:
    share = (snap.get("eplb") or {}).get("rank_share", {}).get(str(rank))
    return "–" if share is None else f"{share * 100:.1f}%"


def status_text(snap: dict[str, Any], width: int = 160, max_rows: int | None = None) -> str:
    """The per-rank table, ranks needing attention first and one line each: every column where
    they fit in ``width``, else every one but the memory, else a compact set (the states' reasons are
    listed under the table).
    ``max_rows`` (watch mode: the screen's height) cuts the table and says how many are left out."""
    ranks = attention_order(snap["ranks"])
    shown = ranks if max_rows is None else ranks[: max(1, max_rows)]
    table = _status_table(snap, shown, compact=False)
    if natural_width(table) > width:  # the memory column is the first to go, then the compact set
        table = _status_table(snap, shown, compact=False, memory=False)
    if natural_width(table) > width:
        table = _status_table(snap, shown, compact=True)
    return rich_text([table, *status_summary_lines(snap, left_out=len(ranks) - len(shown))], width)


def _status_table(snap: dict[str, Any], ranks: list[dict[str, Any]], compact: bool, memory: bool = True) -> Any:
    from rich.table import Table

    table = Table(title=f"deployment {snap['deployment']} ({snap.get('kind', 'reference')})", title_justify="left")
    cols = (
        ("rank", "identity", "state", "run/wait", "kv", "workspace", "graphs", "hb")
        if compact
        else (
            "rank",
            "identity",
            "node",
            "state",
            "run/wait",
            "slots",
            "kv",
            "mem",
            "workspace",
            "graphs",
            "replays",
            "eplb",
            "hb",
        )
    )
    if not memory:
        cols = tuple(c for c in cols if c != "mem")
    for col in cols:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    for r in ranks:
        lock = "L" if compact else ("locked" if r.get("workspace_locked") else "unlocked")
        ws = f"{human_bytes(r.get('workspace_bytes'))} {lock if r.get('workspace_locked') or not compact else 'U'}"
        run_wait = f"{r['requests_running']}/{r['requests_waiting']}"
        kv = f"{r['kv_blocks_used']}/{r['kv_blocks_total']}"
        age = f"{r.get('heartbeat_age_s', 0.0):.1f}s"
        if compact:
            kind = {"cuda": "cuda", "none": "n/a"}.get(r.get("graph_kind") or "", "cpu")
            graphs = f"{r.get('graphs_captured', 0)} {kind}"
            table.add_row(str(r["rank"]), r["instance_id"], r["state"], run_wait, kv, ws, graphs, age)
        else:
            cells = [str(r["rank"]), r["instance_id"], node_label(r), r["state"], run_wait]
            cells += [f"{r['slots_used']}/{r['slots_total']}", kv] + ([memory_cell(r)] if memory else [])
            table.add_row(*cells, ws, capture_cell(r), replays_cell(r), eplb_share(snap, r["rank"]), age)
    return table


def memory_cell(r: dict[str, Any]) -> str:
    """What the rank's processes hold resident (a vLLM rank: engine core and worker); – where not reported."""
    return "–" if r.get("memory_bytes") is None else human_bytes(r["memory_bytes"])


def standby_line(snap: dict[str, Any]) -> str:
    """The standby ranks: a reference standby pool's launched ranks, or the engine cores of the
    prepare a vLLM server holds open; with what they hold resident where they report it."""
    s = snap["summary"]
    n, held, kv = s["standby"], s.get("standby_memory_bytes"), s.get("standby_kv_cache_bytes")
    holds = (
        "" if held is None else f"; they hold {human_bytes(held)}" + (f" (KV cache {human_bytes(kv)})" if kv else "")
    )
    if snap.get("kind") == "vllm":
        dp = ((snap.get("info") or {}).get("standby") or {}).get("prepared")
        commit = f"a scale to DP {dp} is its commit" if dp else "a scale to the prepared size is its commit"
        return f"standby: {n} engine core(s) prepared ahead (vLLM's prepare held open; {commit}){holds}"
    return (
        f"standby pool: {n} rank(s) launched ahead, in no DP group (not counted in DP); "
        f"a scale-up adopts them as _dp<rank>{holds}"
    )


def status_summary_lines(snap: dict[str, Any], left_out: int = 0) -> list[str]:
    """The lines under the table; each concern appends its own (kept apart so they merge)."""
    s = snap["summary"]
    states = ", ".join(f"{n} {k}" for k, n in sorted(s["by_state"].items())) or "no ranks"
    held = "" if s.get("memory_bytes") is None else f"; memory held {human_bytes(s['memory_bytes'])}"
    lines = [
        f"{s['ranks']} rank(s): {states}; requests running {s['requests_running']}, waiting {s['requests_waiting']}"
        + held
    ]
    lines += _selfheal_lines(snap)
    lines += control_lines(snap) + ingress_lines(snap)
    lines += _autoscale_lines(snap)
    per_node = ranks_per_node(snap["ranks"])
    if len(per_node) > 8:  # at scale, a distribution instead of one entry per node
        counts = sorted(per_node.values())
        lines.append(f"ranks per node: {len(per_node)} nodes, {counts[0]}..{counts[-1]} each (narrow with --node)")
    elif per_node:
        lines.append("ranks per node: " + ", ".join(f"{node} {n}" for node, n in per_node.items()))
    if s.get("standby"):
        lines.append(standby_line(snap))
    if network := (snap.get("info") or {}).get("reverse_dns"):
        lines.append(
            f"reverse DNS: {', '.join(network)} not in /etc/hosts: torch looks up every peer of a scale's "
            "TCPStore connections, and a DNS reply lost costs a scale the resolver's timeout (5 s); list them there"
        )
    reuse = [r for r in snap["ranks"] if r.get("capture_policy") == "reuse"]
    if reuse:  # what the reuse capture policy costs against recapture at this world
        held, right = reuse[0].get("workspace_bytes", 0), reuse[0].get("workspace_recapture_bytes", 0)
        lines.append(
            f"capture policy reuse: workspace {human_bytes(held)}/rank sized for max DP "
            f"(recapture would hold {human_bytes(right)}: +{human_bytes(max(0, held - right))}/rank)"
        )
    if left_out:
        lines.append(f"... {left_out} more rank(s) not shown (narrow with --state / --node)")
    if snap.get("filtered"):
        lines.append(f"showing {len(snap['ranks'])} rank(s) matching the filters")
    if snap.get("rebuilding"):
        lines.append(
            f"registry rebuilding: restarted {snap.get('registry_age_s', 0.0):.1f}s ago; "
            f"{s['ranks']} of {snap.get('expected_ranks')} rank(s) the controller runs have reported"
        )
    imb = (snap.get("eplb") or {}).get("imbalance")
    lines.append(
        "eplb imbalance (max/mean rank load, recent window): " + ("– (no load)" if imb is None else f"{imb:.2f}")
    )
    for r in attention_order(snap["ranks"]):  # a standby's reason is the standby pool line above
        if r.get("state_reason") and r["state"] not in ("serving", "standby"):
            lines.append(f"rank {r['rank']} {r['state']}: {r['state_reason']}")
    op = snap.get("operation")
    if op:
        lines.append(
            f"operation in progress: {op['op_id']} DP {op['from_size']} -> {op['to_size']}, phase {op['phase']}"
        )
    for v in snap.get("violations", []):
        lines.append(f"INVARIANT {v['invariant']} rank {v['rank']}: {v['message']}")
    lines.extend(shared_gpu_lines(snap["ranks"]))
    lines.extend(vllm_lines(snap))
    return lines


def _selfheal_lines(snap: dict[str, Any]) -> list[str]:
    """Desired vs current size, and the dead ranks with their cause until they are replaced."""
    info = snap.get("info") or {}
    lines = []
    if "desired_dp" in info:
        current = len(info.get("members", snap["ranks"]))
        lines.append(
            f"DP {current} of desired {info['desired_dp']} (on rank failure: {info.get('on_rank_failure', 'replace')})"
        )
    for d in info.get("dead") or []:
        lines.append(f"rank {d.get('rank')} dead: {d.get('cause', 'unknown cause')}")
    return lines


def _autoscale_lines(snap: dict[str, Any]) -> list[str]:
    """The autoscaling policy, its mode and the current recommendation and why (the controller
    keeps ``AutoscaleHost.autoscale_show()`` in the registry's info as ``autoscale``)."""
    from eepctl.render_autoscale import policy_line

    shown = (snap.get("info") or {}).get("autoscale") or {}
    if not shown.get("policy"):
        return []
    lines = [f"autoscale: {policy_line(shown['policy'])}"]
    last = shown.get("last")
    if last:
        lines.append(
            f"autoscale recommends DP {last['recommendation']} (now {last['current_dp']}), "
            f"{last['action']}: {last['rule']}"
        )
    return lines


def node_label(r: dict[str, Any]) -> str:
    """Ray node id prefix + IP (multi-node); host/IP under the process launcher."""
    if r.get("node_id"):
        return f"{r['node_id'][:8]}/{r.get('node_ip', '')}"
    return r.get("node", "")


def ranks_per_node(ranks: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ranks:
        out[node_label(r)] = out.get(node_label(r), 0) + 1
    return dict(sorted(out.items()))
