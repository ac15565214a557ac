"""`eepctl autoscale`, `events --autoscaler` and `scale --retire` without a cluster: the checks
made before connecting (exit 2, the option named), and the pure renderers of real decision
records (eepctl/render_autoscale.py): the policy, the trail and the terminal plot."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from eepctl import render, render_autoscale
from eepctl.cli import app
from engine_ext.control.autoscaler import (
    AutoscalePolicy,
    Autoscaler,
    Observed,
    RankSignals,
)
from engine_ext.protocol import EepError, ExitCode, UsageError


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for var in ("RAY_ADDRESS", "VLLM_API_KEY", "EEPCTL_NAME", "EEPCTL_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    return CliRunner()


@pytest.mark.parametrize(
    "args, says",
    [
        (["autoscale", "--mode", "sometimes"], "--mode must be advisory or on or off"),
        (["autoscale", "--min-dp", "5", "--max-dp", "2"], "--min-dp 5 is over --max-dp 2"),
        (["autoscale", "--target-kv", "2"], "--target-kv"),
        (["autoscale", "--tolerance", "1.5"], "--tolerance must be below 1"),
        (["autoscale", "--max-step", "0"], "--max-step"),
        (["autoscale", "--show", "--mode", "on"], "change nothing"),
        (["autoscale"], "nothing to set"),
        (
            [
                "autoscale",
                "--target-queue",
                "0",
                "--target-kv",
                "0",
                "--slo-ttft-ms",
                "0",
                "--slo-tpot-ms",
                "0",
                "--target-utilization",
                "0",
            ],
            "give at least one target",
        ),
        (["autoscale", "--down-delay", "soon"], "--down-delay must be a number >= 0 or auto, not 'soon'"),
        (["autoscale", "--target-utilization", "1.5"], "--target-utilization is a fraction"),
        (
            ["autoscale", "--capacity", "/nonexistent/capacity.json"],
            "--capacity takes tokens/s or benchmarks/capacity.py",
        ),
        (["scale", "--dp", "2", "--retire", "three"], "--retire takes comma-separated rank numbers"),
        (["scale", "--dp", "2", "--retire", "1,1"], "--retire takes distinct rank numbers"),
        (["scale", "--dp", "2", "--dry-run", "--retire", "-1"], "--retire takes distinct rank numbers"),
    ],
)
def test_bad_values_are_usage_errors(runner: CliRunner, args: list[str], says: str) -> None:
    result = runner.invoke(app, args)
    err = result.exception
    assert isinstance(err, EepError), (result.exit_code, result.output, err)
    assert isinstance(err, UsageError) and err.exit_code == ExitCode.USAGE and says in err.message, err.message


def test_dropping_one_target_is_checked_by_the_controller_not_refused_here() -> None:
    from eepctl.core import check_autoscale_changes

    assert check_autoscale_changes({"target_queue": 0.0}) == {"target_queue": 0.0}
    assert check_autoscale_changes({"min_dp": 3}) == {"min_dp": 3}


def test_help_documents_the_options(runner: CliRunner) -> None:
    out = runner.invoke(app, ["autoscale", "--help"], env={"COLUMNS": "200"}).output
    for opt in (
        "--min-dp",
        "--max-dp",
        "--mode",
        "--target-queue",
        "--target-kv",
        "--slo-ttft-ms",
        "--slo-tpot-ms",
        "--up-delay",
        "--down-delay",
        "--tolerance",
        "--max-step",
        "--show",
        "--plot",
        "--target-utilization",
        "--drain",
        "--capacity",
    ):
        assert opt in out
    assert "--autoscaler" in runner.invoke(app, ["events", "--help"], env={"COLUMNS": "200"}).output
    assert "--retire" in runner.invoke(app, ["scale", "--help"], env={"COLUMNS": "200"}).output


def _trail() -> dict:
    """A load step (total requests 7 -> 24 -> 7) seen by a real autoscaler in mode on, with TTFT
    breaching its SLO 2x at the step's start and a failed scale."""
    policy = AutoscalePolicy(
        mode="on", min_dp=1, max_dp=6, target_queue=4, slo_ttft_ms=200, up_delay_s=10, down_delay_s=30, cooldown_s=5
    )
    a, dp = Autoscaler(policy), 2
    for t in range(0, 200, 5):
        total = 24.0 if 20 <= t < 70 else 7.0
        ttft = 450.0 if 20 <= t < 30 else 150.0
        d = a.decide(
            1000.0 + t,
            Observed(dp, [RankSignals(r, total / dp, 0.2, [ttft]) for r in range(dp)], num_experts=8, slots_per_rank=8),
        )
        if d.act:
            a.record_outcome(d.id, t != 25, "" if t != 25 else "rank 4 did not start")
            dp = d.recommendation if t != 25 else dp
    return {"deployment": "moe", "policy": policy.to_dict(), "decisions": a.recent()}


