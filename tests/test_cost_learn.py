"""The cost model a deployment learns from its own scales (engine_ext/control/cost_learn.py): from
operation records it fits the shipped model's form, exactly the offline fit of the same records;
it keeps and restores its points with the deployment's durable state; a host with no fit says so,
and how far the learning is, until it has one. Pure: no deployment (the reference engine's
scales feed it in tests/test_autoscale_local.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eepctl import render
from engine_ext.control import cost_model as cm
from engine_ext.control.cost_learn import MIN_SCALES, LearnedCost
from tests.helpers import (
    KNOWN_MOVE,
    KNOWN_PAUSE,
    ROOT,
    assert_fit_recovers_known_prices,
    cost_plan,
    cost_points,
    write_cost_model,
)

MIB = 2**20


def _op(i: int, cost: dict[str, Any], pool: bool = True, **kw: Any) -> dict[str, Any]:
    """A finished scale's record as the controller keeps it (the fields the learner reads)."""
    return {
        "op_id": f"op-{i}",
        "kind": "scale",
        "state": "succeeded",
        "from_size": 2,
        "to_size": 4,
        "finished": 1_700_000_000.0 + i,
        "plan": {"joining": [{"rank": 2, "from_standby": pool}, {"rank": 3, "from_standby": pool}]},
        "cost": cost,
        **kw,
    }


def _synthetic_ops() -> list[dict[str, Any]]:
    """Records whose measurements lie exactly on known prices (tests.helpers.cost_points)."""
    ops = []
    for i, p in enumerate(cost_points(KNOWN_MOVE, KNOWN_PAUSE)):
        pred = {f: p[f] for f in cm.MOVE_FEATURES + cm.PAUSE_FEATURES} | {"commit_bytes": 0, "moved_bytes": 1}
        ops.append(_op(i, {"predicted": pred, "measured": {"move_s": p["move_s"], "pause_s": p["pause_s"]}}))
    return ops


