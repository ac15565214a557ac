"""The GPU path: real CUDA graphs (piecewise around gloo collectives), released and re-captured
once per transition. Needs a CUDA device; the CPU CI skips it and covers the same protocol
with the static-buffer replay (test_engine_isolation, test_scaling_ray)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from tests.engine_helpers import run, wait_decoding, wait_until
from tests.helpers import moved_off

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU CI covers the protocol)"),
]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9] * 10, [3, 1, 4, 1, 5]]


@pytest.mark.timeout(300)
def test_cuda_graphs_release_and_single_recapture() -> None:
    cfg = EngineConfig(dtype="float64", slots_per_rank=8, capture_sizes=[1, 2, 4], capture_policy="recapture")
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


@pytest.mark.timeout(300)
def test_cuda_reuse_switches_worlds_without_capturing_on_survivors() -> None:
    """``reuse`` on real CUDA graphs: captured once for max DP 3, the 2->3->2 transitions make no
    capture pass on the survivors, replays continue, and every output is the oracle's. The joiner
    comes from a pool of one, where it captured as standby 100000 before adoption; the 3->2 retires
    rank 1 from the middle, so rank 2 replays at position 1 graphs captured at another position:
    the EP position is a device scalar the graphs read at replay (a baked int gave wrong tokens)."""
    cfg = EngineConfig(dtype="float64", slots_per_rank=8, capture_sizes=[1, 2, 4], capture_policy="reuse")
    ref = [r["output"] for r in reference_generate(cfg, PROMPTS, 8)]

    async def scenario() -> None:
        async with LocalDeployment(cfg, "cuda-reuse", device="cuda", max_dp=3, standby=1) as dep:
            await dep.start(2)
            await wait_until(lambda: len(dep.pool.ready) == 1, 120, "the standby in the pool")
            for target, joiners, retire in ((3, {"2"}, None), (2, set(), [1])):
                inflight = [asyncio.ensure_future(dep.generate(p, 8)) for p in PROMPTS]
                op = await dep.scale(target, retire=retire)
                assert op["state"] == "succeeded", op
                assert {r for r, n in op["captures_per_rank"].items() if n} == joiners, op["captures_per_rank"]
                if joiners:
                    pooled = [
                        e
                        for e in dep.registry.events_for(op["op_id"])
                        if e["phase"] == "capture" and e["detail"].get("in_pool")
                    ]
                    assert [e["rank"] for e in pooled] == [2], pooled
                assert [o["output"] for o in await asyncio.gather(*inflight)] == ref
                outs = await asyncio.gather(*(dep.generate(p, 8) for p in PROMPTS))
                assert [o["output"] for o in outs] == ref
            assert list(dep.orch.members) == [0, 2]
            views = [v for v in dep.registry.rank_views() if v["rank"] in (0, 2)]
            assert {v["graph_kind"] for v in views} == {"cuda"} and all(v["graph_replays"] > 0 for v in views)
            assert dep.registry.violations() == []

    run(scenario(), 280)


@pytest.mark.timeout(300)
def test_cuda_rank_sigkill_recovers_with_one_capture_and_oracle_outputs() -> None:
    """Self-healing on the device: a serving rank SIGKILLed under load; the survivors release,
    re-warm and capture once on the GPU, and no request is lost or changed: the victim's requests,
    killed mid-decode, continue on a survivor with the tokens they had."""
    import os
    import signal

    cfg = EngineConfig(dtype="float64", slots_per_rank=8, capture_sizes=[1, 2, 4], capture_policy="recapture")
    tokens = 16  # long enough that the victim's requests are still decoding at the kill
    ref = {tuple(p): r["output"] for p, r in zip(PROMPTS, reference_generate(cfg, PROMPTS, tokens))}

    async def scenario() -> None:
        async with LocalDeployment(cfg, "cuda-heal", device="cuda", max_dp=3, on_rank_failure="shrink") as dep:
            await dep.start(3)
            inflight = [asyncio.ensure_future(dep.generate(p, tokens)) for p in PROMPTS * 3]
            await asyncio.wait_for(wait_decoding(dep, 1), 30)  # rank 1 holds requests with tokens
            os.kill(dep.processes[1].pid(), signal.SIGKILL)  # this test's own rank process
            outs = await asyncio.wait_for(asyncio.gather(*inflight), 120)
            assert [o.get("error") for o in outs if o.get("error")] == []
            assert [o["output"] for o in outs] == [ref[tuple(p)] for p in PROMPTS * 3]
            moved_off(outs, 1)  # they moved off the victim and continued with the tokens it had streamed
            await dep.orch.recovery.wait()
            op = next(o for o in reversed(dep.orch.history) if o.get("kind") == "recover")
            assert op["state"] == "succeeded" and op["dead_ranks"] == [1], op
            assert op["captures_per_rank"] == {"0": 1, "2": 1}, op["captures_per_rank"]
            views = [v for v in dep.registry.rank_views() if v["rank"] in (0, 2)]
            assert {v["graph_kind"] for v in views} == {"cuda"}
            assert dep.registry.violations() == []

    run(scenario(), 280)
