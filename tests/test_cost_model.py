"""The scale cost model (engine_ext/control/cost_model.py): the least-squares fit recovers known
coefficients, a model from another host predicts nothing and says so, and the dry run and
``eepctl events`` render the prediction and the comparison. Pure: no deployment (the measured side
runs in tests/test_kv_budget.py's split scenario)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eepctl import render
from eepctl.render_events import events_text
from engine_ext.control import cost_model as cm
from tests.helpers import (
    KNOWN_MOVE,
    KNOWN_PAUSE,
    ROOT,
    SPARE_S_PER_B,
    assert_fit_recovers_known_prices,
    cost_plan,
    cost_points,
    write_cost_model,
)

MIB = 2**20


def test_fit_recovers_known_coefficients_exactly() -> None:
    model = cm.fit(cost_points(KNOWN_MOVE, KNOWN_PAUSE), cm.host_identity(), ["synthetic"])
    assert_fit_recovers_known_prices(model)
    mv, pz = model["move"], model["pause"]["reuse"]
    assert mv["max_rel_error"] < 1e-9 and pz["max_rel_error"] < 1e-9
    assert mv["range"]["total_moved_bytes"] == [MIB, 1024 * MIB]


def test_fit_leaves_out_a_feature_that_does_not_vary_and_names_it() -> None:
    pts = [p | {"rank_expert_bytes": 4096} for p in cost_points((0.01, 1e-9), (0.02, 0.0))]
    pz = cm.fit(pts, cm.host_identity(), ["synthetic"])["pause"]["reuse"]
    assert pz["not_fitted"] == ["rank_expert_bytes", "commit_load_bytes"] and pz["coef"] == {}
    assert pz["intercept"] == pytest.approx(0.02)
    with pytest.raises(ValueError, match="cannot fit"):  # 2 points, 3 coefficients
        cm.fit_linear(cost_points((0.01, 1e-9), (0.02, 0.0))[:2], cm.MOVE_FEATURES, "move_s")


def _plan() -> dict[str, Any]:
    return cost_plan()


def test_model_from_another_host_predicts_no_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = cm.fit(cost_points((0.004, 2.5e-9), (0.018, 3e-11)), cm.host_identity() | {"cpus": 999}, ["x"])
    monkeypatch.setenv(cm.ENV, str(write_cost_model(tmp_path, model)))
    got, why = cm.load_model("cpu")
    assert got is None and why.startswith("no cost model fitted on this host") and "999 CPUs" in why
    cost = cm.predict(_plan(), MIB, 4, "reuse", True, got, why)
    assert "pause_s" not in cost and "move_s" not in cost and cost["moved_bytes"] == 2 * MIB  # the plan's own
    text = render.plan_text(
        _plan()
        | {
            "precopy": _plan()["precopy"]
            | {"max_receive_bytes": 2 * MIB, "max_spare_bytes": 0, "max_commit_copy_bytes": 0},
            "cost": cost,
        }
    )
    assert "predicted cost: no cost model fitted on this host" in text and "moved per rank (0: 2.0 MiB" in text
    monkeypatch.setenv(cm.ENV, str(tmp_path / "absent.json"))
    assert "does not exist" in cm.load_model("cpu")[1]


def test_a_fit_on_another_gpu_of_a_same_named_host_predicts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lent machines share a hostname and a CPU count: an H100's fit must not price an H200's
    scales. A CPU model written before the GPU's name was kept (no ``gpu``) still matches a CPU host."""
    here = cm.host_identity("cpu")
    assert here["gpu"] == ""
    model = cm.fit(
        cost_points((0.004, 2.5e-9), (0.018, 3e-11)), here | {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}, ["x"]
    )
    assert cm.same_host(here | {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}, model["host"])
    assert not cm.same_host(here | {"device": "cuda", "gpu": "NVIDIA H200"}, model["host"])
    monkeypatch.setattr(cm, "gpu_name", lambda: "NVIDIA H200")  # this box has no GPU to ask
    monkeypatch.setenv(cm.ENV, str(write_cost_model(tmp_path, model)))
    got, why = cm.load_model("cuda")
    assert got is None and "cuda (NVIDIA H200)): " in why and why.endswith("CPUs, cuda (NVIDIA H100 80GB HBM3)"), why
    old = {k: v for k, v in here.items() if k != "gpu"}
    assert cm.same_host(here, old) and not cm.same_host(
        here | {"device": "cuda", "gpu": "NVIDIA H200"}, old | {"device": "cuda"}
    )