def test_renderers_show_the_policy_the_trail_and_the_plot() -> None:
    data = _trail()
    actions = [d["action"] for d in data["decisions"]]
    assert "scaled" in actions and "failed: rank 4 did not start" in actions
    assert any(a.startswith("blocked: cooldown") for a in actions) and data["decisions"][4]["panic"]
    plot = render_autoscale.plot_text(data, width=90)
    lines = plot.splitlines()
    assert lines[0].startswith("DP") and any(ln.startswith("load: queue per rank") for ln in lines)
    assert any(ln.startswith("SLO: p95 / SLO") for ln in lines)
    marks = lines[-3]
    assert {"S", "F", "B"} <= set(marks), marks
    assert all(len(ln) <= 90 for ln in lines)
    trail = render_autoscale.decisions_text(data)
    assert len(trail.splitlines()) == len(data["decisions"]) and "panic: ttft" in trail
    show = render_autoscale.show_text({"deployment": "moe", "policy": data["policy"], "last": data["decisions"][-1]})
    assert "mode on, DP 1..6" in show and "recommendation: DP" in show
    assert "no autoscaling policy" in render_autoscale.show_text({"deployment": "moe", "policy": None, "last": None})
    res = {"deployment": "moe", "policy": dict(data["policy"], mode="advisory"), "previous": None}
    assert "none is acted on" in render_autoscale.set_text(res)
    assert '"decisions"' in render.to_json("autoscale_decisions", data)


def test_the_dry_run_says_why_each_rank_leaves() -> None:
    plan = {
        "op_id": "op-1",
        "from_size": 4,
        "to_size": 2,
        "noop": False,
        "joining": [],
        "transfer_pairs": {},
        "leaving": [
            {"rank": 1, "instance_id": "moe_dp1", "chosen_by": "--retire"},
            {"rank": 3, "instance_id": "moe_dp3", "chosen_by": "least work", "requests": 0.0, "kv_blocks_used": 2.0},
        ],
        "expert_moves": [],
        "layout": {},
        "capture_memory": {},
    }
    text = render.plan_text(plan)
    assert "leave  rank 1 (moe_dp1), named by --retire" in text
    assert "leave  rank 3 (moe_dp3), least work: 0 requests, 2 KV blocks in use" in text


def test_status_shows_the_policy_and_the_recommendation() -> None:
    data = _trail()
    snap = {
        "summary": {"ranks": 0, "by_state": {}, "requests_running": 0, "requests_waiting": 0},
        "ranks": [],
        "info": {"autoscale": {"policy": data["policy"], "last": data["decisions"][20]}},
    }
    lines = render.status_summary_lines(snap)
    assert any(ln.startswith("autoscale: mode on, DP 1..6") for ln in lines), lines
    assert "autoscale recommends DP 5 (now 6), scaled: ttft held down for 30s (>= 30s): DP 5" in lines, lines
    snap["info"] = {}
    assert not any(ln.startswith("autoscale") for ln in render.status_summary_lines(snap))


def test_auto_delays_and_the_capacity_file_reach_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--up-delay auto`` and friends pass as "auto"; ``--capacity FILE`` as the tokens/s per rank
    benchmarks/capacity.py's JSON says; the policy line renders them."""
    from eepctl import core
    from tests.helpers import ROOT

    seen: list[dict] = []

    def autoscale(t: object, changes: dict, api_key: str | None = None) -> dict:
        seen.append(changes)
        return {"deployment": "moe", "policy": AutoscalePolicy(**changes).validated().to_dict(), "previous": None}

    monkeypatch.setattr(core, "autoscale", autoscale)
    path = ROOT / "docs/results/h100_2026-12-05b/capacity_cpu_16cores_64clients.json"
    result = CliRunner().invoke(
        app,
        [
            "autoscale",
            "--target-utilization",
            "0.8",
            "--up-delay",
            "auto",
            "--down-delay",
            "auto",
            "--cooldown",
            "5",
            "--capacity",
            str(path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen[0]["up_delay_s"] == "auto" and seen[0]["cooldown_s"] == 5.0
    assert seen[0]["capacity_tokens_s"] == pytest.approx(1746.6, abs=0.1)
    assert "targets: load at 80% of capacity; up after auto, down after auto" in result.output, result.output
