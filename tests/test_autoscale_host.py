"""The controller's autoscaling side (engine_ext/ray/autoscale_host.py) without a cluster: the
policy kept and persisted, the window of rank statuses turned into decisions, a restart from the
persisted state, and the errors ``eepctl autoscale`` shows."""

from __future__ import annotations

from engine_ext.control.autoscale_signals import SignalWindow, kv_use
from engine_ext.ray.autoscale_host import AutoscaleHost


def status(rank: int, waiting: int, running: int, kv_used: int = 0, ttft: float | None = None) -> dict:
    return {
        "rank": rank,
        "requests_waiting": waiting,
        "requests_running": running,
        "kv_blocks_used": kv_used,
        "kv_blocks_total": 100,
        "ttft_ms_p95": ttft,
        "tpot_ms_p95": None,
        "eplb_imbalance": 1.2,
    }


def test_policy_kept_persisted_and_restored_with_its_trail() -> None:
    saved: list[dict] = []
    host = AutoscaleHost("moe", max_dp=8, persist=saved.append)
    res = host.set_autoscale({"min_dp": 2, "max_dp": 6, "target_queue": 4.0, "up_delay_s": 0.0, "cooldown_s": 0.0})
    assert res["previous"] is None and res["policy"]["mode"] == "advisory", "advisory first"
    assert host.set_autoscale({"mode": "on"})["policy"]["target_queue"] == 4.0, "a change keeps the rest"
    d = host.tick(
        [status(0, 6, 4), status(1, 5, 5), status(7, 50, 0)], members=[0, 1], now=100.0, num_experts=8, slots_per_rank=8
    )
    assert d is not None and d.act and d.recommendation == 4  # ceil(2 x 10/4) = 5, max step 2; rank 7 not a member
    assert d.eplb_imbalance == 1.2 and {s.name for s in d.signals} == {"queue"}
    host.record_outcome(d.id, False, "capacity gone")
    restarted = AutoscaleHost("moe", max_dp=8, persist=saved.append, saved=saved[-1])
    assert restarted.autoscale_show()["policy"]["mode"] == "on"
    trail = restarted.autoscale_decisions()["decisions"]
    assert [x["action"] for x in trail] == ["failed: capacity gone"] and trail[0]["id"] == d.id
    assert restarted.autoscale_decisions(since=100.0)["decisions"] == []


def test_refusals_carry_the_exit_code() -> None:
    host = AutoscaleHost("moe", max_dp=4, persist=lambda s: None)
    assert host.set_autoscale({"max_dp": 6, "target_queue": 2})["error"]["code"] == 4
    err = host.set_autoscale({"mode": "sometimes", "target_queue": 2})["error"]
    assert err["code"] == 2 and "--mode must be advisory or on or off" in err["message"]
    assert host.autoscale_show()["policy"] is None and host.tick([status(0, 1, 1)], [0]) is None


def test_the_window_averages_load_and_keeps_latency_readings() -> None:
    w = SignalWindow(window_s=10.0)
    w.add(0.0, [status(0, 10, 0, ttft=500.0)])
    w.add(5.0, [status(0, 2, 2, kv_used=50, ttft=100.0)])
    w.add(12.0, [status(0, 0, 6, kv_used=50)])  # the first reading falls out of the window
    o = w.observed(12.0, [0], busy="op-1")
    assert o.ranks[0].requests == 5.0 and o.ranks[0].kv_use == 0.5 and o.ranks[0].ttft_ms == [100.0]
    assert o.busy == "op-1" and o.dp == 1
    assert kv_use({"kind": "vllm", "kv_usage": 0.7, "kv_blocks_total": 0}) == 0.7


def test_a_new_world_starts_a_new_window() -> None:
    host = AutoscaleHost("moe", max_dp=8, persist=lambda s: None)
    host.set_autoscale({"target_queue": 4.0, "up_delay_s": 0.0})
    host.tick([status(0, 40, 0), status(1, 40, 0)], members=[0, 1], now=0.0)
    d = host.tick([status(0, 4, 0), status(1, 4, 0), status(2, 4, 0)], members=[0, 1, 2], now=1.0)
    assert d is not None and d.signals[0].value == 4.0, "the old world's queue is not averaged in"


def test_quiet_ticks_are_persisted_sparingly() -> None:
    saved: list[dict] = []
    host = AutoscaleHost("moe", max_dp=8, persist=saved.append)
    host.set_autoscale({"target_queue": 4.0, "up_delay_s": 0.0})
    for t in range(12):  # on target: every decision is "none"
        host.tick([status(0, 2, 2)], members=[0], now=float(t))
    assert len(saved) == 1 + 2  # the policy, then one quiet tick per 10 s (at 0 and 10)
    host.tick([status(0, 400, 0)], members=[0], now=12.0)  # advisory: a recommendation to record
    assert len(saved) == 4 and saved[-1]["decisions"][-1]["action"] == "advisory: not acted"


