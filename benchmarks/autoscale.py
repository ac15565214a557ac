"""EP-width autoscaling against static sizes and a replica-style policy, on the process launcher.

One run replays load traces (a step, a ramp and a daily-shape curve, each compressed to
``--seconds``) against (a) static DP at min, (b) static DP at max, (c) a replica-style policy
with Ray Serve's default delays (30 s up / 600 s down, a queue target, no SLO signal, no panic)
and (d) ours (docs/autoscaling.md defaults, queue and TTFT SLO, panic). Delays are compressed
with the trace (``--compress``: a 600 s delay at 10x is 60 s). The autoscaled cases run
``autoscale_round`` every ``--tick`` seconds, as the controller's loop does, and act through the
orchestrator's scale. Reports per trace and case: SLO attainment (% of requests within the
TTFT and TPOT SLOs, failures counting as misses), rank-seconds, operations and failed requests,
and per trace the least rank-seconds any policy could spend (``bounds``), as a share of static-max's.

The process launcher has no autoscaler of its own (on Ray the controller's reconcile loop runs the
same round, engine_ext/ray/controller.py), so this drives the round itself.
Numbers are only meaningful where the ranks have cores of their own (one per rank at max DP).

Usage: PYTHONPATH=. python benchmarks/autoscale.py [--seconds 60] [--base-rate 4] [--traces step,ramp,daily]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import Callable
from typing import Any

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.ray.autoscale_host import AutoscaleHost, autoscale_round

MAX_TOKENS = 16


def traces(seconds: float) -> dict[str, Callable[[float], float]]:
    """Load multipliers over [0, seconds): 1 -> 4x -> 1 step; 1 -> 4x ramp; a compressed day."""
    return {
        "step": lambda t: 4.0 if 0.25 * seconds <= t < 0.6 * seconds else 1.0,
        "ramp": lambda t: 1.0 + 3.0 * min(1.0, t / (0.7 * seconds)),
        "daily": lambda t: 2.5 - 1.5 * math.cos(2 * math.pi * t / seconds),
    }


def bounds(shape: Callable[[float], float], seconds: float, max_dp: int, points: int = 10000) -> dict[str, float]:
    """The least share of static-max's rank-seconds any policy could spend on ``shape`` if ranks serve
    in proportion to their number and static-max is just enough for the peak (one rank per
    ``peak / max_dp`` of load), scaling instantly with perfect foresight: ``fluid`` with fractional
    ranks (the mean load over the peak), ``whole`` with whole ranks (ceil of the load in ranks). A
    trace whose bound is above a goal's share cannot meet that goal, whatever the policy."""
    loads = [shape((i + 0.5) * seconds / points) for i in range(points)]
    per_rank = max(loads) / max_dp
    return {"fluid": sum(loads) / len(loads) / max(loads),
            "whole": sum(min(max_dp, math.ceil(x / per_rank - 1e-9)) for x in loads) / len(loads) / max_dp}


def cases(min_dp: int, max_dp: int, compress: float, slo_ttft_ms: float) -> dict[str, dict[str, Any] | int]:
    """Static sizes as ints; autoscaled cases as their policies (delays compressed)."""
    c = 1.0 / compress
    return {
        "static-min": min_dp, "static-max": max_dp,
        "serve-like": {"min_dp": min_dp, "max_dp": max_dp, "mode": "on", "target_queue": 2.0, "tolerance": 0.0,
                       "up_delay_s": 30 * c, "down_delay_s": 600 * c, "cooldown_s": 0.0, "max_step": max_dp},
        "ours": {"min_dp": min_dp, "max_dp": max_dp, "mode": "on", "target_queue": 2.0, "slo_ttft_ms": slo_ttft_ms,
                 "up_delay_s": 20 * c, "down_delay_s": 300 * c, "cooldown_s": 30 * c, "window_s": max(5.0, 60 * c)},
    }


