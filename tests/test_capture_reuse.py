"""The ``reuse`` capture policy on the process launcher: captures sized once for max DP serve
2 -> 4 -> 3 -> 2 with zero capture passes on the survivors and the dense oracle's tokens (one
2 -> 4 joiner adopted from a standby pool that captured there, before adoption; the 4 -> 3
retires rank 1 from the middle, so two survivors replay at a new position), the survivors replay
their pre-transition captures after each switch (counted per batch size since the switch, none
served eagerly), the registry reports no I4 violation for those zero passes,
survivors that drop their captures are flagged, and a capture sized for the launch world instead
of max DP is refused on the scale-up. The default policy, ``auto``, takes reuse where the KV budget
holds its workspace beside every request slot's KV, and then no rank that stays re-warms in a scale."""

from __future__ import annotations

import asyncio

import pytest

from eepctl import render
from engine_ext.capture_memory import workspace_bytes
from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from tests.engine_helpers import oracle_mismatch, run, wait_until

MAX_TOKENS = 4
PROMPTS = [
    [7],
    [1, 2, 3],
    [200, 13, 99, 5, 5],
    [(11 * j + 3) % 256 for j in range(9)],
    [(37 * j + 17) % 256 for j in range(14)],
    [255, 0, 128, 64, 32, 16, 8, 4],
]


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(dtype="float64", capture_policy="reuse", **kw)


def _lock_events(dep: LocalDeployment, op_id: str) -> dict[int, dict]:
    return {e.rank: e.detail for _, e in dep.registry.events if e.op_id == op_id and e.phase == "lock"}


def _capture_events(dep: LocalDeployment, op_id: str) -> dict[int, dict]:
    return {e.rank: e.detail for _, e in dep.registry.events if e.op_id == op_id and e.phase == "capture"}


async def _live_status(dep: LocalDeployment) -> dict[int, dict]:
    """Each member's status, asked now (not a heartbeat's)."""
    return {r: await dep.orch.router.clients[r].status(timeout=10) for r in dep.orch.members}


async def _reuse_path(cfg: EngineConfig) -> list[tuple]:
    out = []
    # A pool of one: of the 2 -> 4 joiners one comes from the pool (captured there, before adoption,
    # as a standby numbered STANDBY_RANK_BASE + n) and one is launched (captures in its commit).
    async with LocalDeployment(cfg, "reuse", max_dp=4, standby=1) as dep:
        await dep.start(2)
        # Status and the dry run say what reuse costs against recapture.
        plan = (await dep.orch.plan(3)).to_dict()
        assert "reuse costs +" in render.plan_text(plan), render.plan_text(plan)
        await wait_until(lambda: dep.registry.snapshot()["ranks"], 30, "rank status")
        lines = render.status_summary_lines(dep.registry.snapshot())
        assert any(line.startswith("capture policy reuse: workspace") for line in lines), lines
        await wait_until(lambda: len(dep.pool.ready) == 1, 60, "the standby in the pool")
        # 4 -> 3 retires a middle rank: survivors 2 and 3 move to positions 1 and 2 and replay
        # captures taken at positions 100000 (the pool) and 3; the routing reads the position at replay.
        for i, (dp, retire) in enumerate(((2, None), (4, None), (3, [1]), (2, None))):
            op: dict = {}
            if i:
                op = await dep.scale(dp, retire=retire, timeout_s=120)
                assert op["state"] == "succeeded", (op.get("error"), op)
            results = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
            op_id = op.get("op_id", "")
            out.append(
                (
                    dp,
                    results,
                    _lock_events(dep, op_id) if op_id else {},
                    _capture_events(dep, op_id) if op_id else {},
                    dep.registry.violations(),
                    await _live_status(dep),
                    op_id,
                    list(dep.orch.members),
                )
            )
    return out


