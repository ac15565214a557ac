"""Every mechanism is load-bearing and every check can fire: for each, a broken variant shows
the harm (wrong tokens against the dense oracle, or a failed operation) and the check catches it.

One rank in this process (tests.engine_helpers.OneRank) for the step-level mechanisms; a real
process deployment (LocalDeployment) where the world must change size."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from engine_ext.config import EngineConfig
from engine_ext.control.registry_state import RegistryState
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from engine_ext.rank.warmup import WarmupIsolationError
from tests.engine_helpers import OneRank, oracle_mismatch, run, wait_until

PROMPTS = [[7, 3], [1, 2, 3], [200, 13, 99, 5, 5], [(97 * j + 41) % 256 for j in range(20)]]
MAX_TOKENS = 10


def _cfg(*faults: str) -> EngineConfig:
    return EngineConfig(dtype="float64", slots_per_rank=8, faults=list(faults), capture_policy="recapture")


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return reference_generate(_cfg(), PROMPTS, MAX_TOKENS)


def _mismatch(o: OneRank, reference: list[dict]) -> str:
    return oracle_mismatch(list(enumerate(o.outputs(len(PROMPTS)))), reference)


def _registry_of(o: OneRank) -> RegistryState:
    """A registry fed with this rank's status and events, as the launcher feeds it."""
    reg = RegistryState("one")
    reg.report_status(o.engine.status())
    for ev in o.engine.recent_events():
        reg.report_event(ev)
    return reg


# ---- graph release (I3): replays read the buffers they captured ---------------------------------
def _relayout(o: OneRank) -> None:
    """An expert re-layout of the one rank, as a transition commits it: experts move between slots
    (weights written in place), the routing table is replaced, then the rank re-warms."""
    e = o.engine
    old = e.model.layout
    new = ExpertLayout(old.num_logical, old.slots_per_rank, 1, tuple(reversed(old.phys_to_logical)))
    vecs = {old.phys_to_logical[s]: e.model.expert_vector(s).clone() for s in range(old.num_physical)}
    for s, logical in enumerate(new.phys_to_logical):
        e.model.load_expert_vector(s, vecs[logical])
    e.model.set_layout(new, 0)
    e.eplb.update_layout(new)
    e.graphs.begin_operation()
    e.warm_and_capture("op-relayout")


def _decode_across_relayout(cfg: EngineConfig) -> OneRank:
    o = OneRank(cfg)
    o.add(PROMPTS, MAX_TOKENS)
    o.steps(3)  # prefill, then decodes through captured steps
    assert o.engine.graphs.stats.replays > 0
    _relayout(o)
    o.steps()
    return o


@pytest.mark.harm("skip_release", "no_stale_check")
def test_stale_replay_without_the_check_gives_wrong_tokens(reference):
    """Harm: the kept capture replays with the routing table it was captured with, against weights
    that moved: the tokens differ from the oracle."""
    o = _decode_across_relayout(_cfg("skip_release", "no_stale_check"))
    assert o.engine.graphs.stats.replays > 3
    assert o.engine.stale_replays_refused == 0
    assert "tokens" in _mismatch(o, reference)


@pytest.mark.harm("skip_release")
def test_stale_replay_is_refused_flagged_and_outputs_stay_right(reference):
    o = _decode_across_relayout(_cfg("skip_release"))
    assert o.engine.stale_replays_refused > 0
    assert _mismatch(o, reference) == ""
    reg = _registry_of(o)
    assert [v["invariant"] for v in reg.violations() if v["invariant"] == "I3"] == ["I3"]
    # skip_release also made no capture pass in the re-layout: the registry counts 0 (I4).
    assert any(v["invariant"] == "I4" and "0 capture passes" in v["message"] for v in reg.violations())


def test_relayout_with_release_and_recapture_is_exact(reference):
    o = _decode_across_relayout(_cfg("no_stale_check"))
    assert o.engine.stale_replays_refused == 0
    assert _mismatch(o, reference) == ""
    assert [v for v in _registry_of(o).violations()] == []


