"""The driver seam without a cluster: fake actor handles stand in for Ray's.

open_deployment decides the kind once from what the handles say; each driver refuses what its
engine cannot do with the exit-code table's error; eepctl/core.py never asks which kind it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_ext import drivers
from engine_ext.drivers.reference import ReferenceDriver
from engine_ext.drivers.vllm import VllmDriver
from engine_ext.protocol import (
    ExitCode,
    PreconditionError,
    TransitionFailed,
    UnreachableError,
)

ROOT = Path(__file__).resolve().parents[1]


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Registry:
    def __init__(self, snap: dict[str, Any], events: list[dict[str, Any]] | None = None) -> None:
        self.snapshot = _Method(lambda: snap)
        self.events = _Method(
            lambda op_id, seq: {
                "events": [e for e in events or [] if e["seq"] > seq],
                "operations": [{"op_id": op_id, "phase_durations": {"commit": 0.5}}],
            }
        )


class _Controller:
    def __init__(self, final: dict[str, Any]) -> None:
        self.scale = _Method(lambda dp, drain, timeout, wait: {"op_id": "op-1", "state": "running"})
        self.wait_op = _Method(lambda op_id, wait_s: final)


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """``call(ref)`` returns the fake's value as it is."""
    monkeypatch.setattr("engine_ext.ray.deployment.call", lambda ref, timeout=None: ref)


def test_open_deployment_decides_the_kind_from_the_handles() -> None:
    vllm_registry = _Registry({"kind": "vllm", "deployment": "v", "info": {}})
    assert isinstance(drivers.open_deployment("v", vllm_registry, None), VllmDriver)
    ref_registry = _Registry({"kind": "reference", "deployment": "r"})
    assert isinstance(drivers.open_deployment("r", ref_registry, None), ReferenceDriver)
    assert isinstance(drivers.open_deployment("r", ref_registry, _Controller({})), ReferenceDriver)
    assert isinstance(drivers.open_deployment("r", None, _Controller({})), ReferenceDriver)


def test_a_reference_deployment_without_controller_says_what_is_lost() -> None:
    d = drivers.open_deployment("r", _Registry({"kind": "reference", "deployment": "r"}), None)
    with pytest.raises(UnreachableError, match="the controller of 'r' is gone; the deployment cannot scale"):
        d.scale(2, drain_timeout_s=1, timeout_s=5, wait=True, on_event=print, on_op=print)
    with pytest.raises(UnreachableError, match="there is nothing to plan with"):
        d.plan(2)
    with pytest.raises(UnreachableError, match="eepctl down --name r"):
        d.repair(timeout_s=5)
    with pytest.raises(UnreachableError, match="cannot serve requests"):
        d.endpoints()


def test_vllm_scale_is_asked_of_the_in_cluster_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM driver only asks (issue 22 point 8): --no-wait returns the controller's accepted
    record; waiting follows it and maps its end onto the exit-code table, refusals included."""
    asked: list[tuple[Any, ...]] = []
    failed = {"op_id": "op-1", "state": "failed", "error": "vLLM refused", "error_code": 5}

    class VllmController:
        def __init__(self) -> None:
            self.scale = _Method(lambda *a: asked.append(a) or {"op_id": "op-1", "state": "running", "deadline": 9e9})
            self.wait_op = _Method(lambda op_id, wait_s: failed)

    monkeypatch.setattr("engine_ext.ray.vllm_controller.controller_for", lambda name: VllmController())
    d = drivers.open_deployment("v", _Registry({"kind": "vllm", "deployment": "v", "info": {}}), None)
    accepted = d.scale(2, drain_timeout_s=1, timeout_s=5, wait=False, on_event=print, on_op=print)
    assert accepted["state"] == "running" and asked == [(2, 1, 5, None, None)]
    with pytest.raises(TransitionFailed, match="op-1 failed: vLLM refused"):
        d.scale(2, drain_timeout_s=1, timeout_s=5, wait=True, on_event=print, on_op=print, request_id="r1")
    assert asked[-1] == (2, 1, 5, "r1", None)
    refusal = {"error": {"code": int(ExitCode.PRECONDITION), "message": "op-0 is running", "detail": {}}}
    monkeypatch.setattr(
        "engine_ext.ray.vllm_controller.controller_for",
        lambda name: type("C", (), {"scale": _Method(lambda *a: refusal)})(),
    )
    with pytest.raises(PreconditionError, match="op-0 is running"):
        d.scale(3, drain_timeout_s=1, timeout_s=5, wait=False, on_event=print, on_op=print)


def test_reference_scale_follows_events_and_maps_the_outcome() -> None:
    events = [{"seq": 1, "rank": 0, "phase": "commit"}, {"seq": 2, "rank": 1, "phase": "commit"}]
    ok = {"op_id": "op-1", "state": "succeeded"}
    seen: list[dict[str, Any]] = []
    ops: list[dict[str, Any]] = []
    d = ReferenceDriver("r", _Registry({}, events), _Controller(ok))
    res = d.scale(2, drain_timeout_s=1, timeout_s=5, wait=True, on_event=seen.append, on_op=ops.append)
    assert res["phase_durations"] == {"commit": 0.5} and seen == events and ops == [ok]
    assert d.scale(2, drain_timeout_s=1, timeout_s=5, wait=False, on_event=print, on_op=print)["state"] == "running"
    failed = {"op_id": "op-1", "state": "failed", "error": "boom", "error_code": 5}
    with pytest.raises(TransitionFailed, match="op-1 failed: boom"):
        ReferenceDriver("r", None, _Controller(failed)).scale(
            2, drain_timeout_s=1, timeout_s=5, wait=True, on_event=print, on_op=print
        )


def test_status_view_leaves_a_reference_snapshot_alone() -> None:
    snap = {"kind": "reference", "ranks": []}
    assert drivers.status_view(snap) is snap and "fault_tolerance" not in snap
    vllm = {"kind": "vllm", "deployment": "v", "info": {"fault_tolerance": False}}
    assert drivers.status_view(vllm)["fault_tolerance"] is None