async def _requests(dep: LocalDeployment, shape: Callable[[float], float], base_rate: float, seconds: float,
                    out: list[dict[str, Any]]) -> None:
    """Open-loop Poisson arrivals at ``base_rate x shape(t)``; every answer lands in ``out``."""
    rng = random.Random(0)
    tasks, t0 = [], time.time()
    while (now := time.time() - t0) < seconds:
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 12))]
        tasks.append(asyncio.ensure_future(dep.generate(prompt, MAX_TOKENS)))
        await asyncio.sleep(rng.expovariate(base_rate * shape(now)))
    for r in await asyncio.gather(*tasks, return_exceptions=True):
        out.append(r if isinstance(r, dict) else {"error": repr(r)})


async def _autoscale(dep: LocalDeployment, host: AutoscaleHost, tick_s: float, stop: asyncio.Event) -> None:
    async def act(d: Any) -> dict[str, Any]:
        return await dep.orch.scale(d.recommendation, timeout_s=120)

    while not stop.is_set():
        await autoscale_round(host, dep.orch, act)
        await asyncio.sleep(tick_s)


async def _rank_seconds(dep: LocalDeployment, stop: asyncio.Event, acc: list[float]) -> None:
    last = time.time()
    while not stop.is_set():
        await asyncio.sleep(0.25)
        now = time.time()
        acc[0] += len(dep.orch.members) * (now - last)
        last = now


async def run_case(cfg: EngineConfig, case: dict[str, Any] | int, shape: Callable[[float], float],
                   a: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    start = case if isinstance(case, int) else case["min_dp"]
    async with LocalDeployment(cfg, "bench-autoscale", max_dp=a.max_dp) as dep:
        await dep.start(start)
        stop, acc = asyncio.Event(), [0.0]
        side = [asyncio.ensure_future(_rank_seconds(dep, stop, acc))]
        if not isinstance(case, int):
            host = AutoscaleHost("bench-autoscale", a.max_dp, persist=lambda s: None)
            host.set_autoscale(case)
            side.append(asyncio.ensure_future(_autoscale(dep, host, a.tick, stop)))
        await _requests(dep, shape, a.base_rate, a.seconds, results)
        stop.set()
        await asyncio.gather(*side)
        ops = [op for op in dep.orch.history if op.get("kind") != "recover" and not (op.get("error") or "").startswith("already")]
    ok = [r for r in results if not r.get("error") and r.get("ttft_ms") is not None]
    within = [r for r in ok if r["ttft_ms"] <= a.slo_ttft_ms and (r.get("tpot_ms") or 0.0) <= a.slo_tpot_ms]
    return {"requests": len(results), "failed": len(results) - len(ok), "rank_s": acc[0], "ops": len(ops),
            "slo_pct": 100.0 * len(within) / max(1, len(results))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of each compressed trace")
    p.add_argument("--compress", type=float, default=10.0, help="how much faster than real time delays run")
    p.add_argument("--base-rate", type=float, default=4.0, help="requests per second at load 1x")
    p.add_argument("--min-dp", type=int, default=1)
    p.add_argument("--max-dp", type=int, default=4)
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--tick", type=float, default=0.5, help="seconds between autoscaling rounds")
    p.add_argument("--traces", default="step,ramp,daily")
    a = p.parse_args()
    cfg = EngineConfig(max_num_seqs=4, capture_sizes=[1, 2, 4])
    print(f"traces of {a.seconds:g}s at {a.base_rate:g} req/s x load; DP {a.min_dp}..{a.max_dp}; SLO TTFT "
          f"{a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms; delays compressed {a.compress:g}x\n")
    print("| trace | case | SLO attainment | rank-seconds | operations | failed | requests |")
    print("|---|---|---|---|---|---|---|")
    shapes = traces(a.seconds)
    for name in a.traces.split(","):
        b = bounds(shapes[name], a.seconds, a.max_dp)
        print(f"| {name} | bound (instant, foresight) | - | fluid {100 * b['fluid']:.1f} % / whole ranks "
              f"{100 * b['whole']:.1f} % of static-max | - | - | - |", flush=True)
        for label, case in cases(a.min_dp, a.max_dp, a.compress, a.slo_ttft_ms).items():
            r = asyncio.run(run_case(cfg, case, shapes[name], a))
            print(f"| {name} | {label} | {r['slo_pct']:.1f} % | {r['rank_s']:.0f} | {r['ops']} | {r['failed']} "
                  f"| {r['requests']} |", flush=True)


if __name__ == "__main__":
    main()
