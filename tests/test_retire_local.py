"""Which ranks a scale-down removes (engine_ext/control/scale_plan.choose_leaving), on real rank
processes (the process launcher, real gloo, DP 4 -> 3): the default dry run picks the emptiest rank, not the
last; ``retire`` moves exactly the named ranks out and the rest serve the oracle's tokens."""

from __future__ import annotations

import pytest

from engine_ext.config import EngineConfig
from engine_ext.control.scale_plan import choose_leaving
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from engine_ext.protocol import PreconditionError, UsageError
from tests.engine_helpers import oracle_mismatch, run

PROMPTS = [[7], [1, 2, 3], [200, 13, 99, 5, 5], [(11 * j + 3) % 256 for j in range(9)]]
MAX_TOKENS = 5


def test_choose_leaving_rules() -> None:
    load = {0: (0.0, 0.0), 1: (5.0, 40.0), 2: (0.0, 8.0), 3: (0.0, 8.0), 5: (2.0, 0.0)}
    members = [0, 1, 2, 3, 5]
    assert choose_leaving(members, 3, load, keep=0) == [2, 3]  # fewest requests, then least KV; 0 keeps the store
    assert choose_leaving(members, 4, {}, keep=0) == [5], "idle: the last rank leaves, as before"
    assert choose_leaving(members, 3, load, retire=[5, 1], keep=0) == [1, 5]
    for retire, msg in (([1], "names 1 rank"), ([1, 4], "not members"), ([0, 1], "hosts the deployment's rendezvous")):
        with pytest.raises(ValueError, match=msg):
            choose_leaving(members, 3, load, retire=retire, keep=0)
    # capture policy reuse no longer restricts who leaves (captures read the position at replay;
    # tests/test_capture_reuse.py retires a middle rank and checks the oracle's tokens).


async def _scenario(cfg: EngineConfig) -> tuple[dict, dict, list[dict], list[int]]:
    async with LocalDeployment(cfg, "retire", max_dp=4) as dep:
        await dep.start(4)
        busy = dep.orch.clients[3]  # work straight onto rank 3: the old rule (the last rank leaves) would move it
        for i in range(16):
            await busy.add_request(
                {"request_id": f"busy-{i}", "prompt": [(5 * i + j) % 256 for j in range(20)], "max_tokens": 100},
                timeout=30,
            )
        plan = (await dep.orch.plan(3)).to_dict()
        with pytest.raises(PreconditionError, match="hosts the deployment's rendezvous store"):
            await dep.orch.plan(3, retire=[0])
        with pytest.raises(PreconditionError, match="names 2 rank"):
            await dep.orch.plan(3, retire=[1, 2])
        with pytest.raises(UsageError, match="is for a scale-down"):
            await dep.orch.plan(4, retire=[1])
        op = await dep.scale(3, retire=[1], timeout_s=120)  # neither the emptiest (2) nor the last (3)
        results = [await dep.generate(p, MAX_TOKENS) for p in PROMPTS]
        return plan, op, results, list(dep.orch.members)


@pytest.mark.timeout(240)
def test_default_picks_the_emptiest_and_retire_moves_exactly_the_named() -> None:
    cfg = EngineConfig(dtype="float64")
    plan, op, results, members = run(_scenario(cfg), 200)
    # 1 and 2 idle, 3 busy, 0 hosts the store: the idle tie goes to the higher number
    assert [(j["rank"], j["chosen_by"]) for j in plan["leaving"]] == [(2, "least work")], plan["leaving"]
    assert plan["leaving"][0]["requests"] == 0
    assert op["state"] == "succeeded", op
    assert [(j["rank"], j["chosen_by"]) for j in op["plan"]["leaving"]] == [(1, "--retire")]
    assert members == [0, 2, 3]
    assert {r["rank"] for r in results} <= {0, 2, 3}
    assert oracle_mismatch(list(enumerate(results)), reference_generate(cfg, PROMPTS, MAX_TOKENS)) == ""


def test_a_request_racing_a_removal_is_handed_back_or_refused_never_kept() -> None:
    """A request that reaches a removing rank while its commit hands its requests back: the commit
    turns the rank REMOVING and exports its scheduler under the rank's lock (here this test holds
    the lock and does both, as ``RankTransition.request_commit`` and the removing commit do). The
    request must then be refused (the router sends it elsewhere). Read outside that lock, the state
    said DRAINING, the request was queued after the hand-back and never answered."""
    import threading

    from engine_ext.elastic.eplb import build_layout
    from engine_ext.errors import RankRefused
    from engine_ext.rank.engine import RankEngine
    from engine_ext.records import RankState

    rank = RankEngine(EngineConfig(), "race", 0, build_layout(8, 8, 1))
    shared = rank.shared
    shared.state = RankState.DRAINING  # still takes requests: what it holds moves at its commit
    out: list[BaseException | None] = []

    def submit() -> None:
        try:
            rank.add_request({"request_id": "late", "prompt": [1, 2], "max_tokens": 3})
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - the refusal is the expected outcome
            out.append(e)

    with shared.lock:  # the removing commit's critical section
        t = threading.Thread(target=submit)
        t.start()
        t.join(0.3)  # the request arrives meanwhile and waits for the lock
        shared.state = RankState.REMOVING
        handed_back = rank.res.sched.export_all()
    t.join(10)
    assert handed_back == []
    assert len(out) == 1 and isinstance(out[0], RankRefused), out
    assert not rank.res.sched.has_work, "a request was queued after the hand-back: nobody would answer it"