def test_prediction_and_comparison_rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        cm.ENV,
        str(
            write_cost_model(
                tmp_path,
                cm.fit(cost_points((0.004, 2.5e-9), (0.018, 3e-11)), cm.host_identity(), ["x"], copy_GBps=10.0),
            )
        ),
    )
    model, why = cm.load_model("cpu")
    assert model is not None, why
    cost = cm.predict(_plan(), MIB, 4, "reuse", True, model)
    assert cost["move_s"] == pytest.approx(0.004 + 2.5e-9 * 4 * MIB)  # all ranks' moved bytes
    assert cost["pause_s"] == pytest.approx(0.018 + 3e-11 * 4 * MIB) and "outside_fit" not in cost
    # the commit's moves cost the move's rate on top; another capture policy has no pause fitted
    commit = _plan()
    commit["precopy"]["per_rank"]["2"]["commit_moved"] = MIB
    assert cm.predict(commit, MIB, 4, "reuse", True, model)["pause_s"] == pytest.approx(
        0.018 + 3e-11 * 4 * MIB + 2.5e-9 * MIB
    )
    assert "pause_s" not in cm.predict(_plan(), MIB, 4, "recapture", False, model)
    # the commit's loads into slots: no curve point had any, so they cost the host's copy rate (10 GB/s)
    load = _plan()
    load["precopy"]["per_rank"]["0"]["commit_copy"] = MIB
    assert cm.predict(load, MIB, 4, "reuse", True, model)["pause_s"] == pytest.approx(
        0.018 + 3e-11 * 4 * MIB + MIB / 10e9
    )
    text = render.plan_text(
        _plan()
        | {
            "precopy": _plan()["precopy"]
            | {"max_receive_bytes": 2 * MIB, "max_spare_bytes": 0, "max_commit_copy_bytes": 0},
            "cost": cost,
        }
    )
    assert (
        "serving pause 0.018 s (0.018-0.018 s), move time 0.014 s (0.014-0.014 s) (pre-copy, while serving)" in text
    )  # an exact fit: no spread
    got = {"pause_s": 0.02, "move_s": 0.006, "moved_bytes": 2 * MIB, "commit_bytes": 0, "extra_memory_bytes": 0}
    op = {
        "op_id": "op-1",
        "from_size": 2,
        "to_size": 4,
        "state": "succeeded",
        "cost": {"predicted": cost, "measured": got, "error": cm.relative_errors(cost, got)},
    }
    assert op["cost"]["error"]["move_s"] == pytest.approx((cost["move_s"] - 0.006) / 0.006)
    line = next(ln for ln in events_text({"operations": [op]}).splitlines() if "predicted vs" in ln)
    assert "pause 0.018 s vs 0.020 s (-9%)" in line and "move 0.014 s vs 0.006 s (+141%)" in line, line
    op["cost"]["within_range"] = cm.within_range(cost, got)
    assert op["cost"]["within_range"] == {"pause_s": False, "move_s": False}
    line = next(ln for ln in events_text({"operations": [op]}).splitlines() if "predicted vs" in ln)
    assert "pause 0.018 s vs 0.020 s (-9%, outside the range)" in line, line


def test_a_dry_run_says_plainly_when_no_pause_fit_applies_to_the_capture_policy() -> None:
    """A model fitted under reuse only: a recapture deployment's dry run predicts the move and
    says the pause is not predicted, for which policy, what the model has, and how to fit one."""
    model = cm.fit(cost_points((0.004, 2.5e-9), (0.018, 3e-11)), cm.host_identity(), ["x"])
    cost = cm.predict(_plan(), MIB, 4, "recapture", False, model)
    text = render.plan_text(
        _plan()
        | {
            "cost": cost,
            "precopy": _plan()["precopy"]
            | {"max_receive_bytes": 2 * MIB, "max_spare_bytes": 0, "max_commit_copy_bytes": 0},
        }
    )
    assert "serving pause -" not in text and "move time 0.014 s" in text, text
    assert (
        "serving pause NOT PREDICTED: no fit applies to capture policy recapture: the model has a pause fit "
        "for reuse only (benchmarks/fit_cost.py fits one from curves run under recapture)"
    ) in text, text
    op = {
        "op_id": "op-1",
        "from_size": 2,
        "to_size": 4,
        "state": "succeeded",
        "cost": {"predicted": cost, "measured": {"pause_s": 0.02, "move_s": 0.006}},
    }
    assert "pause not predicted vs 0.020 s" in events_text({"operations": [op]})


