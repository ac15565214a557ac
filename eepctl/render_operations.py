"""What the commands that change a deployment print: `up` and `down`, a scale's dry-run plan
(the reference engine's and a vLLM deployment's) and its outcome."""

from __future__ import annotations

from typing import Any

from eepctl.render_control import api_lines
from eepctl.render_cost import capture_lines, plan_cost_lines
from engine_ext.protocol import REPORTED_PHASES


def _leave_reason(j: dict[str, Any]) -> str:
    """Why a rank leaves: named by --retire, or chosen for its little work (requests, KV blocks)."""
    if j.get("chosen_by") == "--retire":
        return ", named by --retire"
    if j.get("chosen_by"):
        work = (
            "did not answer"
            if j.get("requests") is None
            else f"{j['requests']:g} requests, {j.get('kv_blocks_used') or 0:g} KV blocks in use"
        )
        return f", least work: {work}"
    return ""


def _membership_lines(plan: dict[str, Any]) -> list[str]:
    """Ranks joining or leaving with their identities, and the weight-transfer pairs."""
    where = {
        p["rank"]: f" on node {p['node_id'][:8]}/{p['node_ip']}"
        for p in (plan.get("placement") or {}).get("nodes", [])
        if p.get("node_id")
    }
    lines = [
        f"  join   rank {j['rank']} as {j['instance_id']}{where.get(j['rank'], '')}"
        + (f" (from the standby pool: {j['from_standby']}, launch skipped)" if j.get("from_standby") else "")
        for j in plan.get("joining", [])
    ]
    lines += [f"  leave  rank {j['rank']} ({j['instance_id']}){_leave_reason(j)}" for j in plan.get("leaving", [])]
    lines += [
        f"  non-expert weights: rank {src} -> ranks {', '.join(map(str, dsts))}"
        for src, dsts in plan.get("transfer_pairs", {}).items()
    ]
    return lines


def plan_text(plan: dict[str, Any]) -> str:
    if plan.get("noop"):
        return f"already at DP {plan['to_size']}: nothing to do\n"
    if plan.get("kind") == "vllm":
        return vllm_plan_text(plan)
    lines = [f"plan {plan['op_id']}: DP {plan['from_size']} -> {plan['to_size']} (dry run, nothing changed)"]
    lines.extend(_membership_lines(plan))
    moves = plan.get("expert_moves", [])
    lines.append(f"  expert moves: {len(moves)}")
    for m in moves:
        lines.append(
            f"    expert {m['logical']}: rank {m['src_rank']} slot {m['src_slot']} -> "
            f"rank {m['dst_rank']} slot {m['dst_slot']}"
        )
    layout = plan.get("layout") or {}
    if layout:
        phys = layout["slots_per_rank"] * layout["world_size"]
        lines.append(
            f"  layout: {phys} physical slots for {layout['num_logical']} experts "
            f"({phys - layout['num_logical']} redundant)"
        )
    if plan.get("capture_memory"):
        from engine_ext.capture_memory import describe  # torch-free

        lines.append(f"  {describe(plan['capture_memory'])}")
    lines += [f"  {line}" for line in plan_cost_lines(plan)]
    if plan.get("capacity_problem"):
        lines.append(f"  WARNING: {plan['capacity_problem']}")
    if plan.get("running_op"):
        lines.append(f"  WARNING: {plan['running_op']} is running; a scale now would be refused")
    return "\n".join(lines) + "\n"


def vllm_plan_text(plan: dict[str, Any]) -> str:
    """A vLLM deployment's dry run: what eepctl knows, and what vLLM decides only inside the transition."""
    lines = [
        f"plan: DP {plan['from_size']} -> {plan['to_size']} via vLLM at {plan['api_url']} (dry run, nothing changed)"
    ]
    lines.extend(_membership_lines(plan))
    if plan.get("capacity_problem"):
        lines.append(f"  WARNING: {plan['capacity_problem']}")
    if plan.get("running_op"):
        lines.append(f"  WARNING: a scale ({plan['running_op']}) is running; a scale now would be refused")
    lines.append("  not exposed by vLLM:")
    lines.extend(f"    {n}" for n in plan.get("not_exposed", []))
    return "\n".join(lines) + "\n"


def scale_text(op: dict[str, Any], target_flags: str = "") -> str:
    """A scale's outcome; one still running (``--no-wait``) says how to follow it, with the
    ``target_flags`` (``--name ...``) that reach its deployment."""
    if op.get("state") == "running":
        return f"{op['op_id']} accepted; follow it with: eepctl events{target_flags} --op {op['op_id']} --follow\n"
    if op.get("from_size") == op.get("to_size"):
        return f"already at DP {op['to_size']}: nothing to do\n"
    pd = op.get("phase_durations", {})
    phases = ", ".join(f"{p} {pd[p]:.2f}s" for p in REPORTED_PHASES if p in pd)
    caps = ", ".join(f"rank {r}: {n}" for r, n in sorted(op.get("captures_per_rank", {}).items()))
    return (
        f"{op['op_id']}: DP {op['from_size']} -> {op['to_size']} {op['state']}\n"
        f"  phases: {phases}\n  serving pause: {op.get('serving_pause_s', 0.0) * 1000:.1f} ms\n"
        f"  captures per rank: {caps}\n"
    )


def up_text(res: dict[str, Any]) -> str:
    where = "a local Ray head eepctl started" if res["cluster_started"] else "the cluster"
    lines = [
        f"deployment {res['deployment']} serving at DP {res['dp']} (max {res['max_dp']}) on {where} at "
        f"{res['address']} in {res['elapsed_s']:.1f}s"
    ]
    for r in res.get("ranks", []):
        lines.append(f"  rank {r['rank']}: {r['instance_id']} pid {r['pid']} {r['state']}")
    return "\n".join(lines + capture_lines(res.get("capture")) + api_lines(res.get("ingress", []))) + "\n"


def down_text(res: dict[str, Any]) -> str:
    msg = f"deployment {res['deployment']} stopped" + released_text(res.get("released"))
    if res.get("cluster_stopped"):
        msg += "; the local Ray cluster eepctl started was stopped"
    elif res.get("cluster_note"):
        msg += f"; {res['cluster_note']}"
    return msg + "\n"


def released_text(released: dict[str, Any] | None) -> str:
    """What `down` gave back first: vLLM's engine cores held prepared, or why they are still held."""
    if not released:
        return ""
    if released.get("dropped"):
        return f"; the engine core(s) vLLM held prepared for DP {released.get('prepared_dp')} dropped"
    return (
        f"; the vLLM server still holds engine core(s) prepared for DP {released.get('prepared_dp')} "
        f"({released.get('error')}): they go when it stops"
    )
