"""A quick GPU smoke check of the reference engine, before the full benchmark: DP 1 and 2,
eager only and with CUDA graphs. Usage: PYTHONPATH=. python3 benchmarks/gpu_smoke.py"""

from __future__ import annotations

import asyncio
import sys
import traceback

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 10]


async def case(dp: int, sizes: list[int], ref: list[list[int]]) -> str:
    cfg = EngineConfig(dtype="float64", slots_per_rank=8, capture_sizes=sizes)
    try:
        async with LocalDeployment(cfg, f"smoke{dp}", device="cuda") as dep:
            await asyncio.wait_for(dep.start(dp), 120)
            outs = await asyncio.wait_for(asyncio.gather(*(dep.generate(p, 6) for p in PROMPTS)), 60)
            got = [o.get("output") for o in outs]
            errs = [o.get("error") for o in outs if o.get("error")]
            return f"ok={got == ref} errors={errs[:1]}"
    except BaseException as e:  # noqa: BLE001
        return f"FAILED {type(e).__name__}: {str(e)[-3000:]}"


def main() -> None:
    ref = [r["output"] for r in reference_generate(EngineConfig(dtype="float64", slots_per_rank=8), PROMPTS, 6)]
    for dp, sizes in ((1, []), (1, [1, 2, 4]), (2, []), (2, [1, 2, 4])):
        print(f"dp={dp} capture_sizes={sizes}: {asyncio.run(case(dp, sizes, ref))}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