def test_an_idle_tick_changes_neither_the_durable_state_nor_what_status_shows() -> None:
    """The controller writes its durable snapshot and publishes status when they change: a quiet
    tick must change neither (an idle deployment costs no write), a recommendation must."""
    host = AutoscaleHost("moe", max_dp=8, persist=lambda s: None)
    host.set_autoscale({"target_queue": 4.0, "up_delay_s": 0.0})
    host.tick([status(0, 2, 2)], members=[0], now=100.0)
    durable, shown = host.state(), host.shown(now=100.0)
    for t in (101.0, 102.0, 103.0):
        host.tick([status(0, 2, 2)], members=[0], now=t)
        assert host.state() is durable and host.shown(now=t) is shown
    assert host.shown(now=100.0 + 10) is not shown, "refreshed every PERSIST_QUIET_S"
    host.tick([status(0, 40, 0)], members=[0], now=111.0)
    assert host.state()["decisions"][-1]["action"] == "advisory: not acted"
    assert host.shown(now=111.0)["last"]["recommendation"] == 3


def test_the_loop_ticks_fast_under_load_and_as_before_when_idle() -> None:
    """With a policy on, a tick that saw requests admitted (or work held) asks for the next after
    0.45 s (a tick every 0.5 s with the tick's own work); an idle one, and any tick without a
    policy, waits the loop's own period as before."""
    host = AutoscaleHost("moe", max_dp=8, persist=lambda s: None)
    host.tick([status(0, 0, 0)], [0], now=0.0, admissions={"requests": 5})
    assert host.period(1.0) == 1.0, "no policy: the loop's period"
    host.set_autoscale({"target_utilization": 0.8, "mode": "on"})
    host.tick([status(0, 0, 0)], [0], now=1.0, admissions={"requests": 5})
    assert host.period(1.0) == 1.0, "idle: nothing admitted, nothing held"
    host.tick([status(0, 0, 0)], [0], now=2.0, admissions={"requests": 9})
    assert host.period(1.0) == 0.45
    host.tick([status(0, 0, 1)], [0], now=3.0, admissions={"requests": 9})
    assert host.period(1.0) == 0.45, "work still held"
    host.set_autoscale({"mode": "off"})
    assert host.period(1.0) == 1.0


def test_the_learned_capacity_and_scale_cost_are_kept_with_the_policy() -> None:
    saved: list[dict] = []
    host = AutoscaleHost("moe", max_dp=8, persist=saved.append)
    host.set_autoscale({"target_utilization": 0.5, "up_delay_s": "auto", "down_delay_s": "auto", "cooldown_s": "auto"})
    op = {
        "op_id": "op-a",
        "kind": "scale",
        "state": "succeeded",
        "from_size": 1,
        "to_size": 2,
        "started": 0.0,
        "finished": 2.3,
        "phase_durations": {"launch": 2.0},
    }  # 0.3 s besides its launch
    sat = {"saturated_tokens": 0, "saturated_s": 0.0, "instance_id": "x"}
    host.tick([status(0, 3, 4) | sat], [0], now=0.0, admissions={"requests": 0, "prompt_tokens": 0})
    d = host.tick(
        [status(0, 3, 4) | sat | {"saturated_tokens": 900, "saturated_s": 1.0}],
        [0],
        now=1.0,
        admissions={"requests": 30, "prompt_tokens": 90, "output_tokens": 450},
        ops=[op],
    )
    assert d is not None
    load = next(s for s in d.signals if s.name == "load")
    assert load.terms["capacity_tps"] == 900.0 and load.terms["arrival_rps"] == 30.0 and load.recommendation == 2
    assert d.timing["scale_up_s"] == 0.5 + 4.5 and "learned from 1 scale(s)" in d.timing["why"], d.timing
    host.tick([status(0, 0, 0)], [0], now=12.0)  # a quiet tick persists within PERSIST_QUIET_S
    restarted = AutoscaleHost("moe", max_dp=8, persist=saved.append, saved=saved[-1])
    assert restarted.window.capacity.learned["tokens_s"] == 900.0 and restarted.cost.measured == 1


def test_scale_costs_are_learned_and_kept_without_a_policy() -> None:
    """The scales an operator runs before any policy is set teach the wall-time cost (the
    controllers call learn_costs every tick while no policy acts), once each, and it is persisted:
    a policy set later, or a restarted controller, starts from them instead of the seed."""
    saved: list[dict] = []
    host = AutoscaleHost("moe", max_dp=8, persist=saved.append)
    down = {"op_id": "op-d", "kind": "scale", "state": "succeeded", "from_size": 4, "to_size": 2}
    down |= {"started": 10.0, "finished": 10.6}
    failed = {**down, "op_id": "op-f", "state": "failed"}
    assert host.policy is None and host.learn_costs([failed, down]) and len(saved) == 1
    assert not host.learn_costs([failed, down]) and len(saved) == 1, "once each, and nothing to keep"
    restarted = AutoscaleHost("moe", max_dp=8, persist=saved.append, saved=saved[-1])
    assert restarted.cost.measured == 1 and restarted.cost.down_s == host.cost.down_s