@pytest.mark.timeout(270)
def test_reuse_serves_2_4_3_2_with_no_capture_on_survivors_and_oracle_outputs():
    cfg = _cfg()
    reference = reference_generate(_cfg(), PROMPTS, MAX_TOKENS)
    path = run(_reuse_path(cfg), 240)
    assert [dp for dp, *_ in path] == [2, 4, 3, 2]
    assert path[2][7] == [0, 2, 3], "rank 1 retired from the middle"
    grown_in = path[1][6]  # the 2 -> 4 operation, which the joiners captured in (or took the pool's)
    made_in: dict[int, str] = {}
    for i, (dp, results, locks, captures, violations, live, op_id, members) in enumerate(path):
        assert all(not r.get("error") for r in results), results
        assert {r["rank"] for r in results} <= set(members)
        assert oracle_mismatch(list(enumerate(results)), reference) == "", f"at DP {dp}"
        assert violations == [], violations
        if i == 0:
            continue
        # Survivors captured nothing and said so; only joiners (ranks 2, 3 on 2 -> 4) captured, once:
        # the one adopted from the pool reports its pool pass, marked in_pool, and skipped the capture.
        joiners = {2, 3} if i == 1 else set()
        assert set(captures) == joiners
        if i == 1:
            pooled = {r for r, d in captures.items() if d.get("in_pool")}
            assert len(pooled) == 1 and captures[min(pooled)]["pool_capture_s"] > 0, captures
            assert captures[min(pooled)]["total_s"] == 0.0 and locks[min(pooled)]["capture_in_pool"]
            made_in = {0: "startup", 1: "startup", min(pooled): "pool", min(joiners - pooled): grown_in}
        assert set(locks) == set(members), locks  # every rank of the new world locked
        for rank, d in locks.items():
            assert d["capture_policy"] == "reuse"
            assert d["capture_passes"] == d["expected_passes"] == (1 if rank in joiners else 0)
            assert d["workspace_bytes"] == workspace_bytes(cfg, 4)
        # After the switch every rank replayed, per batch size and counted since the switch, the
        # captures it made before it (at start-up, in the pool or when it joined), none eagerly.
        for rank, st in live.items():
            assert st["switch_op"] == op_id, (rank, st["switch_op"], op_id)
            assert sum(st["replays_since_switch"].values()) > 0, (rank, st["switch_op"], st["replays_since_switch"])
            assert set(st["replays_since_switch"]) <= {str(c) for c in cfg.capture_sizes}
            assert st["eager_since_switch"] == {}, (rank, st["eager_since_switch"])
            assert set(st["captured_in"].values()) == {made_in[rank]}, (rank, st["captured_in"])


@pytest.mark.timeout(150)
@pytest.mark.harm("reuse_drops_captures")
def test_survivors_that_drop_their_captures_serve_eagerly_and_are_flagged():
    """``reuse_drops_captures``: survivors release their captures in the transition instead of
    keeping them. Outputs still equal the oracle and no capture pass is missing, so only the
    replay counts show it: no replay since the switch, eager fallbacks per batch size, and the
    registry's I4 flag for a size the config captures."""
    cfg = _cfg(faults=["reuse_drops_captures"])
    reference = reference_generate(_cfg(), PROMPTS, MAX_TOKENS)

    async def go() -> tuple[dict, list[dict], dict[int, dict], list]:
        async with LocalDeployment(cfg, "reusedrop", max_dp=4) as dep:
            await dep.start(2)
            op = await dep.scale(3, timeout_s=60)
            results = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
            live = await _live_status(dep)

            def eager_flags() -> list[dict]:
                found = [v for v in dep.registry.violations() if "served eagerly" in v["message"]]
                return found if {v["rank"] for v in found} >= {"0", "1"} else []

            flagged = await wait_until(eager_flags, 15, "the registry flagging both survivors' eager decode steps")
            return op, results, live, flagged

    op, results, live, flagged = run(go(), 140)
    assert op["state"] == "succeeded", op
    assert oracle_mismatch(list(enumerate(results)), reference) == ""
    for rank in (0, 1):  # the survivors
        assert live[rank]["replays_since_switch"] == {} and live[rank]["eager_since_switch"], live[rank]
    assert sum(live[2]["replays_since_switch"].values()) > 0  # the joiner captured and replays
    assert {v["rank"] for v in flagged} == {"0", "1"} and all(v["invariant"] == "I4" for v in flagged), flagged