# ---- request-state isolation (I5): the warm-up must not touch live slots or KV ------------------
def _warm_mid_decode(cfg: EngineConfig) -> OneRank:
    o = OneRank(cfg)
    o.add(PROMPTS, MAX_TOKENS)
    o.steps(3)
    o.engine.graphs.begin_operation()
    o.engine.warm_and_capture("op-warm")
    o.steps()
    return o


@pytest.mark.harm("warmup_not_isolated", "no_warmup_check")
def test_warmup_not_isolated_corrupts_live_requests(reference):
    o = _warm_mid_decode(_cfg("warmup_not_isolated", "no_warmup_check"))
    assert "tokens" in _mismatch(o, reference)
    warm = [ev for ev in o.engine.recent_events() if ev["op_id"] == "op-warm" and ev["phase"] == "warm"][0]
    assert warm["detail"]["slots_restored"] is False and warm["detail"]["live_kv_unchanged"] is False
    assert any(v["invariant"] == "I5" for v in _registry_of(o).violations())


@pytest.mark.harm("warmup_not_isolated")
def test_warmup_isolation_check_fails_the_warmup_before_serving(reference):
    o = OneRank(_cfg("warmup_not_isolated"))
    o.add(PROMPTS, MAX_TOKENS)
    o.steps(3)
    with pytest.raises(WarmupIsolationError, match="live_kv_unchanged") as ei:
        o.engine.warm_and_capture("op-warm")
    assert "checksum" in str(ei.value)
    assert not o.engine.workspace.locked, "a failed warm-up must not lock the workspace and resume"
    warm = [ev for ev in o.engine.recent_events() if ev["phase"] == "warm"][-1]
    assert warm["outcome"] == "error"
    assert any(v["invariant"] == "I5" for v in _registry_of(o).violations())


def test_isolated_warmup_mid_decode_is_exact(reference):
    o = _warm_mid_decode(_cfg())
    assert _mismatch(o, reference) == ""
    warm = [ev for ev in o.engine.recent_events() if ev["op_id"] == "op-warm" and ev["phase"] == "warm"][0]
    assert warm["detail"]["live_kv_checksum"] != "empty", "requests held live KV during the warm-up"
    assert _registry_of(o).violations() == []


# ---- EPLB statistics: recorded in the forward pass, suppressed in warm-up -----------------------
def _load_after_one_request(*faults: str) -> float:
    cfg = _cfg(*faults)
    o = OneRank(cfg)
    o.add([PROMPTS[2]], 1)
    o.steps()
    return sum(o.engine.eplb.logical_load)


@pytest.mark.harm("eplb_not_suppressed", "no_warmup_check")
def test_eplb_load_without_suppression_counts_the_warmup():
    cfg = _cfg()
    per_token = cfg.top_k * cfg.num_layers
    assert _load_after_one_request() == len(PROMPTS[2]) * per_token
    polluted = _load_after_one_request("eplb_not_suppressed", "no_warmup_check")
    assert polluted == (len(PROMPTS[2]) + cfg.max_num_tokens) * per_token


@pytest.mark.harm("eplb_not_suppressed")
def test_eplb_pollution_fails_the_warmup():
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.rank.engine import RankEngine

    e = RankEngine(_cfg("eplb_not_suppressed"), "one", 0, build_layout(8, 8, 1))
    with pytest.raises(WarmupIsolationError, match="eplb_unchanged"):
        e.warm_and_capture("startup")


# ---- workspace re-warm (I4): right-sized in both directions; bytes go to the KV pool ------------
async def _resize(cfg: EngineConfig, sizes: list[int]) -> list[tuple[dict, list[dict]]]:
    out = []
    async with LocalDeployment(cfg, "ws", max_dp=4) as dep:
        await dep.start(sizes[0])
        for dp in sizes[1:]:
            op = await dep.scale(dp, timeout_s=120)

            def beaten(op: dict = op) -> list[dict]:  # every rank's heartbeat since op ended: its kv_blocks_total
                views = [v for v in dep.registry.rank_views() if v["state"] != "removed"]
                return views if all(v["last_heartbeat"] > op["finished"] for v in views) else []

            out.append((op, await wait_until(beaten, 10, "a heartbeat from every rank after the scale")))
            if op["state"] != "succeeded":
                break
    return out


