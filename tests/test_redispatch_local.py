"""Joiners take the queue (engine_ext/control/redispatch.py). On real rank processes (the process
launcher, real gloo, real requests): a backlog queued on DP 1 (one request slot: all requests but one
wait), scaled 1 -> 3; the old rank gives back its waiting requests beyond the fair share, the
joiners serve them, every output equals the dense oracle and every request is answered exactly
once, also when rank 0's answer to the give-back comes late (``hold:give_back``). On one rank: the
give-back takes the rank's lock, so a request is given back or run, never both."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import pytest

from engine_ext.config import EngineConfig
from engine_ext.control.redispatch import fair_share
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate
from tests.engine_helpers import oracle_mismatch, run, wait_until

DISTINCT = [[7], [1, 2, 3], [200, 13, 99, 5, 5], [(11 * j + 3) % 256 for j in range(9)]]
PROMPTS = DISTINCT * 5  # a backlog of 20 requests; the oracle runs the 4 distinct prompts once each
MAX_TOKENS = 32
# Rank 0 stops at its first decode step for this long (``hold:step@0``) while the scale launches
# and prepares the joiners, so the backlog is still queued when the scale commits however fast
# this box serves; the commit waits for the hold to end.
HOLD_S = 2.0


def test_fair_share_spreads_the_old_ranks_waiting_over_the_new_width() -> None:
    assert fair_share({0: 10}, 3) == 4  # rank 0 keeps 4, gives back 6: 4 + 3 + 3
    assert fair_share({0: 7, 1: 5}, 4) == 3
    assert fair_share({0: 0, 1: 0}, 3) == 0
    assert fair_share({0: 2}, 3) == 1


def test_give_back_takes_the_rank_lock_so_a_request_is_given_back_or_run_never_both() -> None:
    """The step loop takes waiting requests into prefill (``Scheduler.schedule``) under the rank's
    lock; this test holds that lock and schedules, as the step thread does, while a give-back waits
    for it. The give-back must then hand back exactly the requests still waiting: read outside
    the lock it would hand back requests the step loop was taking into prefill."""
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.rank.engine import RankEngine
    from engine_ext.records import RankState

    rank = RankEngine(EngineConfig(max_num_seqs=2, capture_sizes=[1, 2]), "giveback", 0, build_layout(8, 8, 1))
    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        rank.add_request({"request_id": rid, "prompt": [1, 2, 3], "max_tokens": 4})
    assert rank.give_back_waiting(0) == [], "a rank that is not serving gives back nothing"
    rank.shared.state = RankState.SERVING
    given: list[list[dict[str, Any]]] = []
    with rank.shared.lock:  # the step loop's scheduling section
        t = threading.Thread(target=lambda: given.append(rank.give_back_waiting(1)))
        t.start()
        t.join(0.3)  # the give-back arrives meanwhile and waits for the lock
        assert not given, "the give-back did not wait for the lock the step loop schedules under"
        running = [it.request.request_id for it in rank.res.sched.schedule()]
    t.join(10)
    back = [w["request_id"] for w in given[0]]
    waiting = [r.request_id for r in rank.res.sched.waiting]
    assert running == ["r0", "r1"] and waiting == ["r2"] and back == ["r3", "r4"], (running, waiting, back)
    assert all(w["output"] == [] for w in given[0])
    assert rank.status()["requests_waiting"] == 1 and rank.status()["requests_running"] == 2


async def _scenario(cfg: EngineConfig, answer_wait_s: float = 120) -> tuple[dict, list[dict], Counter, dict[str, int]]:
    async with LocalDeployment(cfg, "redispatch", max_dp=3) as dep:
        await dep.start(1)
        router = dep.orch.router
        answers: Counter = Counter()  # every result a rank sent, by request id
        deliver = router.on_results

        def counted(results: list[dict], rank: int | None = None) -> None:
            answers.update(r["request_id"] for r in results)
            deliver(results, rank)

        router.on_results = counted  # type: ignore[method-assign]
        pending = [asyncio.ensure_future(dep.generate(p, MAX_TOKENS)) for p in PROMPTS]
        await wait_until(lambda: router.inflight.get(0) == len(PROMPTS), 30, "every request admitted to rank 0")
        op = await dep.scale(3, timeout_s=120)
        done, _ = await asyncio.wait(pending, timeout=answer_wait_s)
        served = [p.result() if p in done else {"rank": None, "unanswered": True} for p in pending]
        return op, served, answers, {"completed": router.completed, "stale": router.stale_dropped}


@pytest.mark.timeout(240)
def test_joiners_take_the_backlog_queued_on_the_old_rank() -> None:
    """Rank 0 answers the give-back HOLD_S late: its requests were already out of its queue, and the
    re-dispatch waits for the answer however late (the next test bounds the wait and loses them)."""
    cfg = EngineConfig(
        dtype="float64",
        max_num_seqs=1,
        capture_sizes=[1],
        capture_policy="recapture",
        faults=["hold:step@0", "hold:give_back@0"],  # rank 0 answers the give-back HOLD_S late
        fault_delay_s=HOLD_S,
    )
    op, served, answers, counts = run(_scenario(cfg), 200)
    assert op["state"] == "succeeded", op
    # Every request was admitted to rank 0 before the scale: a joiner serves one only if rank 0 gave it back.
    by_rank = Counter(r["rank"] for r in served)
    joiners = by_rank[1] + by_rank[2]
    assert joiners > 0, f"the joiners served none of rank 0's backlog: {dict(by_rank)}"
    assert 0 < op["redispatched_requests"] and joiners <= op["redispatched_requests"], (
        op["redispatched_requests"],
        dict(by_rank),
    )
    pairs = [(i % len(DISTINCT), res) for i, res in enumerate(served)]
    assert oracle_mismatch(pairs, reference_generate(cfg, DISTINCT, MAX_TOKENS)) == ""
    assert sorted(answers.values()) == [1] * len(PROMPTS), f"answered more than once: {answers.most_common(3)}"
    assert set(answers) == {r["request_id"] for r in served}
    assert counts == {"completed": len(PROMPTS), "stale": 0}, counts
    from eepctl.render_events import events_text

    line = f"{op['op_id']}: {op['redispatched_requests']} request(s) waiting on the old ranks re-dispatched"
    assert line in events_text({"operations": [op]}, width=200), "eepctl events does not say what moved"
    from engine_ext.ray.autoscale_host import scale_outcome

    said = f"{op['op_id']} DP 1 -> 3, {op['redispatched_requests']} waiting request(s) re-dispatched"
    assert scale_outcome(op).startswith(said), "an autoscaler's decision record would not say it"
    print(
        f"\n[redispatch] {op['op_id']}: {op['redispatched_requests']} re-dispatched; served per rank "
        f"{dict(sorted(by_rank.items()))}; phases {op['phase_durations']}"
    )


@pytest.mark.timeout(240)
def test_a_bounded_wait_for_a_late_give_back_leaves_its_requests_unanswered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harm the unbounded wait prevents: with the give-back's answer given up on after 0.5 s
    (rank 0 answers HOLD_S late), the requests rank 0 took out of its queue are answered by nobody."""
    from engine_ext.control import redispatch

    monkeypatch.setattr(redispatch, "GIVE_BACK_TIMEOUT_S", 0.5)
    cfg = EngineConfig(
        dtype="float64",
        max_num_seqs=1,
        capture_sizes=[1],
        capture_policy="recapture",
        faults=["hold:step@0", "hold:give_back@0"],
        fault_delay_s=HOLD_S,
    )
    op, served, _, _ = run(_scenario(cfg, answer_wait_s=30), 200)
    assert op["state"] == "succeeded" and op["redispatched_requests"] == 0, op
    lost = [r for r in served if r.get("unanswered")]
    assert lost, "every request was answered although the give-back's answer was given up on"
    print(f"\n[redispatch] bounded wait: {len(lost)} of {len(served)} requests never answered")


