"""The autoscaler's load rule and its timing, with synthetic signals (no cluster): one jump to the
width the arrivals and the backlog need, the arithmetic in the decision record, no fixed max step
upward, down after a delay derived from what a scale costs here, and no chase of a burst shorter
than the scale it would need (engine_ext/control/autoscale_load.py, autoscale_cost.py)."""

from __future__ import annotations

import json
import math

import pytest

from engine_ext.control.autoscale_cost import ScaleCost, timing
from engine_ext.control.autoscale_load import (
    CAPACITY_PROMPT_TOKENS,
    DEFAULT_CAPACITY_TPS,
    ArrivalWindow,
    CapacityLearner,
    LoadSignals,
    capacity_from_benchmark,
)
from engine_ext.control.autoscaler import (
    AutoscalePolicy,
    Autoscaler,
    Observed,
    RankSignals,
)
from tests.helpers import ROOT

BASE_RPS, TOKENS, CAPACITY = 40.0, 24.0, 1250.0  # at 80 %: 1000 tokens/s a rank, the base load 0.96 of one
FAST = ScaleCost(up_s=0.2, launch_s=0.0, down_s=0.2, measured=3)  # a scale as the reference engine's, learned


def load_obs(dp: int, rps: float, backlog: float = 48.0, cost: ScaleCost = FAST, **kw) -> Observed:
    load = LoadSignals(rps, rps * 8, kw.pop("base_rps", rps), TOKENS, backlog, kw.pop("capacity", CAPACITY), "learned")
    return Observed(
        dp=dp, ranks=[RankSignals(r) for r in range(dp)], num_experts=8, slots_per_rank=8, load=load, cost=cost, **kw
    )


def policy(**kw) -> AutoscalePolicy:
    base = {
        "mode": "on",
        "max_dp": 8,
        "target_utilization": 0.8,
        "up_delay_s": "auto",
        "down_delay_s": "auto",
        "cooldown_s": "auto",
        "max_step": 1,
    }
    return AutoscalePolicy(**(base | kw))


def test_a_4x_burst_jumps_1_to_4_in_one_decision_and_the_record_shows_the_arithmetic() -> None:
    a = Autoscaler(policy())
    assert a.decide(0.0, load_obs(1, BASE_RPS)).recommendation == 1, "the base load fits one rank"
    first = a.decide(0.5, load_obs(1, 4 * BASE_RPS, backlog=200.0))
    assert not first.act and "stabilising 0s of 0.2s" in first.rule, first.rule  # the up-delay: the scale's cost
    d = a.decide(1.0, load_obs(1, 4 * BASE_RPS, backlog=200.0))
    assert d.act and (d.current_dp, d.recommendation) == (1, 4), d.rule  # max step 1 does not bound the load rule
    load = next(s for s in d.signals if s.name == "load")
    t = load.terms
    assert (t["arrival_rps"], t["work_per_request"], t["backlog_tokens"], t["drain_s"]) == (160.0, 24.0, 200.0, 2.0)
    assert (t["capacity_tps"], t["target_utilization"], t["capacity_source"]) == (1250.0, 0.8, "learned")
    assert t["need"] == pytest.approx((160 * 24 + 200 / 2) / (1250 * 0.8)) and load.recommendation == 4
    assert math.ceil(t["need"]) == 4 and "ceil((160 req/s x 24 tok + 200 tok / 2 s) / (1250 tok/s x 0.8))" in d.rule
    assert d.timing["up_delay_s"] == pytest.approx(0.2) and "learned from 3 scale(s)" in d.timing["why"]


def test_the_jump_is_bounded_by_max_dp_and_the_other_signals_keep_their_max_step() -> None:
    a = Autoscaler(policy(max_dp=4, up_delay_s=0))
    d = a.decide(0.0, load_obs(1, 8 * BASE_RPS))
    assert d.recommendation == 4 and "bounded to [1, 4]" in d.rule, d.rule
    q = Autoscaler(AutoscalePolicy(mode="on", target_queue=1.0, up_delay_s=0, max_step=1))
    assert q.decide(0.0, Observed(dp=1, ranks=[RankSignals(0, 8.0)])).recommendation == 2, "queue: max step 1"


