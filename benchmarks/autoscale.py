"""EP-width autoscaling against static sizes and replica-style policies, on the process launcher.

Each trace (a step, a ramp, a daily-shape curve and a seeded bursty trace, each ``--seconds`` long)
is replayed as open-loop Poisson arrivals against each case, ``--runs`` times (run ``i`` of every
case sees the same arrivals):

- ``static-min``, ``static-max``: DP fixed at ``--min-dp`` / ``--max-dp``;
- ``serve-like``: Ray Serve's default delays (30 s up / 600 s down, compressed ``--compress``x), a
  queue target, no SLO signal, no panic;
- ``queue-slo``: the HPA-style rules with docs/autoscaling.md's default delays (compressed), queue
  and TTFT targets, panic;
- ``load``: the load rule (``--target-utilization``), delays ``auto`` from the scale's cost;
- ``load+standby``: the same with ``--standby auto`` (the pool sized for a ``--burst`` times the
  base load); its standby ranks count in its rank-seconds.

The load cases start from what this host measured before the runs (``calibrate``: a closed loop at
DP 1 for a rank's tokens/s at saturation, then a scale 1 -> 2 -> 1 for what a scale costs here), as a
deployment that has served before starts from its durable state (``--no-calibrate``: from the
seeds). The autoscaled cases run ``autoscale_round`` every ``--tick`` seconds, as the controller's
loop does, and act through the orchestrator's scale.

Per trace and case: SLO attainment (% of requests within the TTFT and TPOT SLOs; a failure is a
miss), overall and per phase of the trace (``before``: the base load; ``during``: a burst, load >=
2x the base; ``after``: the ``--after`` seconds after a burst), rank-seconds (serving and standby
ranks), operations and failed requests: the median over the runs and the spread [min-max]. Per
trace the least rank-seconds any policy could spend (``bounds``), as a share of static-max's.
Numbers mean something only where the ranks have cores of their own (one per rank at max DP).

Usage: PYTHONPATH=. python benchmarks/autoscale.py [--seconds 120] [--runs 3] [--traces step,ramp,daily,bursty]
       [--cases static-min,static-max,serve-like,queue-slo,load,load+standby] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine_ext.config import EngineConfig
from engine_ext.control.autoscale_cost import ScaleCost
from engine_ext.control.autoscale_load import CapacityLearner
from engine_ext.launcher import LocalDeployment
from engine_ext.ray.autoscale_host import AutoscaleHost, autoscale_round

MAX_TOKENS = 16
BURST_LEVEL = 2.0  # a load at least this many times the base is a burst ("during")
PHASES = ("before", "during", "after")


def bursts(seconds: float, seed: int) -> list[tuple[float, float, float]]:
    """(start, end, height) of the bursty trace's bursts: a few seconds each (log-normal around 3 s,
    2..8 s), 3-6x the base, arriving at random (about one per 15 s) after the first 10 s, as BurstGPT
    describes production traces: short, tall bursts over a steady base."""
    rng, out = random.Random(seed), []
    t = 10.0 + rng.expovariate(1 / 15.0)
    while t < seconds - 5.0:
        dur = min(8.0, max(2.0, rng.lognormvariate(math.log(3.0), 0.5)))
        out.append((t, min(seconds, t + dur), rng.uniform(3.0, 6.0)))
        t += dur + rng.expovariate(1 / 15.0)
    return out


def traces(seconds: float, seed: int = 0) -> dict[str, Callable[[float], float]]:
    """Load multipliers over [0, seconds): 1 -> 4x -> 1 step; 1 -> 4x ramp; a compressed day; bursts."""
    spikes = bursts(seconds, seed)
    return {
        "step": lambda t: 4.0 if 0.25 * seconds <= t < 0.6 * seconds else 1.0,
        "ramp": lambda t: 1.0 + 3.0 * min(1.0, t / (0.7 * seconds)),
        "daily": lambda t: 2.5 - 1.5 * math.cos(2 * math.pi * t / seconds),
        "bursty": lambda t: next((h for a, b, h in spikes if a <= t < b), 1.0),
    }


def phase_of(
    shape: Callable[[float], float], seconds: float, after_s: float, step: float = 0.05
) -> Callable[[float], str]:
    """Each moment's phase: ``during`` a burst (load >= BURST_LEVEL x), ``after`` one (within
    ``after_s`` of its end), else ``before``."""
    ends, inside = [], False
    for i in range(int(seconds / step) + 1):
        now = shape(i * step) >= BURST_LEVEL
        if inside and not now:
            ends.append(i * step)
        inside = now
    return lambda t: (
        "during" if shape(t) >= BURST_LEVEL else "after" if any(0 <= t - e < after_s for e in ends) else "before"
    )


def bounds(shape: Callable[[float], float], seconds: float, max_dp: int, points: int = 10000) -> dict[str, float]:
    """The least share of static-max's rank-seconds any policy could spend on ``shape`` if ranks serve
    in proportion to their number and static-max is just enough for the peak (one rank per
    ``peak / max_dp`` of load), scaling instantly with perfect foresight: ``fluid`` with fractional
    ranks (the mean load over the peak), ``whole`` with whole ranks (ceil of the load in ranks). A
    trace whose bound is above a goal's share cannot meet that goal, whatever the policy."""
    loads = [shape((i + 0.5) * seconds / points) for i in range(points)]
    per_rank = max(loads) / max_dp
    return {
        "fluid": sum(loads) / len(loads) / max(loads),
        "whole": sum(min(max_dp, math.ceil(x / per_rank - 1e-9)) for x in loads) / len(loads) / max_dp,
    }