def test_the_range_is_the_fits_held_out_scatter_and_events_say_whether_a_scale_fell_inside() -> None:
    """Points off the line by x0.8 .. x1.5 (a pause of a few ms on shared cores strays like that):
    the range of a prediction is the prediction times the least and the most measured/predicted
    ratio of the fit's points, each predicted by the fit of the others (wider than their scatter
    about the fit that saw them), and a measurement is judged against it."""
    pts = cost_points((0.004, 2.5e-9), (0.004, 0.0))
    for p, k in zip(pts, (0.8, 1.0, 1.5, 1.0)):
        p["pause_s"] *= k
    model = cm.fit(pts, cm.host_identity(), ["x"])
    pz = model["pause"]["reuse"]
    # each point against the fit of the others (a scale the fit did not see), not against its own line
    others = [cm.fit_linear(pts[:i] + pts[i + 1 :], cm.PAUSE_FEATURES, "pause_s", loo=False) for i in range(len(pts))]
    ratios = [p["pause_s"] / cm._linear(o, p) for p, o in zip(pts, others)]
    own = [p["pause_s"] / cm._linear(pz, p) for p in pts]
    assert pz["spread"] == [pytest.approx(min(ratios)), pytest.approx(max(ratios))]
    assert pz["spread"][0] < min(own) < 0.9 and pz["spread"][1] > max(own) > 1.3
    assert model["move"]["spread"] == [pytest.approx(1.0), pytest.approx(1.0)]
    cost = cm.predict(_plan(), MIB, 4, "reuse", True, model | {"path": "x"})
    lo, hi = cost["pause_range_s"]
    assert lo == pytest.approx(cost["pause_s"] * pz["spread"][0]) and hi == pytest.approx(
        cost["pause_s"] * pz["spread"][1]
    )
    assert cm.within_range(cost, {"pause_s": hi * 0.99, "move_s": cost["move_s"]}) == {"pause_s": True, "move_s": True}
    assert cm.within_range(cost, {"pause_s": hi * 1.01, "move_s": cost["move_s"] * 2}) == {
        "pause_s": False,
        "move_s": False,
    }
    lines = render.plan_text(
        _plan()
        | {
            "precopy": _plan()["precopy"]
            | {"max_receive_bytes": 2 * MIB, "max_spare_bytes": 0, "max_commit_copy_bytes": 0},
            "cost": cost,
        }
    )
    assert f"serving pause {cost['pause_s']:.3f} s ({lo:.3f}-{hi:.3f} s)" in lines, lines
    assert "ranges: how far the fit's scales strayed, each predicted from the others, on that host" in lines


def test_a_price_that_fits_negative_is_left_out_and_the_rest_refitted() -> None:
    """Bytes cost time: where two points' noise makes landing in spare buffers look cheaper than
    landing in slots, the fit leaves that feature out (named in ``negative``) and refits the rest."""
    pts = cost_points((0.004, 2.5e-9), (0.018, 3e-11))
    for p in pts:
        p["move_s"] -= SPARE_S_PER_B * p["spare_total_bytes"] * 1.5  # spare bytes now "save" time
    mv = cm.fit(pts, cm.host_identity(), ["x"])["move"]
    assert mv["negative"] == ["spare_total_bytes"] and "spare_total_bytes" in mv["not_fitted"]
    assert set(mv["coef"]) == {"total_moved_bytes"} and mv["coef"]["total_moved_bytes"] > 0
    assert cm.fit(cost_points((0.004, 2.5e-9), (0.018, 3e-11)), cm.host_identity(), ["x"])["move"]["negative"] == []


def test_fit_cost_reports_a_held_out_check_from_one_run(capsys: pytest.CaptureFixture[str]) -> None:
    """``fit_cost.py --leave-one-size-out`` predicts each size of a recorded run (a CUDA bytes curve on
    an H100: 9 scales, 5 sizes) from a fit of the other sizes: its counts are those of the rows it prints."""
    from benchmarks import fit_cost

    fit_cost.leave_one_size_out([str(ROOT / "tests/data/h100_cuda_fit_curves.json")])
    out = capsys.readouterr().out.splitlines()
    rows = [ln.split(" | ") for ln in out if ln.startswith("| ")]
    assert len(rows) == 9 and {r[0] for r in rows} == {"| 64", "| 256", "| 1024", "| 4096", "| 8192"}
    within = lambda col: sum(abs(int(r[col].rstrip("%| "))) <= 25 for r in rows)  # noqa: E731
    assert out[-1] == f"within 25 %: pause on {within(4)} of 9 scales, move on {within(7)} of 9"