def test_a_cluster_without_room_for_the_jump_takes_the_most_that_fits() -> None:
    d = Autoscaler(policy(up_delay_s=0)).decide(0.0, _room(load_obs(1, 5 * BASE_RPS), 2))
    assert d.act and d.recommendation == 3 and "DP 5 does not fit (room for 2 more ranks, not 4)" in d.rule, d.rule


def _room(o: Observed, free: int) -> Observed:
    o.capacity = lambda n: None if n <= free else f"room for {free} more ranks, not {n}"
    return o


def test_down_after_seconds_when_a_scale_is_cheap_and_minutes_when_it_is_not() -> None:
    a = Autoscaler(policy(max_step=4))
    for t in (0.0, 1.0, 2.0, 3.0, 3.9):  # the burst is over: the base load needs 1 rank
        d = a.decide(t, load_obs(4, BASE_RPS))
        assert not d.act and "stabilising" in d.rule, d.rule
    d = a.decide(4.0, load_obs(4, BASE_RPS))  # 10 round trips of (0.2 s down + 0.2 s up) = 4 s
    assert d.act and d.recommendation == 1 and d.timing["down_delay_s"] == pytest.approx(4.0), (d.rule, d.timing)
    vllm = ScaleCost()
    vllm.seed("vllm")  # tens of seconds a scale: the down-delay is the cap, not seconds
    slow = timing("auto", "auto", "auto", vllm, joiners_pooled=False)
    assert slow.down_delay_s == 300.0 and slow.up_delay_s == 30.0
    fixed = timing(20.0, 300.0, 30.0, FAST, joiners_pooled=True)
    assert (fixed.up_delay_s, fixed.down_delay_s, fixed.cooldown_s, fixed.why) == (20.0, 300.0, 30.0, "")


def test_a_burst_shorter_than_the_scale_it_needs_is_not_chased() -> None:
    launched = ScaleCost()  # the seeds: joiners launched take 0.7 + 7 s
    a = Autoscaler(policy())
    for t in (0.0, 0.5, 1.0, 1.5, 2.0):  # a 2-second 4x burst, then the base again
        d = a.decide(t, load_obs(1, 4 * BASE_RPS, cost=launched))
        assert not d.act and "stabilising" in d.rule and d.timing["up_delay_s"] == pytest.approx(7.7), d.rule
    assert not a.decide(2.5, load_obs(1, BASE_RPS, cost=launched)).act
    # The arrivals fit DP 2, and what is queued drains at its spare capacity before a launch: not chased.
    slow = Autoscaler(policy(up_delay_s=0)).decide(0.0, load_obs(2, 60.0, backlog=2000.0, cost=launched))
    assert (
        not slow.act and "not chased: the backlog (2000 tok) drains at DP 2 in 1.89s, before a 7.70s scale" in slow.rule
    ), slow.rule
    over = Autoscaler(policy(up_delay_s=0)).decide(0.0, load_obs(1, 50.0, backlog=100.0, cost=launched))
    assert over.act and over.recommendation == 2, "arrivals over the width's target share: not a passing backlog"
    pooled = Autoscaler(policy(up_delay_s=0)).decide(
        0.0, load_obs(2, 60.0, backlog=2000.0, cost=launched, standby_ready=2)
    )
    assert pooled.act and pooled.recommendation == 3, pooled.rule  # from the pool (0.7 s) it is worth it


def test_the_cost_is_learned_from_the_scales_the_deployment_ran() -> None:
    c = ScaleCost()
    up = {
        "op_id": "op-1",
        "kind": "scale",
        "state": "succeeded",
        "from_size": 1,
        "to_size": 4,
        "started": 10.0,
        "finished": 13.5,
        "phase_durations": {"launch": 3.0},
    }
    assert c.observe(up) and not c.observe(up), "each operation once"
    assert (c.up_s, c.launch_s) == (pytest.approx(0.6), pytest.approx(5.0))  # halfway from 0.7 and 7
    assert c.observe({**up, "op_id": "op-2", "from_size": 4, "to_size": 2, "finished": 10.4})
    assert c.down_s == pytest.approx(0.7) and c.source() == "learned from 2 scale(s)"
    assert not c.observe({**up, "op_id": "op-3", "state": "rolled_back"})
    assert ScaleCost.from_dict(json.loads(json.dumps(c.to_dict()))) == c, "persisted with the durable state"
    c.seed("vllm")
    assert c.kind == "reference", "a measured cost is not replaced by a seed"


