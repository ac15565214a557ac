"""The GPU path: real CUDA graphs (piecewise around gloo collectives), released and re-captured
once per transition. Needs a CUDA device; the CPU CI skips it and covers the same protocol
with the static-buffer replay (test_engine_isolation, test_scaling_ray)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_ext.engine.config import EngineConfig
from engine_ext.engine.launcher import LocalDeployment
from engine_ext.engine.dense_oracle import reference_generate
from tests.engine_helpers import run

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU CI covers the protocol)"),
]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 10, [3, 1, 4, 1, 5]]


@pytest.mark.timeout(300)
def test_cuda_graphs_release_and_single_recapture() -> None:
    cfg = EngineConfig(dtype="float64", slots_per_rank=8, capture_sizes=[1, 2, 4])
    ref = [r["output"] for r in reference_generate(cfg, PROMPTS, 8)]

    async def scenario() -> None:
        async with LocalDeployment(cfg, "cuda-test", device="cuda", max_dp=3) as dep:
            await dep.start(2)
            outs = await asyncio.gather(*(dep.generate(p, 8) for p in PROMPTS))
            assert [o["output"] for o in outs] == ref
            inflight = [asyncio.ensure_future(dep.generate(p, 8)) for p in PROMPTS]
            op = await dep.scale(3)
            assert op["state"] == "succeeded", op
            assert op["captures_per_rank"] == {"0": 1, "1": 1, "2": 1}
            assert [o["output"] for o in await asyncio.gather(*inflight)] == ref
            views = dep.registry.rank_views()
            assert {v["graph_kind"] for v in views} == {"cuda"}
            assert all(v["graph_replays"] > 0 for v in views if v["rank"] < 2)
            warm = [e for e in dep.registry.events_for(op["op_id"]) if e["phase"] == "warm"]
            assert len(warm) == 3 and all(e["detail"]["workspace_bytes"] == e["detail"]["required_bytes"] for e in warm)
            assert dep.registry.violations() == []

    run(scenario(), 280)
