"""The control plane's pure parts, without processes: epoch fencing (what a fenced rank sends
never counts; a new rank given its number does), health from signs of life, the router's
bounded wait for a world, and the status lines. The same parts run for real in
tests/test_control_plane_ray.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from eepctl.render_control import control_lines
from engine_ext.control.health import Health
from engine_ext.control.rank_client import RankClient
from engine_ext.control.registry_state import RegistryState
from engine_ext.control.router import Router
from engine_ext.control.world import World
from engine_ext.elastic.eplb import build_layout


class _Answers(RankClient):
    """A rank client whose answers a test sets (a real process cannot hang on cue here)."""

    def __init__(self, rank: int, answer: Any) -> None:
        self.rank, self.answer = rank, answer

    async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def kill(self) -> None:
        return None

    def pid(self) -> int:
        return 0


def test_a_fenced_rank_is_never_heard_again_but_a_new_rank_with_its_number_is() -> None:
    w = World("t")
    layout = build_layout(8, 8, 2)
    w.adopt({0: _Answers(0, {}), 1: _Answers(1, {})}, layout, epoch=3)
    assert w.accepts(1, 3)
    assert w.fence(1, "silent") == 3
    assert not w.accepts(1, 3) and not w.accepts(1, 2)  # its world and older ones
    assert w.accepts(0, 3)  # a survivor's messages of the same world still count
    assert w.accepts(1, 4)  # a joiner that took number 1 in a newer world


def test_a_fence_is_an_event_the_registry_keeps() -> None:
    """`eepctl events` lists every fence: the event the orchestrator emits passes the registry's
    intake (a typed Event). No spawner: a fence launches nothing."""
    from engine_ext.config import EngineConfig
    from engine_ext.control.orchestrator import Orchestrator

    reg = RegistryState("t")
    o = Orchestrator("t", EngineConfig(), None, max_dp=2, emit=reg.report_event)  # type: ignore[arg-type]
    o.world.adopt({0: _Answers(0, {}), 1: _Answers(1, {})}, build_layout(8, 8, 2), epoch=3)
    asyncio.run(o.fence(1, "silent for 6.0s"))
    [ev] = reg.events_for()
    assert (ev["rank"], ev["phase"], ev["op_id"], ev["detail"]) == (
        1,
        "fence",
        "",
        {"epoch": 3, "reason": "silent for 6.0s"},
    )


def test_health_fences_on_silence_and_on_a_reported_failure_not_on_an_answer() -> None:
    """Silence is no probe answer and no token or result an ingress took; a fenced world's answer is none."""
    w = World("t")
    w.adopt(
        {
            0: _Answers(0, {"state": "serving", "epoch": 1}),
            1: _Answers(1, TimeoutError()),
            2: _Answers(2, {"state": "failed", "state_reason": "out of memory", "epoch": 1}),
        },
        build_layout(8, 8, 3),
        epoch=1,
    )
    h = Health(w, deadline_s=0.3)
    asyncio.run(h.probe([0, 1, 2]))
    assert h.unhealthy([0, 1, 2]) == {2: "reported failed: out of memory"}  # silence not yet past the deadline
    time.sleep(0.35)
    asyncio.run(h.probe([0, 1, 2]))
    bad = h.unhealthy([0, 1, 2])
    assert set(bad) == {1, 2} and bad[1].startswith("silent for") and "deadline 0.3s" in bad[1], bad
    h.heard(1, time.time())  # an ingress took its tokens (issue 33: they never reach the controller)
    assert set(h.unhealthy([0, 1, 2])) == {2}
    h.forget(1)
    h.heard(1, time.time())  # a departed (fenced) rank's tokens watch nothing
    assert 1 not in h.last_seen
    w.fence(0, "test")  # an answer from a fenced world is no sign of life
    time.sleep(0.35)
    asyncio.run(h.probe([0]))
    assert "fenced epoch" in h.unhealthy([0])[0]