def _plan() -> dict[str, Any]:
    return cost_plan("op-9", max_receive_bytes=2 * MIB, max_spare_bytes=0, max_commit_copy_bytes=0)


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped model is one fitted on another host (999 CPUs): it predicts nothing here."""
    model = cm.fit(cost_points((0.004, 2.5e-9), (0.018, 3e-11)), cm.host_identity() | {"cpus": 999}, ["x"])
    monkeypatch.setenv(cm.ENV, str(write_cost_model(tmp_path, model)))


def test_a_host_without_a_fit_says_so_learns_and_then_predicts_from_its_own_scales(elsewhere: None) -> None:
    learned, ops = LearnedCost(), _synthetic_ops()
    for op in ops[: MIN_SCALES - 1]:
        assert learned.observe(op, "reuse")
    model, why = learned.choose("cpu")
    assert model is None and why.startswith(
        f"no cost model fitted on this host yet: learning ({MIN_SCALES - 1} of {MIN_SCALES} scales that moved "
        "experts measured); the shipped model is not for this host ("
    ), why
    text = render.plan_text(_plan() | {"cost": cm.predict(_plan(), MIB, 4, "reuse", True, model, why)})
    assert "predicted cost: no cost model fitted on this host yet: learning (3 of 4" in text, text
    assert "move time" not in text  # no time is guessed
    assert learned.observe(ops[MIN_SCALES - 1], "reuse")
    model, why = learned.choose("cpu")
    assert model is not None and why == ""
    assert_fit_recovers_known_prices(model)
    cost = cm.predict(_plan(), MIB, 4, "reuse", True, model, why)
    assert cost["move_s"] == pytest.approx(0.004 + 2.5e-9 * 4 * MIB, rel=1e-9)
    assert cost["model"]["learned"] == MIN_SCALES
    text = render.plan_text(_plan() | {"cost": cost})
    assert "predicted cost (fitted on this deployment's own 4 scale(s), last at 2023-11-14 22:13:23 UTC)" in text


def test_scale_ups_and_scale_downs_get_a_pause_fit_each_once_each_has_enough_points(elsewhere: None) -> None:
    """Scale-downs pausing 0.4x what scale-ups do (a joiner's rendezvous and re-warm): once four of
    each are known, an up is priced by the ups' fit and a down by the downs', not both by one fit
    between them; before that, by the policy's one fit."""
    ups = _synthetic_ops()
    downs = [
        op
        | {"op_id": f"op-d{i}", "from_size": 4, "to_size": 2}
        | {
            "cost": op["cost"]
            | {"measured": op["cost"]["measured"] | {"pause_s": 0.4 * op["cost"]["measured"]["pause_s"]}}
        }
        for i, op in enumerate(ups)
    ]
    learned = LearnedCost()
    for op in ups + downs[: MIN_SCALES - 1]:
        assert learned.observe(op, "reuse")
    up_plan, down_plan = _plan(), _plan() | {"joining": []}
    held = 4 * MIB  # the plan's rank_expert_bytes: 1 MiB experts, 4 slots
    model, _ = learned.choose("cpu")
    assert model is not None and set(model["pause_by_direction"]["reuse"]) == {"up"}
    one = cm.predict(down_plan, MIB, 4, "reuse", True, model)["pause_s"]
    assert one == pytest.approx(
        cm.pause_s(model | {"pause_by_direction": {}}, cm.plan_features(down_plan, MIB, 4), "reuse")
    )
    assert learned.observe(downs[-1], "reuse")
    model, _ = learned.choose("cpu")
    up = cm.predict(up_plan, MIB, 4, "reuse", True, model)["pause_s"]
    down = cm.predict(down_plan, MIB, 4, "reuse", True, model)["pause_s"]
    assert up == pytest.approx(0.018 + 3.0e-11 * held, rel=1e-6)
    assert down == pytest.approx(0.4 * (0.018 + 3.0e-11 * held), rel=1e-6)
    combined = cm.pause_s(model | {"pause_by_direction": {}}, cm.plan_features(down_plan, MIB, 4), "reuse")
    assert down < combined < up, "the policy's one fit lies between them"


def test_only_succeeded_scales_with_a_recorded_cost_teach_it_and_each_once() -> None:
    learned, op = LearnedCost(), _synthetic_ops()[1]
    assert not learned.observe(op | {"state": "rolled_back"}, "reuse")
    assert not learned.observe(op | {"kind": "recover"}, "reuse")
    assert not learned.observe(op | {"cost": {}}, "reuse")  # a no-op scale records no cost
    assert learned.observe(op, "reuse") and not learned.observe(op, "reuse")
    assert len(learned.points) == 1 and learned.points[0]["pool"] is True
    assert learned.points[0]["total_moved_bytes"] == op["cost"]["predicted"]["total_moved_bytes"]


def _h100_ops() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The scales of a real CUDA bytes curve on an H100 (tests/data: 9 scales, 5 sizes), as the
    operation records they came from: each row's ``cost`` is its operation's."""
    res = json.loads((ROOT / "tests/data/h100_cuda_fit_curves.json").read_text())
    return res, [_op(i, r["cost"], pool=r["pool"]) for i, r in enumerate(res["bytes"])]


def test_learned_from_a_real_curves_scales_it_is_the_offline_fit_of_them(elsewhere: None) -> None:
    """A fresh host (no shipped fit applies) that made the H100 curve's scales itself has the fit
    benchmarks/fit_cost.py makes of the same scales: the same coefficients, the same spread."""
    from benchmarks import fit_cost

    res, ops = _h100_ops()
    learned = LearnedCost()
    for op in ops:
        learned.observe(op, "reuse", device="cpu")
    offline = cm.fit(fit_cost.points(res), res["host"], ["x"])
    got, _ = learned.choose("cpu")
    assert got is not None and got["learned"] == len(ops) == 9
    for part, want in (("move", offline["move"]), ("pause", offline["pause"]["reuse"])):
        have = got["move"] if part == "move" else got["pause"]["reuse"]
        assert have["intercept"] == pytest.approx(want["intercept"], rel=1e-9), part
        assert have["coef"].keys() == want["coef"].keys(), part
        for f, c in want["coef"].items():
            assert have["coef"][f] == pytest.approx(c, rel=1e-9), (part, f)
        assert have["spread"] == pytest.approx(want["spread"], rel=1e-9), part
        assert have["not_fitted"] == want["not_fitted"], part


def test_the_points_persist_and_a_restored_learner_has_the_same_fit(elsewhere: None) -> None:
    """What the controller writes into its durable state (JSON) brings the fit back after a restart."""
    _, ops = _h100_ops()
    learned = LearnedCost()
    for op in ops:
        learned.observe(op, "reuse")
    restored = LearnedCost.from_dict(json.loads(json.dumps(learned.to_dict())))
    assert restored.fit == learned.fit and restored.fit is not None
    assert not restored.observe(ops[0], "reuse")  # learned from once, also across the restart
    assert LearnedCost.from_dict(None).choose("cpu")[0] is None


def test_the_controllers_durable_state_keeps_the_points_and_a_restarted_controller_restores_them(
    elsewhere: None,
) -> None:
    """What the Ray controller writes into the GCS KV (``controller_memory.snapshot`` of its
    orchestrator, JSON) and what a restarted one restores from it (``restore_learned``): the same
    points, the same fit. No cluster: the orchestrator is the real one, with no ranks."""
    from types import SimpleNamespace

    from engine_ext.config import EngineConfig
    from engine_ext.control.orchestrator import Orchestrator
    from engine_ext.ray.controller_memory import restore_learned, snapshot

    _, ops = _h100_ops()
    before = Orchestrator("d", EngineConfig(), SimpleNamespace(pool=None), max_dp=4)  # type: ignore[arg-type]
    for op in ops:
        before.admission.learned.observe(op, "reuse")
    saved = json.loads(json.dumps(snapshot(before, started=True)))
    after = Orchestrator("d", EngineConfig(), SimpleNamespace(pool=None), max_dp=4)  # type: ignore[arg-type]
    assert after.admission.learned.choose("cpu")[0] is None  # a fresh controller knows nothing yet
    restore_learned(after, saved)
    assert after.admission.learned.points == before.admission.learned.points and len(ops) == 9
    assert after.admission.learned.choose("cpu")[0] == before.admission.learned.fit is not None