@pytest.mark.timeout(200)
def test_workspace_follows_the_world_both_ways_and_feeds_the_kv_pool():
    (up, at3), (down, at2) = run(_resize(_cfg(), [2, 3, 2]), 180)
    assert up["state"] == down["state"] == "succeeded", (up, down)
    for r in ("0", "1"):
        assert up["workspace_after"][r] > up["workspace_before"][r]
        assert down["workspace_after"][r] < down["workspace_before"][r], "scale-down must shrink the workspace"
    blocks3 = {v["rank"]: v["kv_blocks_total"] for v in at3}
    blocks2 = {v["rank"]: v["kv_blocks_total"] for v in at2}
    assert all(blocks2[r] > blocks3[r] for r in (0, 1)), (blocks3, blocks2)
    for v in at2 + at3:
        assert v["workspace_bytes"] == v["workspace_required_bytes"] and v["workspace_locked"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sizes", [[2, 3], [3, 2]], ids=["scale_up", "scale_down"])
@pytest.mark.harm("skip_rewarm")
def test_skip_rewarm_fails_the_operation_at_the_lock(sizes):
    [(op, _)] = run(_resize(_cfg("skip_rewarm"), sizes), 180)
    assert op["state"] == "failed", op
    assert "WorkspaceSizeError" in op["error"] and "bytes" in op["error"], op["error"]
    word = "too small for" if sizes[1] > sizes[0] else "larger than"
    assert word in op["error"], op["error"]


@pytest.mark.timeout(200)
@pytest.mark.harm("skip_rewarm", "no_lock_check")
def test_skip_rewarm_without_the_lock_check_keeps_freed_bytes_from_the_kv_pool():
    """Harm: after 3 -> 2 the workspace still holds the 3-rank bound, so the KV blocks the smaller
    world frees never reach the pool. Only the lock's size check catches it (the test below)."""
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.rank.engine import RankEngine

    [(op, views)] = run(_resize(_cfg("skip_rewarm", "no_lock_check"), [3, 2]), 180)
    assert op["state"] == "succeeded", op
    probe = RankEngine(_cfg(), "probe", 0, build_layout(8, 8, 1))
    right = probe.warmup.kv_pool_blocks(probe.model.moe_workspace_bound(2))
    for v in views:
        assert v["workspace_bytes"] > v["workspace_required_bytes"], v
        assert v["kv_blocks_total"] < right, (v["kv_blocks_total"], right)


def test_workspace_bound_shrinks_with_the_world():
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.model.model import MoEModel

    m = MoEModel(_cfg(), build_layout(8, 8, 1), 0, torch.device("cpu"), 0)
    bounds = [m.moe_workspace_bound(w) for w in (1, 2, 3, 4)]
    assert bounds == sorted(bounds) and len(set(bounds)) == 4


# ---- communicator prep (I2): the EPLB communicator before the weight transfer -------------------
async def _scale_up_and_serve(cfg: EngineConfig) -> tuple[dict, list[dict], list[dict], set[int]]:
    """The scale 2 -> 3, requests after it, the registry's violations, and the ranks whose last
    event of the scale arrived (its lock; a scale that failed in prepare ends at the transfer).
    A failed prepare rolls back at the first rank's failure (``World.call_all``) and stops the
    joiner, which may not have reached its transfer by then (1 run in 8 on the 2-core box): the
    members always report theirs; the joiner's is waited for a moment."""
    async with LocalDeployment(cfg, "comm", max_dp=4) as dep:
        await dep.start(2)
        op = await dep.scale(3, timeout_s=120)
        results = await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS * 2))
        # The I2 check reads the ranks' events of the scale: wait until their last event arrived.
        last = "lock" if op["state"] == "succeeded" else "transfer"
        reported = lambda: {e.rank for _, e in dep.registry.events if e.op_id == op["op_id"] and e.phase == last}  # noqa: E731
        need = {0, 1, 2} if op["state"] == "succeeded" else {0, 1}
        await wait_until(lambda: reported() >= need, 10, "the ranks' events of the scale")
        with contextlib.suppress(AssertionError):
            await wait_until(lambda: 2 in reported(), 2, "the joiner's transfer")
        return op, list(results), dep.registry.violations(), reported()