def cases(a: argparse.Namespace) -> dict[str, dict[str, Any] | int]:
    """Static sizes as ints; autoscaled cases as their policies (the fixed delays compressed)."""
    c, lo, hi = 1.0 / a.compress, a.min_dp, a.max_dp
    load = {
        "min_dp": lo,
        "max_dp": hi,
        "mode": "on",
        "target_utilization": a.target_utilization,
        "up_delay_s": "auto",
        "down_delay_s": "auto",
        "cooldown_s": "auto",
        "window_s": 30.0,
    }
    return {
        "static-min": lo,
        "static-max": hi,
        "serve-like": {
            "min_dp": lo,
            "max_dp": hi,
            "mode": "on",
            "target_queue": 2.0,
            "tolerance": 0.0,
            "up_delay_s": 30 * c,
            "down_delay_s": 600 * c,
            "cooldown_s": 0.0,
            "max_step": hi,
        },
        "queue-slo": {
            "min_dp": lo,
            "max_dp": hi,
            "mode": "on",
            "target_queue": 2.0,
            "slo_ttft_ms": a.slo_ttft_ms,
            "up_delay_s": 20 * c,
            "down_delay_s": 300 * c,
            "cooldown_s": 30 * c,
            "window_s": max(5.0, 60 * c),
        },
        "load": load,
        "load+standby": {**load, "standby": "auto", "burst": a.burst},
    }


async def _requests(
    dep: LocalDeployment, shape: Callable[[float], float], a: argparse.Namespace, seed: int, out: list[dict[str, Any]]
) -> None:
    """Open-loop Poisson arrivals at ``base_rate x shape(t)``; every answer lands in ``out`` with its
    arrival time in the trace (``at``)."""
    rng = random.Random(seed)

    async def one(prompt: list[int], at: float) -> None:
        try:
            res = await dep.generate(prompt, MAX_TOKENS)
        except Exception as e:  # noqa: BLE001 - a failure is a miss, counted
            res = {"error": repr(e)}
        out.append(dict(res, at=at))

    tasks, t0 = [], time.time()
    while (now := time.time() - t0) < a.seconds:
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 12))]
        tasks.append(asyncio.ensure_future(one(prompt, now)))
        await asyncio.sleep(rng.expovariate(a.base_rate * shape(now)))
    await asyncio.gather(*tasks)


async def _autoscale(dep: LocalDeployment, host: AutoscaleHost, tick_s: float, stop: asyncio.Event) -> None:
    async def act(d: Any) -> dict[str, Any]:
        return await dep.orch.scale(d.recommendation, timeout_s=120)

    while not stop.is_set():
        await autoscale_round(host, dep.orch, act, standby=dep.set_standby)
        await asyncio.sleep(tick_s)


