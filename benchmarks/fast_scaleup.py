"""Scale-up 2->4 under load on the process launcher, in one run: a cold restart (stop + start
at DP 4, timed as one span), elastic without standby, with a standby pool, and with a standby
pool and ``capture_policy=reuse``. Prints a markdown table (wall, launch, serving pause,
capture passes, failed requests, outputs against the dense oracle).

It uses the process launcher (``engine_ext.launcher.LocalDeployment``: the four cases in one
process, no Ray actor start in the figures); on Ray the same pool is ``eepctl up --standby`` /
``eepctl standby`` (tests/test_standby_ray.py), and ``benchmarks/transition.py`` stays the Ray figure.

Usage: PYTHONPATH=. python benchmarks/fast_scaleup.py [--rate R]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate

PROMPTS = [[7], [1, 2, 3], [200, 13, 99, 5, 5], [(11 * j + 3) % 256 for j in range(9)]]
MAX_TOKENS = 6


async def _load(dep: LocalDeployment, rate: float, stop: asyncio.Event, out: list[dict]) -> None:
    """Open-loop requests at ``rate``/s until ``stop``; every result lands in ``out``."""
    tasks = []
    i = 0
    while not stop.is_set():
        tasks.append(asyncio.ensure_future(dep.generate(PROMPTS[i % len(PROMPTS)], MAX_TOKENS)))
        i += 1
        await asyncio.sleep(1 / rate)
    for r in await asyncio.gather(*tasks, return_exceptions=True):
        out.append(r if isinstance(r, dict) else {"error": repr(r)})


async def _case(name: str, cfg: EngineConfig, standby: int, rate: float, reference: list[dict]) -> dict[str, Any]:
    results: list[dict] = []
    stop = asyncio.Event()
    dep = LocalDeployment(cfg, f"bench{name}", max_dp=4, standby=standby)
    await dep.start(2)
    load = asyncio.ensure_future(_load(dep, rate, stop, results))
    await asyncio.sleep(2.0)
    t0 = time.perf_counter()
    if name == "cold":
        stop.set()
        await load
        await dep.stop()
        dep = LocalDeployment(cfg, "benchcold4", max_dp=4)
        await dep.start(4)
        wall, op = time.perf_counter() - t0, {}
    else:
        op = await dep.scale(4, timeout_s=120)
        wall = time.perf_counter() - t0
        await asyncio.sleep(1.0)
        stop.set()
        await load
    finals = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
    await dep.stop()
    by_prompt = {tuple(r["prompt"]): r["output"] for r in reference}
    same = all(
        r["output"] == by_prompt[tuple(r["prompt"])] for r in finals + [r for r in results if not r.get("error")]
    )
    pd = op.get("phase_durations", {})
    return {
        "case": name,
        "wall_s": wall,
        "launch_s": pd.get("launch", 0.0),
        "pause_s": op.get("serving_pause_s", 0.0),
        "captures": op.get("captures_per_rank", {}),
        "requests": len(results),
        "failed": sum(1 for r in results if r.get("error")),
        "oracle_equal": same,
    }


async def main(rate: float) -> None:
    base = EngineConfig(dtype="float64", capture_policy="recapture")
    reference = reference_generate(base, PROMPTS, MAX_TOKENS)
    rows = [
        await _case("cold", base, 0, rate, reference),
        await _case("elastic", base, 0, rate, reference),
        await _case("standby", base, 2, rate, reference),
        await _case("standby+reuse", EngineConfig(dtype="float64", capture_policy="reuse"), 2, rate, reference),
    ]
    cold = rows[0]["wall_s"]
    print("| 2->4 | wall s | x cold | launch s | serving pause s | captures/rank | requests | failed | oracle |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        caps = ",".join(f"{k}:{v}" for k, v in sorted(r["captures"].items())) or "-"
        print(
            f"| {r['case']} | {r['wall_s']:.2f} | {r['wall_s'] / cold:.2f} | {r['launch_s']:.2f} | "
            f"{r['pause_s']:.3f} | {caps} | {r['requests']} | {r['failed']} | {r['oracle_equal']} |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=4.0)
    asyncio.run(main(ap.parse_args().rate))