def test_the_probe_keeps_each_answer_for_the_autoscaler_one_call_per_rank() -> None:
    """The autoscaler reads its signals from the health probe's answers (``Health.statuses``): a
    tick asks each rank once. A rank that timed out or answers from a fenced world gives none."""
    from engine_ext.ray.autoscale_host import AutoscaleHost

    calls: list[int] = []

    class _Counted(_Answers):
        async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
            calls.append(self.rank)
            return await super()._invoke(method, *args, timeout=timeout)

    st = {"state": "serving", "epoch": 1, "requests_waiting": 6, "requests_running": 2}
    w = World("t")
    w.adopt(
        {0: _Counted(0, {**st, "rank": 0}), 1: _Counted(1, {**st, "rank": 1}), 2: _Counted(2, TimeoutError())},
        build_layout(8, 8, 3),
        epoch=1,
    )
    h = Health(w, deadline_s=5.0)
    asyncio.run(h.probe([0, 1, 2]))
    assert sorted(calls) == [0, 1, 2], "one status call per rank"
    assert [a["rank"] for a in h.statuses([0, 1, 2])] == [0, 1]
    host = AutoscaleHost("t", max_dp=8, persist=lambda s: None)
    host.set_autoscale({"target_queue": 4.0, "up_delay_s": 0.0})
    d = host.tick(h.statuses([0, 1]), [0, 1], now=1.0, num_experts=8, slots_per_rank=8)
    assert d is not None and d.signals[0].value == 8.0 and d.recommendation == 4, d
    w.fence(1, "test")
    asyncio.run(h.probe([0, 1]))
    assert [a["rank"] for a in h.statuses([0, 1])] == [0], "a fenced world's answer is not kept"
    h.forget(0)
    assert h.statuses([0, 1]) == []


def test_a_request_no_rank_takes_waits_and_fails_with_why_after_the_bound() -> None:
    async def scenario() -> None:
        r = Router()
        r.set_ranks({0: _Answers(0, ConnectionError("actor died"))})
        task = asyncio.ensure_future(r.submit([1, 2], 4))
        await asyncio.sleep(0.05)
        assert not task.done() and r.parked == 1  # the dead rank's refusal parks it
        assert r.expire_parked(60.0, "no healthy rank") == 0
        await asyncio.sleep(0.1)
        assert r.expire_parked(0.05, "no healthy rank") == 1
        res = await task
        assert "actor died" in res["error"] and "no healthy rank" in res["error"], res
        r.closed = True  # a stopping deployment fails at once
        assert "actor died" in (await r.submit([1], 1))["error"]

    asyncio.run(scenario())


def test_a_request_beyond_the_models_limits_is_answered_at_once_never_parked() -> None:
    """A rank's refusal of the input (``Refusal.INVALID``, carried as a Ray error's cause) is final:
    answered now, ``rejected``, without asking another rank or waiting for a world; the message is
    the rank's, with no class path. A moved request refused so (its prompt and output no longer fit
    one prefill) fails at once too, but was the client's valid input: not ``rejected``."""
    from engine_ext.errors import RankRefused
    from engine_ext.records import Refusal
    from tests.helpers import as_ray_task_error

    why = "prompt + max_tokens exceeds max_model_len 128"
    ray_like = as_ray_task_error(RankRefused(why, Refusal.INVALID))

    async def scenario() -> None:
        r = Router()
        asked: list[int] = []

        class _Refusing(_Answers):
            async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
                asked.append(self.rank)
                return await super()._invoke(method, *args, timeout=timeout)

        r.set_ranks({0: _Refusing(0, ray_like), 1: _Refusing(1, ray_like)})
        res = await asyncio.wait_for(r.submit([1, 2], 200), 5)
        assert res["error"] == why and res["rejected"] is True and r.parked == 0 and len(asked) == 1, res
        taker = _Refusing(2, {})  # takes the request, streams 60 tokens, then hands it back
        r.set_ranks({2: taker})
        task = asyncio.ensure_future(r.submit([1] * 10, 100, request_id="m"))
        await asyncio.sleep(0)
        for i in range(60):
            r.on_tokens({"m": [3, 0.5, i]}, 2)
        taker.answer = ray_like
        await r.resubmit([{"request_id": "m", "prompt": [1] * 10, "max_tokens": 100, "output": [3] * 60}])
        moved = await asyncio.wait_for(task, 5)
        assert "cannot continue the request on another rank" in moved["error"] and not moved.get("rejected")
        assert r.parked == 0 and r.failed == 2

    asyncio.run(scenario())


def test_a_refused_rank_call_is_one_line_without_a_class_path() -> None:
    from engine_ext.control.router import refusal_line

    assert (
        refusal_line(RuntimeError("ray::x()\n  File y\nray.exceptions.ActorDiedError: The actor died"))
        == "ActorDiedError: The actor died"
    )
    assert refusal_line(ConnectionError("actor died")) == "actor died"
    assert refusal_line(TimeoutError()) == "TimeoutError"