async def _rank_seconds(dep: LocalDeployment, stop: asyncio.Event, acc: list[float]) -> None:
    """Serving ranks and standby ranks (ready or launching), integrated over time."""
    last = time.time()
    while not stop.is_set():
        await asyncio.sleep(0.25)
        now = time.time()
        pool = dep.pool.summary() if dep.pool is not None else {"ready": [], "launching": 0}
        acc[0] += (len(dep.orch.members) + len(pool["ready"]) + pool["launching"]) * (now - last)
        last = now


async def run_case(
    cfg: EngineConfig,
    case: dict[str, Any] | int,
    shape: Callable[[float], float],
    a: argparse.Namespace,
    seed: int,
    learned: dict[str, Any],
) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    start = case if isinstance(case, int) else case["min_dp"]
    host = None
    async with LocalDeployment(cfg, "bench-autoscale", max_dp=a.max_dp) as dep:
        await dep.start(start)
        stop, acc, t0 = asyncio.Event(), [0.0], time.time()
        side = [asyncio.ensure_future(_rank_seconds(dep, stop, acc))]
        if not isinstance(case, int):
            host = AutoscaleHost(
                "bench-autoscale",
                a.max_dp,
                persist=lambda s: None,
                saved=learned if "target_utilization" in case else None,
            )
            host.set_autoscale(case)
            side.append(asyncio.ensure_future(_autoscale(dep, host, a.tick, stop)))
        await _requests(dep, shape, a, seed, results)
        stop.set()
        await asyncio.gather(*side)
        ops = [
            op
            for op in dep.orch.history
            if op.get("kind") != "recover" and not (op.get("error") or "").startswith("already")
        ]
    acted = [
        {
            "t": round(d["at"] - t0, 2),
            "from": d["current_dp"],
            "to": d["recommendation"],
            "action": d["action"],
            "rule": d["rule"],
        }
        for d in (host.autoscale_decisions(limit=500)["decisions"] if host else [])
        if d["act"]
    ]
    return {
        "rank_s": acc[0],
        "ops": len(ops),
        "acted": acted,
        **attainment(results, phase_of(shape, a.seconds, a.after), a),
    }


def attainment(results: list[dict[str, Any]], phase: Callable[[float], str], a: argparse.Namespace) -> dict[str, Any]:
    """% of requests within both SLOs (a failure is a miss), overall and per phase."""

    def ok(r: dict[str, Any]) -> bool:
        return (
            not r.get("error")
            and r.get("ttft_ms") is not None
            and r["ttft_ms"] <= a.slo_ttft_ms
            and (r.get("tpot_ms") or 0.0) <= a.slo_tpot_ms
        )

    out: dict[str, Any] = {
        "requests": len(results),
        "failed": sum(1 for r in results if r.get("error")),
        "slo_pct": 100.0 * sum(map(ok, results)) / max(1, len(results)),
    }
    for name in PHASES:
        rows = [r for r in results if phase(r["at"]) == name]
        out[f"{name}_pct"] = 100.0 * sum(map(ok, rows)) / len(rows) if rows else None
        out[f"{name}_n"] = len(rows)
    return out


async def calibrate(cfg: EngineConfig, a: argparse.Namespace) -> dict[str, Any]:
    """What this host measures before the runs: a rank's tokens/s at saturation (a closed loop of
    twice its slots at DP 1, read from its saturated-step counters) and a scale's cost (1 -> 2 -> 1),
    as the load cases' durable state."""
    capacity, cost = CapacityLearner(), ScaleCost()
    async with LocalDeployment(cfg, "bench-calibrate", max_dp=a.max_dp) as dep:
        await dep.start(1)
        capacity.add(time.time(), [await dep.orch.clients[0].status(timeout=10)])
        stop = time.time() + a.calibrate_s

        async def client(i: int) -> None:
            while time.time() < stop:
                await dep.generate([(7 * i + j) % 256 for j in range(2 + i % 10)], MAX_TOKENS)

        await asyncio.gather(*(client(i) for i in range(2 * cfg.max_num_seqs)))
        capacity.add(time.time(), [await dep.orch.clients[0].status(timeout=10)])
        for size in (2, 1):
            cost.observe(await dep.orch.scale(size, timeout_s=120))
    return {"capacity": capacity.learned, "cost": cost.to_dict()}


