"""The autoscaler's decision rules (engine_ext/control/autoscaler.py): properties over random
signal sequences (bounds, no flapping, panic only up, step, busy, advisory, cooldown) and examples."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.control.autoscaler import (
    AutoscalePolicy,
    Autoscaler,
    Observed,
    RankSignals,
    p95,
)


def obs(dp: int, per_rank: float = 0.0, kv: float = 0.0, ttft: list[float] | None = None, **kw) -> Observed:
    ranks = [RankSignals(r, per_rank, kv, list(ttft or [])) for r in range(dp)]
    return Observed(dp=dp, ranks=ranks, num_experts=kw.pop("experts", 8), slots_per_rank=kw.pop("slots", 8), **kw)


policies = st.builds(
    AutoscalePolicy,
    min_dp=st.integers(1, 3),
    max_dp=st.integers(3, 10),
    mode=st.sampled_from(["on", "advisory"]),
    target_queue=st.sampled_from([2.0, 4.0]),
    slo_ttft_ms=st.sampled_from([0.0, 100.0]),
    up_delay_s=st.sampled_from([0.0, 5.0]),
    down_delay_s=st.sampled_from([0.0, 30.0]),
    tolerance=st.sampled_from([0.0, 0.1, 0.3]),
    max_step=st.integers(1, 3),
    cooldown_s=st.sampled_from([0.0, 10.0]),
)
ticks = st.lists(st.tuples(st.floats(0, 40), st.floats(0, 500), st.booleans()), min_size=1, max_size=40)


def replay(policy: AutoscalePolicy, seq, experts: int = 8, slots: int = 4):
    """Drive the autoscaler with ``seq`` as a loop would: act on every ``act`` at once."""
    a, dp, out = Autoscaler(policy), max(policy.min_dp, -(-experts // slots)), []
    for i, (load, ttft, busy) in enumerate(seq):
        o = obs(dp, load, ttft=[ttft], experts=experts, slots=slots, busy="op-x" if busy else None)
        d = a.decide(float(i * 3), o)
        out.append((dp, d))
        if d.act:
            dp = d.recommendation
            a.record_outcome(d.id, True)
    return a, out


@settings(max_examples=150, deadline=None)
@given(policies, ticks)
def test_decisions_keep_every_rule(policy: AutoscalePolicy, seq) -> None:
    _, out = replay(policy, seq)
    lo, hi = max(policy.min_dp, 2), policy.max_dp  # 8 experts at 4 slots need 2 ranks
    acts = [(dp, d) for dp, d in out if d.act]
    for dp, d in out:
        assert lo <= d.recommendation <= hi, "min/max (and every expert held) never crossed"
        if lo <= dp <= hi:
            assert abs(d.recommendation - dp) <= policy.max_step, "max step per decision"
        if d.panic:
            assert d.recommendation >= dp, "panic only scales up"
        if d.act:
            assert policy.mode == "on" and not d.action.startswith("blocked"), "advisory never acts"
            assert "running" not in d.action
    for i, (dp, d) in enumerate(out):  # a calm move waited its delay: every tick in it asked the same way
        if d.act and not d.panic:
            delay = policy.up_delay_s if d.recommendation > dp else policy.down_delay_s
            ticks_in = [e for _, e in out[: i + 1] if e.at >= d.at - delay]
            assert out[0][1].at <= d.at - delay or delay == 0, "acted before a full delay was observed"
            assert all(
                (e.raw_recommendation > dp) == (d.recommendation > dp) and e.raw_recommendation != dp for e in ticks_in
            ), "stabilisation: the whole delay asked the same way"
    for (_, a1), (_, a2) in itertools.pairwise(acts):
        assert a2.panic or a2.at - a1.at >= policy.cooldown_s, "a cooldown after each action"


@settings(max_examples=100, deadline=None)
@given(policies, st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=60))
def test_load_inside_the_band_never_moves(policy: AutoscalePolicy, wobble: list[float]) -> None:
    policy.slo_ttft_ms = 0.0
    a, dp = Autoscaler(policy), max(policy.min_dp, 2)
    for i, w in enumerate(wobble):  # queue per rank wanders within the tolerance band
        d = a.decide(float(i), obs(dp, policy.target_queue * (1 + 0.999 * policy.tolerance * w), experts=8, slots=4))
        assert d.recommendation == dp and not d.act, d.rule


def test_hpa_ratio_and_the_largest_signal_wins() -> None:
    a = Autoscaler(AutoscalePolicy(mode="on", target_queue=4, target_kv=0.5, up_delay_s=0, max_step=8, max_dp=16))
    d = a.decide(0.0, obs(2, per_rank=6.0, kv=0.9))  # queue: ceil(2 x 1.5) = 3, kv: ceil(2 x 1.8) = 4
    assert {s.name: s.recommendation for s in d.signals} == {"queue": 3, "kv": 4}
    assert d.recommendation == 4 and d.act and d.rule.startswith("kv held up")


def test_up_waits_the_up_delay_and_down_the_down_delay() -> None:
    a = Autoscaler(AutoscalePolicy(mode="on", target_queue=4, up_delay_s=10, down_delay_s=60, cooldown_s=0))
    assert not a.decide(0.0, obs(2, 8.0)).act
    assert not a.decide(5.0, obs(2, 8.0)).act and "stabilising 5s of 10s" in a.decisions[-1].rule
    assert a.decide(10.0, obs(2, 8.0)).recommendation == 4
    for t in range(11, 71, 10):
        assert not a.decide(float(t), obs(4, 1.0)).act, "down only after the down-delay"
    d = a.decide(71.0, obs(4, 1.0))
    assert d.act and d.recommendation == 2  # max step 2


def test_a_dip_inside_the_window_restarts_the_stabilisation() -> None:
    a = Autoscaler(AutoscalePolicy(mode="on", target_queue=4, up_delay_s=10, cooldown_s=0))
    a.decide(0.0, obs(2, 8.0))
    a.decide(6.0, obs(2, 4.0))  # back on target
    assert not a.decide(12.0, obs(2, 8.0)).act


def test_panic_goes_up_at_once_through_the_delay_and_cooldown() -> None:
    a = Autoscaler(AutoscalePolicy(mode="on", target_queue=4, slo_ttft_ms=100, up_delay_s=60, cooldown_s=300))
    a.last_action_at = 0.0
    d = a.decide(1.0, obs(2, 4.0, ttft=[250.0]))
    assert d.panic and d.act and d.recommendation == 4 and d.rule.startswith("panic: ttft")
    calm = a.decide(2.0, obs(4, 4.0, ttft=[150.0]))  # 1.5x: up, but not panic: delay and cooldown hold
    assert not calm.panic and not calm.act


def test_blocks_say_why() -> None:
    p = AutoscalePolicy(mode="on", target_queue=4, up_delay_s=0, cooldown_s=0)
    assert Autoscaler(p).decide(0.0, obs(2, 8.0, busy="recovery op-1")).action == "blocked: recovery op-1 is running"
    full = obs(2, 8.0, capacity=lambda n: f"no room for {n} more ranks")
    assert Autoscaler(p).decide(0.0, full).action == "blocked: capacity: no room for 2 more ranks"
    p.mode = "advisory"
    d = Autoscaler(p).decide(0.0, obs(2, 8.0))
    assert d.action == "advisory: not acted" and not d.act and d.recommendation == 4


def test_every_expert_held_and_the_pool_preferred() -> None:
    p = AutoscalePolicy(mode="on", min_dp=1, target_queue=4, up_delay_s=0, down_delay_s=0, cooldown_s=0, max_step=4)
    d = Autoscaler(p).decide(0.0, obs(4, 0.5, experts=8, slots=4))
    assert d.recommendation == 2 and "8 experts need 2" in d.rule
    d = Autoscaler(p).decide(0.0, obs(2, 9.0, standby_ready=2))  # asks 5; the pool serves 4 at once
    assert d.recommendation == 4 and "standby pool" in d.rule


def test_a_failed_scale_backs_off_and_is_visible() -> None:
    p = AutoscalePolicy(mode="on", target_queue=4, up_delay_s=0, cooldown_s=10, down_delay_s=300)
    a = Autoscaler(p)
    d = a.decide(0.0, obs(2, 8.0))
    a.record_outcome(d.id, False, "rank 3 did not start")
    assert a.decisions[-1].action == "failed: rank 3 did not start"
    assert a.decide(15.0, obs(2, 8.0)).action.startswith("blocked: cooldown")  # 20 s after one failure
    assert a.decide(21.0, obs(2, 8.0)).act


def test_the_trail_survives_a_restart() -> None:
    p = AutoscalePolicy(mode="on", target_queue=4, up_delay_s=0, cooldown_s=100)
    a = Autoscaler(p)
    a.decide(0.0, obs(2, 8.0))
    b = Autoscaler(p, decisions=a.recent())
    assert b.recent() == a.recent() and b.decide(50.0, obs(4, 16.0)).action.startswith("blocked: cooldown")


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"min_dp": 4, "max_dp": 2}, "--min-dp 4 is over --max-dp 2"),
        ({"mode": "auto"}, "--mode must be advisory or on or off"),
        ({"target_kv": 1.5}, "--target-kv"),
        ({"tolerance": -0.1}, "--tolerance must be a number >= 0"),
        ({"target_queue": 0}, "give at least one target"),
        ({"max_step": 0}, "--max-step must be an integer >= 1"),
    ],
)
def test_policy_errors_name_the_option(kw, msg) -> None:
    base = {"target_queue": 4.0} | kw
    with pytest.raises(ValueError, match=msg.replace("-", r"\-")):
        AutoscalePolicy(**base).validated()
    with pytest.raises(ValueError, match="unknown autoscale policy field"):
        AutoscalePolicy.from_dict({"min_dp": 1, "tagret_queue": 3})


def test_p95() -> None:
    assert p95([]) is None and p95([5.0]) == 5.0 and p95([float(i) for i in range(1, 101)]) == 95.0


def test_the_benchmark_traces_bound_what_any_policy_can_save() -> None:
    """benchmarks/autoscale.py prints, per trace, the least share of static-max's rank-seconds any
    policy could spend (instant scaling with foresight): issue 24's <= 60 % is reachable on the step
    (a 4x burst over 35 % of the trace) and on none of the ramp (4x for its last 30 %) or the daily
    curve (mean 2.5x), so docs/autoscaling.md judges those two against their bound, not the goal."""
    from benchmarks.autoscale import bounds, traces

    got = {name: bounds(shape, 30.0, 4) for name, shape in traces(30.0).items()}
    assert got["step"] == pytest.approx({"fluid": 0.5125, "whole": 0.5125}, abs=1e-3)
    assert got["ramp"] == pytest.approx({"fluid": 0.7375, "whole": 0.825}, abs=1e-3)
    assert got["daily"] == pytest.approx({"fluid": 0.625, "whole": 0.75}, abs=1e-3)
    assert bounds(lambda t: 4.0, 30.0, 4) == {"fluid": 1.0, "whole": 1.0}  # a flat peak saves nothing
