"""The health check that suspects itself, without processes: when most members fall silent
together (or the controller's own loop lags) the reconcile loop extends the deadline, says so in
status, and fences only what a second probe confirms; a minority silent is fenced at the deadline
as before; a total hang is still fenced, at the first tick past the extended deadline. The same
loop runs for real in tests/test_control_plane_ray.py (every rank SIGSTOPped, then resumed; then
for good)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from eepctl.render_control import control_lines
from engine_ext.control.rank_client import RankClient
from engine_ext.control.reconciler import Reconciler
from engine_ext.control.suspicion import HUNG_FACTOR, SUSPECT_FACTOR, fence_bound_s, hung_bound_s
from engine_ext.control.world import World
from engine_ext.elastic.eplb import build_layout

DEADLINE_S = 0.3
EXTENDED_S = SUSPECT_FACTOR * DEADLINE_S


class _Probed(RankClient):
    """A rank whose answers to the status probe and to the second probe a test sets (a real
    process cannot be slowed on cue here; the Ray scenario stops real ones)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.status_answers = True
        self.ping_answers = True

    async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
        if not self.status_answers:
            raise asyncio.TimeoutError()
        return {"state": "serving", "epoch": 1}

    async def ping(self, *, timeout: float | None = None) -> None:
        if not self.ping_answers:
            raise asyncio.TimeoutError()

    async def kill(self) -> None:
        return None

    def pid(self) -> int:
        return 0


def _loop(n: int, deadline_s: float = DEADLINE_S) -> tuple[Reconciler, dict[int, _Probed], dict[int, str]]:
    """A reconcile loop over ``n`` ranks whose fence only records (the recovery is not under test)."""
    w = World("t")
    clients = {r: _Probed(r) for r in range(n)}
    w.adopt(dict(clients), build_layout(8, 8, n), epoch=1)
    fenced: dict[int, str] = {}
    recovery = SimpleNamespace(dead={}, running=lambda: False)

    async def fence(rank: int, reason: str) -> None:
        fenced[rank] = reason
        recovery.dead[rank] = reason

    orch = SimpleNamespace(world=w, name="t", desired=0, recovery=recovery, fence=fence)
    return Reconciler(orch, deadline_s=deadline_s), clients, fenced  # type: ignore[arg-type]


def _silence(clients: dict[int, _Probed], ranks: list[int], *, ping: bool) -> None:
    for r in ranks:
        clients[r].status_answers, clients[r].ping_answers = False, ping


def test_most_ranks_silent_together_are_not_fenced_until_a_second_probe_confirms() -> None:
    rec, clients, fenced = _loop(4)
    asyncio.run(rec.tick())
    # Every rank slowed together past the deadline, alive: the observer is suspected, nobody fenced.
    _silence(clients, [0, 1, 2, 3], ping=True)
    time.sleep(DEADLINE_S + 0.05)
    asyncio.run(rec.tick())
    assert fenced == {}, fenced
    cur = rec.view()["suspicion"]
    assert cur["silent"] == [0, 1, 2, 3] and cur["members"] == 4 and cur["extended_s"] == EXTENDED_S, cur
    line = [ln for ln in control_lines({"info": {"control": rec.view()}}) if ln.startswith("health:")]
    assert len(line) == 1 and line[0].startswith("health: suspecting the observer: 4 of 4 ranks silent "), line
    assert "while alive; controller tick lag 0.0s" in line[0] and f"deadline extended to {EXTENDED_S:g}s" in line[0]
    # They answer again: the suspicion ends, and status says how, with no one fenced.
    for c in clients.values():
        c.status_answers = True
    asyncio.run(rec.tick())
    assert fenced == {} and rec.view()["suspicion"] is None and rec.view()["last_suspicion"]["fenced"] == []
    line = [ln for ln in control_lines({"info": {"control": rec.view()}}) if ln.startswith("health:")]
    assert line and line[0].startswith("health: suspected the observer ") and line[0].endswith("fenced none"), line
    # Silent together past the extended deadline: only the rank the second probe cannot reach is fenced.
    _silence(clients, [0, 1, 2, 3], ping=True)
    clients[3].ping_answers = False
    time.sleep(EXTENDED_S + 0.05)
    asyncio.run(rec.tick())
    assert list(fenced) == [3], fenced
    assert fenced[3].startswith("silent for ") and f"extended to {EXTENDED_S:g}s: 4 of 4 silent together" in fenced[3]
    assert fenced[3].endswith("second probe: timed out"), fenced[3]


