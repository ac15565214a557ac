"""The autoscaler's rank-side signals: per-request TTFT/TPOT measured by the rank, in its result
records and, windowed (p50/p95), in its status record (engine_ext/rank/latency.py)."""

from __future__ import annotations

import msgspec

from engine_ext.config import EngineConfig
from engine_ext.rank.latency import LatencyWindow, request_latency
from engine_ext.records import RankStatus
from tests.engine_helpers import OneRank


def test_the_rank_measures_ttft_and_tpot_per_request_and_windows_them() -> None:
    o = OneRank(EngineConfig(max_num_seqs=1, capture_sizes=[1]))  # one slot: the second request queues
    o.add([[1, 2, 3], [4, 5, 6]], max_tokens=4)
    o.engine.add_request(
        {"request_id": "moved", "prompt": [7, 8], "max_tokens": 3, "output": [9, 10], "logits": [0.0, 0.0]}
    )  # moved here with tokens: its first token was elsewhere
    o.steps()
    first, queued, moved = o.results["0"], o.results["1"], o.results["moved"]
    assert first["ttft_ms"] > 0 and first["tpot_ms"] > 0
    assert queued["ttft_ms"] > first["ttft_ms"], "a request that waited for a slot has the longer TTFT"
    assert moved["ttft_ms"] is None and moved["tpot_ms"] is None
    st = msgspec.convert(o.engine.status(), RankStatus)  # the schema declares every field sent
    assert st.latency_samples == 3
    assert st.ttft_ms_p50 == first["ttft_ms"] and st.ttft_ms_p95 == queued["ttft_ms"]
    assert st.tpot_ms_p95 is not None and st.tpot_ms_p95 >= st.tpot_ms_p50  # type: ignore[operator]


def test_the_window_forgets_old_requests() -> None:
    w = LatencyWindow(window_s=10.0)
    w.add(100.0, 5.0, now=0.0)
    w.add(300.0, 9.0, now=8.0)
    assert w.summary(now=9.0)["ttft_ms_p95"] == 300.0 and w.summary(now=9.0)["latency_samples"] == 2
    assert w.summary(now=15.0)["ttft_ms_p50"] == 300.0 and w.summary(now=15.0)["latency_samples"] == 1
    assert w.summary(now=30.0)["ttft_ms_p95"] is None
    assert request_latency(0.0, 0.1, 0.4, 4) == (100.0, 100.0) and request_latency(0.0, None, 1.0, 3) == (None, None)


def test_the_queue_signal_counts_requests_shorter_than_a_tick() -> None:
    """Requests that each live 0.2 s of every 1 s tick are never seen by a count sampled at the
    ticks; the rank's request-seconds counter gives their true mean (0.2), also across a restart."""
    from engine_ext.control.autoscale_signals import SignalWindow
    from engine_ext.rank.latency import RequestSeconds

    held, w, t = RequestSeconds(), SignalWindow(window_s=30.0), 1000.0
    for tick in range(10):
        now = t + tick
        w.add(
            now,
            [
                {
                    "rank": 0,
                    "requests_waiting": 0,
                    "requests_running": 0,
                    "instance_id": "a",
                    "request_seconds": held.total(now),
                    "last_heartbeat": now,
                }
            ],
        )
        held.change(+1, now + 0.4)
        held.change(-1, now + 0.6)
    w.add(
        t + 10.5,
        [{"rank": 0, "requests_running": 1, "instance_id": "b", "request_seconds": 0.1, "last_heartbeat": t + 10.5}],
    )  # restarted: a new counter, not a negative step
    obs = w.observed(t + 10.5, [0])
    assert abs(obs.ranks[0].requests - 0.2) < 1e-9, obs.ranks[0].requests
    sampled = SignalWindow(window_s=30.0)  # a vLLM rank reports no counter: the sampled counts
    sampled.add(t, [{"rank": 0, "requests_running": 0}])
    sampled.add(t + 1, [{"rank": 0, "requests_running": 2}])
    assert sampled.observed(t + 1, [0]).ranks[0].requests == 1.0


def test_the_rank_counts_tokens_served_saturated_steps_and_the_work_it_holds() -> None:
    """One slot and two requests: the first runs while the second waits (saturated steps), then the
    second runs alone (not saturated); every fed position is a token served, and the work held
    counts the waiting request's prompt and output and the running one's output still to come."""
    o = OneRank(EngineConfig(max_num_seqs=1, capture_sizes=[1]))
    o.add([[1, 2, 3], [4, 5]], max_tokens=4)
    st = o.engine.status()
    assert st["tokens_queued"] == (3 + 4) + (2 + 4) and st["tokens_served"] == 0
    o.steps(1)  # the first request's prefill while the second waits
    st = o.engine.status()
    assert st["tokens_queued"] == 3 + (2 + 4), "3 output tokens still to come, the waiting request whole"
    assert st["saturated_tokens"] == 3 + 1 and st["saturated_s"] > 0, "3 prompt positions and the token produced"
    o.steps()
    st = msgspec.convert(o.engine.status(), RankStatus)
    # a request's prompt and its 4 output tokens each
    assert st.tokens_served == (3 + 4) + (2 + 4) and st.saturated_tokens == 3 + 4, "saturated while the second waited"
    assert st.tokens_queued == 0


def test_the_router_counts_what_it_admits_and_the_ingress_link_sums_the_ingresses() -> None:
    import asyncio

    from engine_ext.control.router import Router
    from engine_ext.ray.ingress_link import IngressLink

    async def admit() -> tuple[dict, list[dict]]:
        r = Router()  # no rank yet: the requests wait in the router, counted as admitted
        pending = [asyncio.ensure_future(r.submit([1, 2, 3], 16)), asyncio.ensure_future(r.submit([4], 8))]
        await asyncio.sleep(0)
        counts = r.admissions()
        r.fail_parked("the test ends")
        return counts, await asyncio.gather(*pending)

    counts, answers = asyncio.run(admit())
    assert counts == {"requests": 2, "prompt_tokens": 4, "output_tokens": 24} and all(a["error"] for a in answers)
    link = IngressLink("moe", "ns", 2, fenced=dict)
    link.stats = {
        0: {"admitted": counts},
        1: {"admitted": {"requests": 1, "prompt_tokens": 5, "output_tokens": 8}},
        2: {},
    }
    assert link.admissions() == {"requests": 3, "prompt_tokens": 9, "output_tokens": 32}