def test_equally_loaded_ranks_take_requests_in_turn() -> None:
    """Least in-flight first; a tie goes to the next rank in turn, so a light load reaches every
    rank (lowest-numbered first sent it all to rank 0)."""
    r = Router()
    r.set_ranks({n: _Answers(n, {}) for n in (0, 1, 2)})
    assert [r._pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r.inflight[1] = 1  # busier: skipped while others are idle
    assert [r._pick() for _ in range(3)] == [2, 0, 2]
    assert r._pick(avoid={0, 2}) == 1  # the only one left, loaded or not
    r.excluded.add(2)
    assert [r._pick() for _ in range(2)] == [0, 0]


def test_a_new_process_with_an_excluded_number_is_served() -> None:
    r = Router()
    old = _Answers(0, {})
    r.set_ranks({0: old})
    r.excluded.add(0)  # it died
    r.set_ranks({0: old})
    assert r.excluded == {0}  # the same process stays excluded
    r.set_ranks({0: _Answers(0, {})})  # rebuilt: a new process took number 0
    assert r.excluded == set()


def test_the_registry_refuses_reports_from_a_fenced_world() -> None:
    reg = RegistryState("t")
    reg.set_info({"control": {"fenced": {"1": {"epoch": 4, "reason": "silent"}}}})
    base = {"deployment": "t", "instance_id": "t_dp1", "engine_id": "t_dp1", "state": "serving"}
    assert reg.report_status(dict(base, rank=1, epoch=4))["accepted"] is False
    assert reg.report_status(dict(base, rank=1, epoch=5))["accepted"] is True  # a new rank 1


def test_status_lines_say_what_the_control_plane_does() -> None:
    now = 1000.0
    snap = {
        "info": {
            "control": {
                "working_on": "rebuild DP 2 from the weight source: every member is dead",
                "health": {
                    "0": {"unhealthy": ""},
                    "1": {"unhealthy": "silent for 6.0s (deadline 5s; probe: timed out)"},
                },
                "fenced": {"2": {"epoch": 7, "reason": "reported failed: oom", "at": 990.0}},
                "parked_requests": 3,
                "controller_restarts": 2,
                "took_over": ["re-attached to rank(s) [0, 1]"],
                "last_error": {"at": 995.0, "action": "grow", "error": "no capacity"},
                "backoff_s": 4.0,
            }
        }
    }
    assert control_lines(snap, now) == [
        "controller restarted 2 time(s); took over: re-attached to rank(s) [0, 1]",
        "reconciling: rebuild DP 2 from the weight source: every member is dead",
        "rank 1 unhealthy: silent for 6.0s (deadline 5s; probe: timed out)",
        "rank 2 fenced at epoch 7 10s ago: reported failed: oom",
        "3 request(s) waiting for a healthy world",
        "last reconcile error 5s ago in grow: no capacity (retry in 4s)",
    ]
    assert control_lines({"info": {}}) == []
    # what this controller publishes: the time of the next try (absolute: an idle tick changes nothing)
    snap["info"]["control"] = dict(snap["info"]["control"], backoff_s=None, retry_at=1004.0)
    assert control_lines(snap, now)[-1] == "last reconcile error 5s ago in grow: no capacity (retry in 4s)"
    snap["info"]["standby_pool"] = {"last_error": {"at": 990.0, "standby": 3, "error": "EepError: no CPU"}}
    assert control_lines(snap, now)[0] == (
        "standby pool short: launching standby 3 failed 10s ago: EepError: no CPU (tried again every 10s)"
    )


def test_a_moved_request_keeps_one_token_per_place_whatever_arrives_late() -> None:
    """The race behind a duplicated token (seen in test_second_death_during_a_recovery): the old
    owner's stream of a moved request lands after the move, then the new owner streams its own
    token at the same place. Only the owner's token at the next place counts, and only the
    owner's result. (Rank clients that answer at once: the interleaving cannot be staged with
    real processes.)"""

    async def scenario(tagged: bool) -> list[int]:
        r = Router()
        r.set_ranks({0: _Answers(0, {}), 1: _Answers(1, {})})
        task = asyncio.ensure_future(r.submit([5, 6], 5, request_id="a"))
        await asyncio.sleep(0)
        old = r._owner["a"]
        new = 1 - old

        def tokens(rank: int, at: int, tok: int) -> None:
            r.on_tokens({"a": [tok, 0.5, at] if tagged else [tok, 0.5]}, rank if tagged else None)

        tokens(old, 0, 42)
        tokens(old, 1, 42)
        assert r.reroute({old}) == 1  # the old owner died
        r.excluded.add(old)
        await r.resume()
        assert r._owner["a"] == new and r._wires["a"]["output"] == [42, 42]
        tokens(old, 2, 42)  # its last step's token, delivered late
        tokens(new, 2, 42)  # the new owner's token at the same place
        tokens(new, 2, 42)  # a repeat
        tokens(new, 4, 7)  # after a gap
        if tagged:
            r.on_results([{"request_id": "a", "output": [42, 42, 42, 9, 9]}], old)  # a run given up on
            assert not task.done()
        out = list(r._wires["a"]["output"])
        r.on_results([{"request_id": "a", "output": [42, 42, 42, 96, 1]}], new if tagged else None)
        assert (await task)["output"] == [42, 42, 42, 96, 1] and r.completed == 1
        return out

    assert asyncio.run(scenario(tagged=True)) == [42, 42, 42]
    # Untagged (how tokens arrived before): the late token and the owner's both land, and a
    # request moved again would continue from [42, 42, 42, 42, ...], a wrong prefix.
    assert asyncio.run(scenario(tagged=False))[:4] == [42, 42, 42, 42]


def test_an_action_failing_the_same_way_three_times_in_a_row_is_escalated_with_what_to_do() -> None:
    """Ids and numbers aside, the same failure three times in a row is escalated (status names the
    action, the cause, the attempts and the operator's options; the backoff goes to its longest);
    a different failure starts a new count, and the world reaching its desired state clears it."""
    from types import SimpleNamespace

    from engine_ext.control.reconciler import BACKOFF_MAX_S, ESCALATE_AFTER, Reconciler

    rec = Reconciler(
        SimpleNamespace(
            world=World("t"),
            name="t",  # failed/view read only these
            recovery=SimpleNamespace(running=lambda: False),
        )
    )
    taken = "op-20261204-2135{}-ab{} failed: rebuild failed: name 't_dp{}-pg' already exists"
    for i in range(ESCALATE_AFTER - 1):
        rec.failed("rebuild", taken.format(i, i, i))
        assert rec.escalated is None and rec.view()["retry_at"] - time.time() < BACKOFF_MAX_S
    rec.failed("grow", "op-1 rolled_back: no capacity to grow DP 1 -> 2: placement pack")  # another way
    rec.failed("rebuild", taken.format(7, 7, 7))
    assert rec.escalated is None  # the count started again
    for i in range(ESCALATE_AFTER - 1):
        rec.failed("rebuild", taken.format(i, i, i))
    esc = rec.view()["escalated"]
    assert esc["action"] == "rebuild" and esc["attempts"] == ESCALATE_AFTER and "already exists" in esc["cause"]
    assert len(esc["tried"]) == ESCALATE_AFTER and "eepctl down --name t" in esc["operator"]
    assert rec.view()["retry_at"] - time.time() >= BACKOFF_MAX_S - 1
    lines = control_lines({"info": {"control": rec.view()}})
    assert any(ln.startswith("ESCALATED: rebuild failed the same way 3 times in a row") for ln in lines), lines
    assert sum(ln.startswith("  tried ") for ln in lines) == ESCALATE_AFTER and lines[-1].startswith("  operator: ")
    rec._succeeded()
    assert rec.view()["escalated"] is None
    for _ in range(ESCALATE_AFTER):
        rec.failed("grow", "no capacity to grow DP 1 -> 2: 0 of 1 new rank(s) fit")
    assert "add nodes" in rec.escalated["operator"]


def test_the_test_only_backoff_cap_shortens_the_escalated_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """EEPCTL_TEST_BACKOFF_MAX_S (set only by the two-node test cluster) caps the escalated
    backoff; without it the product's BACKOFF_MAX_S holds (the test above)."""
    from types import SimpleNamespace

    from engine_ext.control.reconciler import ESCALATE_AFTER, Reconciler
    from engine_ext.faults import BACKOFF_MAX_ENV

    monkeypatch.setenv(BACKOFF_MAX_ENV, "3")
    rec = Reconciler(SimpleNamespace(world=World("t"), name="t", recovery=SimpleNamespace(running=lambda: False)))
    for _ in range(ESCALATE_AFTER):
        rec.failed("grow", "no capacity to grow DP 1 -> 2: 0 of 1 new rank(s) fit")
    assert rec.escalated is not None and 2.0 <= rec.view()["retry_at"] - time.time() <= 3.1