@pytest.mark.timeout(200)
@pytest.mark.harm("reuse_sized_for_world")
def test_reuse_check_refuses_a_capture_sized_for_the_launch_world():
    cfg = _cfg(faults=["reuse_sized_for_world"])

    async def go() -> tuple[dict, list]:
        async with LocalDeployment(cfg, "reusebad", max_dp=4) as dep:
            await dep.start(2)
            op = await dep.scale(4, timeout_s=60)
            errors = [
                e.detail.get("error", "")
                for _, e in dep.registry.events
                if e.op_id == op.get("op_id") and e.phase == "lock" and e.outcome == "error"
            ]
            return op, errors

    op, errors = run(go(), 180)
    assert op["state"] != "succeeded", op
    assert any("reused capture refused" in m and "world of 2" in m for m in errors), (
        op.get("state"),
        op.get("error"),
        errors,
    )


def test_capture_memory_matches_the_model_bound():
    """eepctl's torch-free figure equals the bound the rank sizes its workspace by: the model's
    own ``moe_workspace_bound`` (the one the lock checks), not a copy of its buffer list."""
    import torch

    from engine_ext.capture_memory import policy_memory
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.model.model import MoEModel

    for dtype in ("float32", "float64"):
        for hidden, top_k in ((64, 2), (48, 3)):
            cfg = EngineConfig(dtype=dtype, hidden_size=hidden, top_k=top_k)
            model = MoEModel(cfg, build_layout(cfg.num_experts, cfg.slots_per_rank, 1), 0, torch.device("cpu"), 0)
            for w in (1, 2, 4, 8):
                assert workspace_bytes(cfg, w) == model.moe_workspace_bound(w), (dtype, hidden, top_k, w)
    mem = policy_memory(EngineConfig(capture_policy="reuse"), 2, 4)
    assert mem["held_bytes"] == mem["reuse_bytes"] > mem["recapture_bytes"] and mem["reuse_extra_bytes"] > 0


# ---- capture policy auto: the default ---------------------------------------------------------------
def test_auto_takes_reuse_only_where_its_workspace_leaves_every_request_slot_its_kv():
    """``auto`` (the default) resolves per deployment: reuse where the KV blocks left beside the
    workspace at max DP hold max_num_seqs requests of max_model_len, recapture one block short of
    that; the figure is the KV pool a reuse rank really holds. A policy given by name is kept, and
    `up` says which it runs, what it holds and the option that takes the other."""
    from eepctl.render_cost import capture_lines
    from engine_ext.capture_memory import auto_policy, size_captures, up_summary
    from tests.engine_helpers import OneRank

    need = 8 * 16  # max_num_seqs x the blocks of one max_model_len request (128 / block_size 8)
    blocks = next(n for n in range(100, 400) if auto_policy(EngineConfig(num_blocks=n), 4)["reuse_kv_blocks"] == need)
    for n, policy in ((blocks, "reuse"), (blocks - 1, "recapture")):
        cfg = EngineConfig(num_blocks=n)
        assert cfg.capture_policy == "auto"
        choice = size_captures(cfg, 4)
        assert choice is not None and choice["capture_policy"] == cfg.capture_policy == policy, (n, choice)
        assert cfg.capture_world == (4 if policy == "reuse" else 0)
        line = capture_lines(up_summary(cfg, 2, 4, choice))[0]
        assert line.startswith(f"  capture policy {policy} (auto)"), line
        assert (
            "`--capture-policy recapture` opts out" in line
            if policy == "reuse"
            else f"would leave {need - 1} KV blocks/rank where 8 requests of max_model_len 128 need {need}" in line
        )
    rank = OneRank(EngineConfig(num_blocks=blocks, capture_policy="reuse", capture_world=4))
    assert rank.engine.res.sched.blocks.total == need  # what auto counted is what the rank holds
    # `eepctl up`'s default model holds too few blocks for it: auto recaptures there.
    default = EngineConfig()
    assert size_captures(default, 8)["capture_policy"] == default.capture_policy == "recapture"
    named = EngineConfig(num_blocks=blocks, capture_policy="recapture")
    assert size_captures(named, 4) is None and named.capture_policy == "recapture"
    assert "(--capture-policy): every rank re-warms" in capture_lines(up_summary(named, 2, 4, None))[0]