@pytest.mark.timeout(200)
@pytest.mark.harm("late_eplb_comm")
def test_late_eplb_communicator_fails_the_scale_and_is_flagged(reference):
    """Harm: the transfer runs before the communicator exists, so it has no channel and the
    scale fails (rolled back; the old world serves on). The registry sees each rank's transfer
    reported before its communicator, in the order it received them (I2)."""
    op, results, violations, reported = run(_scale_up_and_serve(_cfg("late_eplb_comm")), 180)
    assert op["state"] == "rolled_back", op
    assert "eplb_comm" in op["error"] or "NoneType" in op["error"], op["error"]
    assert {r["rank"] for r in results} <= {0, 1}
    assert oracle_mismatch([(i % len(PROMPTS), r) for i, r in enumerate(results)], reference) == ""
    i2 = [v for v in violations if v["invariant"] == "I2"]
    # the check fires on every rank whose transfer arrived: both members, the joiner if it got there
    assert {v["rank"] for v in i2} == {str(r) for r in reported} >= {"0", "1"}, (violations, reported)


@pytest.mark.timeout(200)
def test_prepared_eplb_communicator_serves_right_on_the_joiner(reference):
    op, results, violations, _ = run(_scale_up_and_serve(_cfg()), 180)
    assert op["state"] == "succeeded", op
    assert 2 in {r["rank"] for r in results}
    assert oracle_mismatch(list((i % len(PROMPTS), r) for i, r in enumerate(results)), reference) == ""
    assert violations == []


# ---- suffixed identities (I1) ------------------------------------------------------------------
async def _start_and_view(cfg: EngineConfig, dp: int) -> tuple[list[dict], list[dict]]:
    async with LocalDeployment(cfg, "ids", max_dp=dp) as dep:
        await dep.start(dp)
        # Every rank reported, listed or refused (a second claim of one identity is refused).
        await wait_until(
            lambda: len(dep.registry.rank_views()) + len(dep.registry.rejected) >= dp, 10, "a status from every rank"
        )
        return dep.registry.rank_views(), dep.registry.violations()


@pytest.mark.timeout(120)
@pytest.mark.harm("no_suffix")
def test_unsuffixed_identities_lose_a_rank_from_the_deployment_and_are_flagged():
    views, violations = run(_start_and_view(_cfg("no_suffix"), 2), 100)
    assert [v["rank"] for v in views] == [0], "the second rank claiming the same identity was refused"
    assert any(v["invariant"] == "I1" and "duplicate identity" in v["message"] for v in violations), violations


@pytest.mark.timeout(120)
@pytest.mark.harm("double_suffix")
def test_double_suffix_is_flagged_and_suffixed_identities_are_clean():
    views, violations = run(_start_and_view(_cfg("double_suffix"), 2), 100)
    assert sorted(v["rank"] for v in violations if v["invariant"] == "I1") == ["0", "0", "1", "1"], violations
    views, violations = run(_start_and_view(_cfg(), 2), 100)
    assert [v["rank"] for v in views] == [0, 1] and violations == []


@pytest.mark.harm("double_capture")
def test_double_capture_is_flagged_from_the_capture_events_and_replays_stay_right(reference):
    """Upstream before its fix captured twice per transition. The registry counts the passes from
    the capture events each pass sends (not from the rank's own tally) and flags every operation."""
    o = _decode_across_relayout(_cfg("double_capture"))
    assert _mismatch(o, reference) == ""  # the second pass wastes time and memory; tokens stay right
    found = [v for v in _registry_of(o).violations() if v["invariant"] == "I4"]
    assert len(found) == 2 and all("2 capture passes" in v["message"] for v in found), found
    assert {v["message"].split(" operation ")[1].split(" ")[0] for v in found} == {"startup", "op-relayout"}