def test_a_minority_silent_is_fenced_at_the_deadline_and_a_total_hang_within_the_bound() -> None:
    rec, clients, fenced = _loop(3)
    asyncio.run(rec.tick())
    # One of three silent (the others answer: the observer works): fenced at the deadline, no second probe.
    _silence(clients, [2], ping=True)
    time.sleep(DEADLINE_S + 0.05)
    asyncio.run(rec.tick())
    assert list(fenced) == [2] and f"(deadline {DEADLINE_S:g}s; probe: timed out)" in fenced[2], fenced
    assert rec.view()["suspicion"] is None
    # Every rank left hangs for good: not fenced at the deadline, fenced at the first tick past the
    # extended one (each tick here is immediate; fence_bound_s adds a real loop's tick and probes).
    _silence(clients, [0, 1], ping=False)
    hung = time.time()
    time.sleep(DEADLINE_S + 0.05)
    asyncio.run(rec.tick())
    assert list(fenced) == [2] and rec.view()["suspicion"]["silent"] == [0, 1]
    time.sleep(max(0.0, hung + EXTENDED_S + 0.05 - time.time()))
    asyncio.run(rec.tick())
    assert sorted(fenced) == [0, 1, 2] and all("second probe: timed out" in fenced[r] for r in (0, 1)), fenced
    assert time.time() - hung <= fence_bound_s(DEADLINE_S, rec.tick_s, 1.0)
    asyncio.run(rec.tick())  # no live member left: the suspicion ended, naming what it fenced
    assert rec.view()["suspicion"] is None and rec.view()["last_suspicion"]["fenced"] == [0, 1]


def test_the_loop_measures_its_own_lag_and_a_lagging_observer_fences_no_one_on_its_own_word() -> None:
    """The loop's timer firing late (here its event loop blocked: a starved or paused controller)
    is measured; while it lags by half a deadline or more, even a minority silent waits for the
    extended deadline and the second probe."""
    deadline_s = 1.0
    rec, clients, fenced = _loop(4, deadline_s)
    rec.tick_s = 0.05

    async def blocked() -> float:
        rec.start()
        await asyncio.sleep(0.2)
        time.sleep(0.8)  # the controller's own process stalls
        await asyncio.sleep(0.2)
        rec.stop()
        return rec.lag.recent()

    lag = asyncio.run(blocked())
    assert lag >= 0.5 * deadline_s, lag
    _silence(clients, [1], ping=True)
    time.sleep(deadline_s + 0.05)
    asyncio.run(rec.tick())
    assert fenced == {} and rec.view()["suspicion"]["lag_s"] >= 0.5, (fenced, rec.view()["suspicion"])


def test_engines_hung_in_live_processes_are_fenced_within_the_hung_bound() -> None:
    """Every engine silent while its process still answers the second probe (a deadlock inside a
    step): the suspicion holds the fence past the extended deadline, not past ``HUNG_FACTOR``
    deadlines; then they are fenced, the reason naming why the live process no longer counts."""
    rec, clients, fenced = _loop(3)
    asyncio.run(rec.tick())
    _silence(clients, [0, 1, 2], ping=True)
    hung = time.time()
    time.sleep(EXTENDED_S + 0.05)
    asyncio.run(rec.tick())
    assert fenced == {} and rec.view()["suspicion"]["silent"] == [0, 1, 2], fenced
    time.sleep(max(0.0, hung + HUNG_FACTOR * DEADLINE_S + 0.05 - time.time()))
    asyncio.run(rec.tick())
    assert sorted(fenced) == [0, 1, 2], fenced
    assert all("a live process is no proof of a live engine" in why for why in fenced.values()), fenced
    assert time.time() - hung <= hung_bound_s(DEADLINE_S, rec.tick_s) + 1.0