def test_an_ingress_sends_on_a_late_give_back_only_for_requests_still_routed_to_that_rank() -> None:
    """On Ray a rank's give-back goes to the ingress that owns each request (IngressLink.resubmit_from).
    The ingress's real router re-routed the request meanwhile (its rank fenced: the request waited
    and then went to rank 2); the rank's late answer must not send it a second time. The ranks are
    recording clients (no process: what is checked is what the router sends them); the ingress is
    its actor class without Ray (its state as the constructor makes it)."""
    from engine_ext.control.rank_client import RankClient
    from engine_ext.control.router import Router
    from engine_ext.ray.ingress import Ingress
    from engine_ext.ray.names import request_prefix

    class Recording(RankClient):
        def __init__(self, rank: int) -> None:
            self.rank, self.sent = rank, []

        async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
            if method == "add_request":
                self.sent.append(args[0]["request_id"])

        async def kill(self) -> None:
            return None

        def pid(self) -> int:
            return 0

    async def scenario(from_rank: int | None) -> tuple[dict[str, int], list[str]]:
        ing = Ingress.__new__(Ingress)
        ing.index, ing.incarnation, ing.router = 0, "i1", Router()
        ing.handed_back = {"resubmitted": 0, "dropped": 0}
        old, new = Recording(1), Recording(2)
        ing.router.set_ranks({1: old})
        rid = f"{request_prefix(0)}i1-7"
        pending = asyncio.ensure_future(ing.router.submit([5, 6, 7], 4, request_id=rid))
        while not old.sent:
            await asyncio.sleep(0)
        given = {"request_id": rid, "prompt": [5, 6, 7], "max_tokens": 4}  # what rank 1 took out of its queue
        ing.router.set_ranks({1: old, 2: new})
        ing.router.exclude(1)
        ing.router.reroute({1})  # rank 1 fenced while its answer was on its way
        await ing.router.retry_parked()
        answer = await ing.resubmit([given], from_rank)  # the late give-back reaches the ingress
        pending.cancel()
        return answer, new.sent

    answer, sent = asyncio.run(scenario(1))
    assert answer == {"resubmitted": 0, "dropped": 1} and len(sent) == 1, (answer, sent)
    answer, sent = asyncio.run(scenario(None))  # without the owner's check: sent twice
    assert answer["resubmitted"] == 1 and len(sent) == 2, (answer, sent)
