"""A scale's cost, predicted (the dry run) and beside what it measured (``eepctl events``). Pure:
the plan's ``cost`` and the operation record's ``cost`` in, lines out (engine_ext.control.cost_model
makes them; docs/status-schema.md lists the keys)."""

from __future__ import annotations

from typing import Any


def _b(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _host(model: dict[str, Any]) -> str:
    h = model.get("host") or {}
    gpu = f" ({h['gpu']})" if h.get("gpu") else ""
    return f"{h.get('hostname')}, {h.get('cpus')} CPUs, {h.get('device')}{gpu}, {model.get('fitted_at')}"


def _fitted_by(model: dict[str, Any]) -> str:
    """Which model priced a plan: the deployment's own fit (its scales) or one fitted on a host."""
    if model.get("learned"):
        return f"fitted on this deployment's own {model['learned']} scale(s), last at {model.get('fitted_at')}"
    return f"model fitted on {_host(model)}"


def plan_cost_lines(plan: dict[str, Any]) -> list[str]:
    """The dry run's expert pre-copy (what moves while serving, what in the commit) and its
    predicted cost."""
    if not plan.get("precopy"):
        return []
    from engine_ext.elastic.precopy import describe  # torch-free

    return describe(plan["precopy"]) + predicted_lines(plan.get("cost"))


def predicted_lines(cost: dict[str, Any] | None) -> list[str]:
    """The dry run's prediction: serving pause, move time, bytes moved per rank, extra memory."""
    if not cost:
        return []
    per_rank = cost.get("per_rank", {})
    moved = ", ".join(f"{r}: {_b(v['moved_bytes'])}" for r, v in sorted(per_rank.items(), key=lambda kv: int(kv[0])))
    sizes = (
        f"up to {_b(cost.get('moved_bytes'))} moved per rank ({moved}), {_b(cost.get('commit_bytes'))} of it "
        f"in the commit; extra memory up to {_b(cost.get('extra_memory_bytes'))} per rank (spare buffers)"
    )
    if cost.get("no_model"):
        return [f"predicted cost: {cost['no_model']}", f"  {sizes}"]
    move = f"move time {_s(cost.get('move_s'))}{_range(cost.get('move_range_s'))} (pre-copy, while serving)"
    head = f"predicted cost ({_fitted_by(cost.get('model') or {})}): "
    if cost.get("pause_s") is None:  # the move is predicted, the pause is not: say so, and why
        lines = [
            head + move,
            f"  serving pause NOT PREDICTED: {cost.get('pause_note') or 'no pause fit applies'}",
            f"  {sizes}",
        ]
    else:
        lines = [
            head + f"serving pause {_s(cost.get('pause_s'))}{_range(cost.get('pause_range_s'))}, " + move,
            f"  {sizes}",
        ]
    if cost.get("pause_range_s") or cost.get("move_range_s"):
        lines.append("  (ranges: how far the fit's scales strayed, each predicted from the others, on that host)")
    if cost.get("pause_note") and cost.get("pause_s") is not None:
        lines.append(f"  note: {cost['pause_note']}")
    if cost.get("outside_fit"):
        lines.append(f"  note: outside the fitted range (extrapolated): {', '.join(cost['outside_fit'])}")
    return lines


def _range(r: list[float] | None) -> str:
    return f" ({r[0]:.3f}-{r[1]:.3f} s)" if r else ""


def _pair(pred: Any, got: Any, fmt: Any, err: float | None, inside: bool | None = None) -> str:
    notes = ([f"{err:+.0%}"] if err is not None else []) + (
        [f"{'inside' if inside else 'outside'} the range"] if inside is not None else []
    )
    return f"{fmt(pred)} vs {fmt(got)}" + (f" ({', '.join(notes)})" if notes else "")


def cost_lines(ops: list[dict[str, Any]]) -> list[str]:
    """Per operation with a measured cost: each predicted figure beside the measured one, with the
    relative error of the prediction."""
    out = []
    for op in ops:
        cost = op.get("cost") or {}
        pred, got, err = cost.get("predicted") or {}, cost.get("measured"), cost.get("error") or {}
        inside = cost.get("within_range") or {}
        if not got:
            continue
        pause = (
            _pair(pred.get("pause_s"), got.get("pause_s"), _s, err.get("pause_s"), inside.get("pause_s"))
            if pred.get("pause_s") is not None
            else f"not predicted vs {_s(got.get('pause_s'))}"
        )
        move = _pair(pred.get("move_s"), got.get("move_s"), _s, err.get("move_s"), inside.get("move_s"))
        moved = _pair(pred.get("moved_bytes"), got.get("moved_bytes"), _b, err.get("moved_bytes"))
        commit = _pair(pred.get("commit_bytes"), got.get("commit_bytes"), _b, err.get("commit_bytes"))
        extra = _pair(pred.get("extra_memory_bytes"), got.get("extra_memory_bytes"), _b, None)
        out.append(
            f"{op['op_id']} predicted vs measured: pause {pause}, move {move}, moved per rank {moved}, in the "
            f"commit {commit}, extra memory {extra}" + (f" [{pred['no_model']}]" if pred.get("no_model") else "")
        )
    return out


def capture_lines(cap: dict[str, Any] | None) -> list[str]:
    """`up`'s line on the capture policy: which one (and whether ``auto`` chose it), the workspace
    and KV blocks it holds per rank, what a scale then costs, and the option that takes the other."""
    if not cap:
        return []
    by = "auto" if cap.get("chosen_by") == "auto" else "--capture-policy"
    need = f"{cap['max_num_seqs']} requests of max_model_len {cap['max_model_len']} need {cap['need_kv_blocks']}"
    if cap["capture_policy"] == "reuse":
        return [
            f"  capture policy reuse ({by}): workspace {_b(cap['reuse_bytes'])}/rank sized for max DP "
            f"{cap['capture_world']} (recapture: {_b(cap['recapture_bytes'])} now), {cap['kv_blocks']} KV "
            f"blocks/rank left ({need}); the ranks that stay re-warm and capture nothing in a scale; "
            f"`{cap['other']}` opts out"
        ]
    auto = cap.get("auto")
    why = (
        f": reuse's workspace for max DP {auto['capture_world']} ({_b(auto['reuse_workspace_bytes'])}/rank) "
        f"would leave {auto['reuse_kv_blocks']} KV blocks/rank where {need}"
        if auto
        else ""
    )
    return [
        f"  capture policy recapture ({by}){why}{';' if auto else ':'} every rank re-warms and captures in "
        f"each scale (`{cap['other']}` keeps the workspace for max DP instead)"
    ]
