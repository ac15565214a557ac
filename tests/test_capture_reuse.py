"""The ``reuse`` capture policy on the process launcher: captures sized once for max DP serve
2 -> 4 -> 3 -> 2 with zero capture passes on the survivors and the dense oracle's tokens, the
registry reports no I4 violation for those zero passes, and a capture sized for the launch
world instead of max DP is refused on the scale-up."""

from __future__ import annotations

import asyncio

import pytest

from engine_ext.capture_memory import workspace_bytes
from engine_ext.config import EngineConfig
from engine_ext.model.dense_oracle import reference_generate
from engine_ext.launcher import LocalDeployment
from eepctl import render
from tests.engine_helpers import oracle_mismatch, run, wait_until

MAX_TOKENS = 4
PROMPTS = [[7], [1, 2, 3], [200, 13, 99, 5, 5], [(11 * j + 3) % 256 for j in range(9)],
           [(37 * j + 17) % 256 for j in range(14)], [255, 0, 128, 64, 32, 16, 8, 4]]


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(dtype="float64", capture_policy="reuse", **kw)


def _lock_events(dep: LocalDeployment, op_id: str) -> dict[int, dict]:
    return {e.rank: e.detail for _, e in dep.registry.events if e.op_id == op_id and e.phase == "lock"}


def _capture_events(dep: LocalDeployment, op_id: str) -> list[int]:
    return [e.rank for _, e in dep.registry.events if e.op_id == op_id and e.phase == "capture"]


async def _reuse_path(cfg: EngineConfig) -> list[tuple[int, list[dict], dict[int, dict], list[int], list]]:
    out = []
    async with LocalDeployment(cfg, "reuse", max_dp=4) as dep:
        await dep.start(2)
        # Status and the dry run say what reuse costs against recapture.
        plan = (await dep.orch.plan(3)).to_dict()
        assert "reuse costs +" in render.plan_text(plan), render.plan_text(plan)
        await wait_until(lambda: dep.registry.snapshot()["ranks"], 30, "rank status")
        lines = render.status_summary_lines(dep.registry.snapshot())
        assert any(line.startswith("capture policy reuse: workspace") for line in lines), lines
        prev = 2
        for dp in (2, 4, 3, 2):
            op: dict = {}
            if dp != prev or not out:
                if out:
                    op = await dep.scale(dp, timeout_s=120)
                    assert op["state"] == "succeeded", (op.get("error"), op)
            prev = dp
            results = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
            op_id = op.get("op_id", "")
            out.append((dp, results, _lock_events(dep, op_id) if op_id else {},
                        _capture_events(dep, op_id) if op_id else [], dep.registry.violations()))
    return out


@pytest.mark.timeout(270)
def test_reuse_serves_2_4_3_2_with_no_capture_on_survivors_and_oracle_outputs():
    cfg = _cfg()
    reference = reference_generate(_cfg(), PROMPTS, MAX_TOKENS)
    path = run(_reuse_path(cfg), 240)
    assert [dp for dp, *_ in path] == [2, 4, 3, 2]
    for i, (dp, results, locks, captures, violations) in enumerate(path):
        assert all(not r.get("error") for r in results), results
        assert {r["rank"] for r in results} <= set(range(dp))
        assert oracle_mismatch(list(enumerate(results)), reference) == "", f"at DP {dp}"
        assert violations == [], violations
        if i == 0:
            continue
        # Survivors captured nothing and said so; only joiners (ranks 2, 3 on 2 -> 4) captured, once.
        joiners = {2, 3} if i == 1 else set()
        assert sorted(captures) == sorted(joiners)
        assert set(locks) == set(range(dp)), locks  # every rank of the new world locked
        for rank, d in locks.items():
            assert d["capture_policy"] == "reuse"
            assert d["capture_passes"] == d["expected_passes"] == (1 if rank in joiners else 0)
            assert d["workspace_bytes"] == workspace_bytes(cfg, 4)


@pytest.mark.timeout(200)
def test_reuse_check_refuses_a_capture_sized_for_the_launch_world():
    cfg = _cfg(faults=["reuse_sized_for_world"])

    async def go() -> tuple[dict, list]:
        async with LocalDeployment(cfg, "reusebad", max_dp=4) as dep:
            await dep.start(2)
            op = await dep.scale(4, timeout_s=60)
            errors = [e.detail.get("error", "") for _, e in dep.registry.events
                      if e.op_id == op.get("op_id") and e.phase == "lock" and e.outcome == "error"]
            return op, errors

    op, errors = run(go(), 180)
    assert op["state"] != "succeeded", op
    assert any("reused capture refused" in m and "world of 2" in m for m in errors), (op, errors)


def test_capture_memory_matches_the_model_bound():
    """eepctl's torch-free figure equals the bound the rank sizes its workspace by."""
    import torch

    from engine_ext.elastic.workspace import bytes_for
    from engine_ext.capture_memory import policy_memory

    for dtype, tdt in (("float32", torch.float32), ("float64", torch.float64)):
        cfg = EngineConfig(dtype=dtype)
        for w in (1, 2, 4, 8):
            n = w * cfg.max_num_tokens
            specs = [((n, cfg.hidden_size), tdt), ((n, cfg.top_k), torch.int64), ((n, cfg.top_k), tdt),
                     ((n, cfg.hidden_size), tdt), ((n, cfg.hidden_size), tdt), ((n, cfg.expert_hidden), tdt)]
            assert workspace_bytes(cfg, w) == bytes_for(specs)
    mem = policy_memory(EngineConfig(capture_policy="reuse"), 2, 4)
    assert mem["held_bytes"] == mem["reuse_bytes"] > mem["recapture_bytes"] and mem["reuse_extra_bytes"] > 0