@pytest.mark.timeout(150)
def test_under_the_default_policy_the_ranks_that_stay_neither_rewarm_nor_capture_in_a_scale():
    """A deployment with the engine's default policy (``auto``) and KV room for reuse's workspace:
    the 2 -> 3 scale's records show no warm-up and no capture pass on ranks 0 and 1 (the re-warm
    recapture ran inside the pause is gone), the joiner's one pass, and the oracle's tokens."""
    cfg = EngineConfig(dtype="float64", num_blocks=256)
    reference = reference_generate(EngineConfig(dtype="float64"), PROMPTS, MAX_TOKENS)

    async def go() -> tuple[dict, list[dict], list[dict], list]:
        async with LocalDeployment(cfg, "autodefault", max_dp=3) as dep:
            await dep.start(2)
            op = await dep.scale(3, timeout_s=60)
            results = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
            events = await wait_until(
                lambda: (lambda evs: evs if {e["rank"] for e in evs if e["phase"] == "lock"} == {0, 1, 2} else None)(
                    dep.registry.events_for(op["op_id"])
                ),
                15,
                "the lock events of every rank",
            )
            return op, results, events, dep.registry.violations()

    op, results, events, violations = run(go(), 140)
    assert op["state"] == "succeeded", op
    assert violations == [], violations  # the registry expects the zero passes of the policy auto chose (I4)
    by_phase = {ph: {e["rank"] for e in events if e["phase"] == ph and e["rank"] >= 0} for ph in ("warm", "capture")}
    assert by_phase == {"warm": {2}, "capture": {2}}, by_phase  # the joiner only
    assert op["captures_per_rank"] == {"0": 0, "1": 0, "2": 1}, op["captures_per_rank"]
    locks = {e["rank"]: e["detail"] for e in events if e["phase"] == "lock"}
    assert all(locks[r]["capture_policy"] == "reuse" and locks[r]["capture_passes"] == 0 for r in (0, 1)), locks
    assert cfg.capture_policy == "reuse"  # what auto resolved to
    assert oracle_mismatch(list(enumerate(results)), reference) == ""


def test_without_capture_sizes_the_rank_that_stays_under_reuse_makes_no_capture_pass():
    """With no capture sizes configured (benchmarks/curves.py's bytes curve) no rank holds a capture,
    so holding none cannot tell a joiner: the rank that locked a world keeps it and makes no pass (what
    the registry's I4 check expects of it), a joiner, whose workspace was never locked, sizes it and
    makes its one pass."""
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.rank.engine import RankEngine
    from tests.engine_helpers import OneRank

    cfg = EngineConfig(capture_policy="reuse", capture_world=2, capture_sizes=[])
    stays = OneRank(cfg).engine
    stays.res.graphs.begin_operation("op-1")
    assert stays.warm_and_capture("op-1")["captures_this_op"] == 0
    joiner = RankEngine(cfg, "joiner", 0, build_layout(8, cfg.slots_per_rank, 1), joining=True)
    joiner.res.graphs.begin_operation("op-1")
    assert not joiner.res.workspace.locked
    assert joiner.warm_and_capture("op-1")["captures_this_op"] == 1 and joiner.res.workspace.locked