def test_arrivals_are_rates_of_the_routers_counters_and_a_reset_starts_over() -> None:
    w = ArrivalWindow(keep_s=60.0)
    assert w.signals(0.0, 60.0) == (None, None, 0.0, None)
    for i in range(5):  # 40 requests/s of 8 prompt and 16 output tokens
        w.add(i * 0.5, {"requests": 20 * i, "prompt_tokens": 160 * i, "output_tokens": 320 * i})
    assert w.signals(2.0, 60.0) == (40.0, 320.0, 24.0, 40.0)
    w.add(2.5, {"requests": 3, "prompt_tokens": 24, "output_tokens": 48})  # a restarted ingress
    assert w.signals(2.5, 60.0) == (None, None, 0.0, None)


def test_capacity_is_learned_from_saturated_steps_else_seeded() -> None:
    c = CapacityLearner()
    assert c.capacity(0.0) == (DEFAULT_CAPACITY_TPS, "default seed (benchmarks/capacity.py, H100 host's 16 cores)")
    assert c.capacity(900.0) == (900.0, "seed: --capacity")

    def st(rank: int, tokens: int, seconds: float, inst: str = "a") -> dict:
        return {"rank": rank, "instance_id": inst, "saturated_tokens": tokens, "saturated_s": seconds}

    c.add(0.0, [st(0, 0, 0.0), st(1, 500, 1.0)])
    c.add(1.0, [st(0, 100, 0.1), st(1, 500, 1.0)])  # 0.1 rank-s: not enough to say
    assert c.learned is None
    c.add(2.0, [st(0, 1100, 1.1), st(1, 0, 0.0, inst="b")])  # rank 1 restarted: its counters start over
    assert c.capacity(900.0) == (1000.0, "learned: 1.1 rank-s of saturated steps")
    assert CapacityLearner(c.learned).capacity(0.0)[0] == 1000.0, "the learned figure survives a restart"


def test_the_seed_reads_benchmarks_capacity_output() -> None:
    from benchmarks.capacity import PROMPT

    assert CAPACITY_PROMPT_TOKENS == len(PROMPT)
    result = json.loads((ROOT / "docs/results/h100_2026-12-05b/capacity_cpu_16cores_64clients.json").read_text())
    assert capacity_from_benchmark(result) == pytest.approx(DEFAULT_CAPACITY_TPS, abs=0.5)
    with pytest.raises(ValueError, match="no closed-loop"):
        capacity_from_benchmark({"load": [{"dp": 1, "open": {"tok_s": 5}}]})


def test_standby_auto_keeps_the_ranks_a_burst_would_need_beyond_the_width() -> None:
    """A 4x burst of the base load (40 req/s, at DP 1) needs DP 4: three ranks launched ahead; a lull
    does not stop them within the window; the burst, served at DP 4, keeps none; the policy refuses
    --standby auto without the load rule."""
    a = Autoscaler(policy(standby="auto", burst=4, max_dp=8, window_s=10.0))
    d = a.decide(0.0, load_obs(1, BASE_RPS))
    assert d.standby == 3 and "standby 3 (a 4x burst of 40 req/s needs DP 4)" in d.rule, d.rule
    assert a.decide(5.0, load_obs(1, 1.0, base_rps=10.0)).standby == 3, "the most asked over the window"
    a.decide(6.0, load_obs(1, 4 * BASE_RPS, base_rps=BASE_RPS))  # the burst arrives: held for the up-delay
    burst = a.decide(7.0, load_obs(1, 4 * BASE_RPS, base_rps=BASE_RPS))
    assert (burst.recommendation, burst.standby) == (4, 0), "served at the burst's width: no pool past it"
    assert a.decide(18.0, load_obs(1, 1.0, base_rps=10.0)).standby == 0, "the burst out of the window"
    assert Autoscaler(policy(standby="auto", max_dp=2)).decide(0.0, load_obs(1, BASE_RPS)).standby == 1, "max DP"
    assert Autoscaler(policy()).decide(0.0, load_obs(1, BASE_RPS)).standby is None, "the operator's pool"
    with pytest.raises(ValueError, match="--standby auto sizes the pool by the load rule"):
        AutoscalePolicy(target_queue=2.0, standby="auto").validated()
    with pytest.raises(ValueError, match="--burst"):
        AutoscalePolicy(target_utilization=0.5, burst=0.5).validated()