def _spread(xs: list[float | None], fmt: str = "{:.1f}") -> str:
    v = [x for x in xs if x is not None]
    if not v:
        return "-"
    mid = fmt.format(statistics.median(v))
    return mid if len(v) == 1 else f"{mid} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


def row(trace: str, label: str, runs: list[dict[str, Any]]) -> str:
    cells = [_spread([r["slo_pct"] for r in runs])] + [_spread([r[f"{p}_pct"] for r in runs]) for p in PHASES]
    return (
        f"| {trace} | {label} | " + " | ".join(cells) + f" | {_spread([r['rank_s'] for r in runs], '{:.0f}')} "
        f"| {_spread([r['ops'] for r in runs], '{:.0f}')} | {sum(r['failed'] for r in runs)} "
        f"| {_spread([r['requests'] for r in runs], '{:.0f}')} |"
    )


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0, help="length of each trace")
    p.add_argument("--runs", type=int, default=3, help="runs of every case (median and spread printed)")
    p.add_argument("--compress", type=float, default=10.0, help="how much faster than real time fixed delays run")
    p.add_argument("--base-rate", type=float, default=4.0, help="requests per second at load 1x")
    p.add_argument("--min-dp", type=int, default=1)
    p.add_argument("--max-dp", type=int, default=4)
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--tick", type=float, default=0.5, help="seconds between autoscaling rounds")
    p.add_argument("--target-utilization", type=float, default=0.7, help="the load cases' --target-utilization")
    p.add_argument("--burst", type=float, default=4.0, help="load+standby's --burst")
    p.add_argument("--after", type=float, default=10.0, help="seconds after a burst that count as its aftermath")
    p.add_argument("--seed", type=int, default=0, help="the bursty trace's bursts and every run's arrivals")
    p.add_argument("--traces", default="step,ramp,daily,bursty")
    p.add_argument("--cases", default="static-min,static-max,serve-like,queue-slo,load,load+standby")
    p.add_argument("--calibrate-s", type=float, default=6.0, help="seconds of the closed loop that measures capacity")
    p.add_argument("--no-calibrate", action="store_true", help="the load cases start from the seeds")
    p.add_argument("--out", default="", help="write every run's figures here (JSON)")
    p.add_argument("--verbose", action="store_true", help="print every decision acted on, with its rule")
    return p.parse_args()


def main() -> None:
    a = parse()
    cfg = EngineConfig(max_num_seqs=4, capture_sizes=[1, 2, 4])
    learned = {} if a.no_calibrate else asyncio.run(calibrate(cfg, a))
    print(
        f"traces of {a.seconds:g}s at {a.base_rate:g} req/s x load; DP {a.min_dp}..{a.max_dp}; SLO TTFT "
        f"{a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms; fixed delays compressed {a.compress:g}x; {a.runs} run(s) "
        f"each, median [min-max]; calibrated: {json.dumps(learned) if learned else 'no (seeds)'}\n"
    )
    print(
        "| trace | case | SLO attainment % | before | during | after | rank-seconds | operations | failed | requests |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    shapes, every = traces(a.seconds, a.seed), cases(a)
    record: dict[str, Any] = {"args": vars(a), "calibrated": learned, "bursts": bursts(a.seconds, a.seed), "runs": {}}
    for name in a.traces.split(","):
        b = bounds(shapes[name], a.seconds, a.max_dp)
        print(
            f"| {name} | bound (instant, foresight) | - | - | - | - | fluid {100 * b['fluid']:.1f} % / whole ranks "
            f"{100 * b['whole']:.1f} % of static-max | - | - | - |",
            flush=True,
        )
        for label in a.cases.split(","):
            runs = [
                asyncio.run(run_case(cfg, every[label], shapes[name], a, a.seed * 1000 + i, learned))
                for i in range(a.runs)
            ]
            record["runs"][f"{name}/{label}"] = runs
            print(row(name, label, runs), flush=True)
            for i, r in enumerate(runs if a.verbose else []):
                for d in r["acted"]:
                    print(f"  run {i} {d['t']:7.2f}s DP {d['from']} -> {d['to']}: {d['action']}; {d['rule']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
