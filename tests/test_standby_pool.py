"""The standby pool on the process launcher: a scale-up adopts launched-ahead ranks (launch
phase near zero, identities re-based from ``_standby<N>`` to ``_dp<rank>``, outputs equal the
dense oracle), the pool refills after the operation, a standby killed is replaced while
the serving ranks keep serving, and a stop while a replacement launches leaves no process."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import pytest

from eepctl import render
from engine_ext.config import EngineConfig
from engine_ext.elastic.identity import STANDBY_RANK_BASE
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from tests.engine_helpers import oracle_mismatch, run, wait_until

PROMPTS = [
    [7],
    [1, 2, 3],
    [200, 13, 99, 5, 5],
    [(11 * j + 3) % 256 for j in range(9)],
    [(37 * j + 17) % 256 for j in range(14)],
    [255, 0, 128, 64, 32, 16, 8, 4],
]
MAX_TOKENS = 4


def _ids(dep: LocalDeployment) -> dict[int, tuple[str, str]]:
    return {r["rank"]: (r["instance_id"], r["state"]) for r in dep.registry.snapshot()["ranks"]}


@pytest.mark.timeout(270)
def test_scale_up_takes_joiners_from_the_pool_refills_and_replaces_a_killed_standby():
    cfg = EngineConfig(dtype="float64", instance_id="pool")

    async def go() -> dict:
        out: dict = {}
        async with LocalDeployment(cfg, "pool", max_dp=4, standby=2) as dep:
            await dep.start(2)
            await wait_until(lambda: len(_ids(dep)) == 4, 30, "two serving ranks and two standbys")
            out["before"] = _ids(dep)
            out["status"] = render.status_summary_lines(dep.registry.snapshot())
            out["violations_before"] = dep.registry.violations()
            pids = {r: c.pid() for r, c in dep.processes.items()}
            standby_pids = sorted(c.pid() for c in dep.pool.ready.values())
            out["dry_run"] = render.plan_text((await dep.orch.plan(4)).to_dict())
            op = await dep.scale(4, timeout_s=120)
            out["op"] = op
            out["adopted"] = sorted(dep.processes[r].pid() for r in (2, 3)) == standby_pids
            out["results"] = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
            await wait_until(lambda: len(dep.pool.ready) == 2, 120, "the pool refilled")
            await wait_until(lambda: len(_ids(dep)) == 6, 30, "refilled standbys reporting")
            out["after"] = _ids(dep)
            out["violations_after"] = dep.registry.violations()
            # Kill one standby: the pool replaces it; the serving ranks neither restart nor fail.
            victim_n = min(dep.pool.ready)
            os.kill(dep.pool.ready[victim_n].pid(), signal.SIGKILL)
            await wait_until(
                lambda: victim_n not in dep.pool.ready and len(dep.pool.ready) == 2, 120, "the killed standby replaced"
            )
            out["serving_pids_same"] = all(dep.processes[r].pid() == p for r, p in pids.items())
            out["after_kill"] = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
            out["states_after_kill"] = {r: s for r, (_, s) in _ids(dep).items() if r < 4}
            # Stop while the pool launches a replacement: the launch is cancelled, and its process
            # must go with the deployment (it belonged to nobody and lived as long as this process).
            os.kill(dep.pool.ready[min(dep.pool.ready)].pid(), signal.SIGKILL)
            await wait_until(
                lambda: dep.pool.summary()["launching"] > 0, 30, "a replacement launching", interval_s=0.01
            )
        left = lambda: [p.name for p in multiprocessing.active_children() if p.name.startswith("pool_")]  # noqa: E731
        for _ in range(100):  # a killed process is gone within moments; a leaked one stays
            if not left():
                break
            await asyncio.sleep(0.1)
        out["left_running"] = left()
        return out

    o = run(go(), 260)
    base = STANDBY_RANK_BASE
    assert o["before"] == {
        0: ("pool_dp0", "serving"),
        1: ("pool_dp1", "serving"),
        base: ("pool_standby0", "standby"),
        base + 1: ("pool_standby1", "standby"),
    }
    assert any(line.startswith("standby pool: 2 rank(s)") for line in o["status"]), o["status"]
    assert o["violations_before"] == [] and o["violations_after"] == []
    # --dry-run names the standbys the joiners come from.
    assert "join   rank 2 as pool_dp2 (from the standby pool: pool_standby0, launch skipped)" in o["dry_run"], o[
        "dry_run"
    ]
    assert "rank 3 as pool_dp3 (from the standby pool: pool_standby1" in o["dry_run"]
    op = o["op"]
    assert op["state"] == "succeeded", op.get("error")
    assert o["adopted"], "the joiners are the standby processes"
    assert op["phase_durations"]["launch"] < 1.0, op["phase_durations"]
    reference = reference_generate(cfg, PROMPTS, MAX_TOKENS)
    assert oracle_mismatch(list(enumerate(o["results"])), reference) == ""
    assert {r["rank"] for r in o["results"]} <= {0, 1, 2, 3}
    # Identities re-based to _dp<rank>; two new standbys under new numbers.
    assert {r: i for r, (i, _) in o["after"].items() if r < 4} == {r: f"pool_dp{r}" for r in range(4)}
    assert {i for r, (i, s) in o["after"].items() if r >= base and s == "standby"} == {"pool_standby2", "pool_standby3"}
    assert o["serving_pids_same"]
    assert o["states_after_kill"] == {r: "serving" for r in range(4)}
    assert oracle_mismatch(list(enumerate(o["after_kill"])), reference) == ""
    assert o["left_running"] == [], o["left_running"]
