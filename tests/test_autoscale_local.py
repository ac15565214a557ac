"""The autoscaler on real rank processes (the process launcher, real gloo, real requests), driven
round by round as the controller's loop drives it (``autoscale_round``): a load step recorded but
not acted on in advisory mode, acted on in mode on (up by the max step while requests are in
flight, none failing; the new world serves the oracle's tokens), then down after the down-delay, the
emptiest ranks leaving, and no move while the load stays gone. The two scales' measured costs
become the points of the deployment's own cost model (engine_ext.control.cost_learn)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from engine_ext.ray.autoscale_host import AutoscaleHost, autoscale_round
from tests.engine_helpers import oracle_mismatch, run

LOAD = [[(7 * i + j) % 256 for j in range(3 + i % 5)] for i in range(12)]
LOAD_TOKENS = 60
PROMPTS = [[7], [1, 2, 3], [200, 13, 99, 5, 5], [(11 * j + 3) % 256 for j in range(9)]]
MAX_TOKENS = 6


async def _scenario(cfg: EngineConfig) -> tuple[list[dict], list[dict], list[dict], list[int], int]:
    async with LocalDeployment(cfg, "autoscale", max_dp=4) as dep:
        await dep.start(1)
        host = AutoscaleHost("autoscale", 4, persist=lambda s: None)
        host.set_autoscale(
            {
                "min_dp": 1,
                "max_dp": 4,
                "target_queue": 2.0,
                "up_delay_s": 0.0,
                "down_delay_s": 3.0,
                "cooldown_s": 0.0,
                "max_step": 2,
            }
        )  # advisory first

        async def act(d):  # the loop moves the desired size; here: the orchestrator's scale to it
            return await dep.orch.scale(d.recommendation, timeout_s=120)

        pending = [asyncio.ensure_future(dep.generate(p, LOAD_TOKENS)) for p in LOAD]
        while True:  # until the rank reports the queued requests
            d = await autoscale_round(host, dep.orch, act)
            if d is not None and d.recommendation > 1:
                break
            await asyncio.sleep(0.05)
        ops_in_advisory = len(dep.orch.history)
        host.set_autoscale({"mode": "on"})
        await autoscale_round(host, dep.orch, act)  # the window still holds the step: up it goes
        served = await asyncio.gather(*pending)
        results = [await dep.generate(p, MAX_TOKENS) for p in PROMPTS]  # at DP 3
        t_end = time.time() + 6.0
        while time.time() < t_end:  # load gone: down after the down-delay, then nothing moves
            await autoscale_round(host, dep.orch, act)
            await asyncio.sleep(0.25)
        learned = dep.orch.admission.learned  # the cost model learns from the deployment's own scales
        scales = [op for op in dep.orch.history if op.get("cost")]
        assert [p["op_id"] for p in learned.points] == [op["op_id"] for op in scales] and len(scales) == 2, scales
        for p, op in zip(learned.points, scales):
            assert p["total_moved_bytes"] == op["cost"]["predicted"]["total_moved_bytes"], (p, op["cost"])
            assert (p["move_s"], p["pause_s"]) == (op["cost"]["measured"]["move_s"], op["serving_pause_s"]), p
        # 2 scales: no fit of its own yet, and the dry run says so (asked as a GPU deployment's
        # admission would ask: the shipped CPU fit does not apply there)
        dep.orch.admission.device = "cuda"
        why = (await dep.orch.plan(2)).cost["no_model"]
        assert learned.fit is None and why.startswith("no cost model fitted on this host yet: learning ("), why
        return served, results, host.autoscale_decisions()["decisions"], list(dep.orch.members), ops_in_advisory


@pytest.mark.timeout(240)
def test_advisory_records_mode_on_scales_up_then_down_after_the_delay() -> None:
    cfg = EngineConfig(dtype="float64", max_num_seqs=4, capture_sizes=[1, 2, 4], capture_policy="recapture")
    served, results, trail, members, ops_in_advisory = run(_scenario(cfg), 200)
    assert all(not r.get("error") and len(r["output"]) == LOAD_TOKENS for r in served), "0 failed requests"
    assert ops_in_advisory == 0, "advisory mode acts on nothing"
    advisory = [d for d in trail if d["mode"] == "advisory" and d["recommendation"] > d["current_dp"]]
    assert advisory and all(d["action"] == "advisory: not acted" for d in advisory)
    moves = [(d["current_dp"], d["recommendation"], d["action"].split(":")[0]) for d in trail if d["act"]]
    assert moves == [(1, 3, "scaled"), (3, 1, "scaled")], moves  # up by the max step, down once
    up, down = (d for d in trail if d["act"])
    assert up["signals"][0]["name"] == "queue" and up["signals"][0]["value"] > 2.0
    calm = [d for d in trail if d["mode"] == "on" and d["current_dp"] == 3 and d["at"] < down["at"]]
    assert calm and down["at"] - min(d["at"] for d in calm) >= 3.0, "down only after the down-delay"
    assert members == [0], "the emptiest ranks (idle: the last ones) left"
    assert oracle_mismatch(list(enumerate(results)), reference_generate(cfg, PROMPTS, MAX_TOKENS)) == ""
