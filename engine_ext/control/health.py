"""Health beyond process death: what the controller observes about each member every tick.

A member is unhealthy when its process is dead (the transport said so), when it reports
``failed`` (a local error: it stays alive but serves nothing), or when it has not answered a
probe, nor sent a token or a result, for longer than the deadline (a hang, a wedged device, a
paused VM, a node cut off). The reconcile loop (engine_ext.control.reconciler) fences an
unhealthy member and recovers around it, unless most members fall silent together: then it
suspects itself first (engine_ext.control.suspicion) and fences only what a second probe
(``confirm``) confirms. Torch-free.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from engine_ext.control.world import World, quiet

DEFAULT_DEADLINE_S = 5.0


class Health:
    """Each member's last sign of life and last reported state."""

    def __init__(self, world: World, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        self.world = world
        self.deadline_s = deadline_s
        self.last_seen: dict[int, float] = {}  # rank -> when it last answered or sent something
        self.reported: dict[int, dict[str, Any]] = {}  # rank -> {state, reason} of its last answer
        # rank -> its whole status record from the last probe (absent: no accepted answer then);
        # the autoscaler reads its signals from these, so one tick asks each rank once.
        self.answers: dict[int, dict[str, Any]] = {}
        self.probe_error: dict[int, str] = {}

    def seen(self, rank: int) -> None:
        """A token, a result or an answer came from ``rank`` (of an accepted epoch)."""
        self.last_seen[rank] = time.time()
        self.probe_error.pop(rank, None)

    def heard(self, rank: int, at: float) -> None:
        """An ingress took a token or a result of ``rank`` at ``at`` (engine_ext.ray.ingress_link):
        a sign of life of a member being watched (a fenced or departed rank is not one)."""
        if rank in self.last_seen and at > self.last_seen[rank]:
            self.last_seen[rank] = at

    async def probe(self, ranks: list[int]) -> None:
        """Ask each of ``ranks`` for its status at once; an answer is a sign of life."""
        clients = [(r, self.world.clients[r]) for r in ranks if r in self.world.clients]
        now = time.time()
        for r, _ in clients:
            self.last_seen.setdefault(r, now)  # a new member's clock starts when it is first probed
        wait = probe_wait_s(self.deadline_s)
        answers = await asyncio.gather(*(quiet(c.status(timeout=wait)) for _, c in clients))
        for (r, _), st in zip(clients, answers):
            if isinstance(st, dict) and self.world.accepts(r, int(st.get("epoch", 0))):
                self.seen(r)
                self.reported[r] = {"state": st.get("state", ""), "reason": st.get("state_reason", "")}
                self.answers[r] = st
            else:
                self.probe_error[r] = _why(st)
                self.answers.pop(r, None)

    def statuses(self, ranks: list[int]) -> list[dict[str, Any]]:
        """The last probe's status records of ``ranks`` (a rank that did not answer is left out)."""
        return [self.answers[r] for r in ranks if r in self.answers]

    def failed(self, ranks: list[int]) -> dict[int, str]:
        """Members of ``ranks`` whose last answer reported ``failed``, with why."""
        return {
            r: f"reported failed: {self.reported[r].get('reason', '')}"[:300]
            for r in ranks
            if self.reported.get(r, {}).get("state") == "failed"
        }

    def silent(self, ranks: list[int]) -> dict[int, tuple[float, str]]:
        """Members of ``ranks`` silent past the deadline: how long, and what the last probe got."""
        now = time.time()
        ages = {r: now - self.last_seen.get(r, now) for r in ranks}
        return {r: (age, self.probe_error.get(r, "no answer")) for r, age in ages.items() if age > self.deadline_s}

    async def confirm(self, suspects: dict[int, str], timeout_s: float) -> dict[int, str]:
        """Ask each of ``suspects`` (rank -> why it would be fenced) the second probe at once
        (``RankClient.ping``, not the status probe); those that do not answer, with why. An
        answer shows the process lives, not its engine: the member's silence clock runs on, so an
        engine hung in a live process is fenced at the hung bound (engine_ext.control.suspicion)."""
        ranks = [r for r in suspects if r in self.world.clients]
        answers = await asyncio.gather(*(quiet(self.world.clients[r].ping(timeout=timeout_s)) for r in ranks))
        out: dict[int, str] = {}
        for r, ans in zip(ranks, answers):
            if isinstance(ans, BaseException):
                out[r] = f"{suspects[r][:240]}; second probe: {_why(ans)[:50]}"
        return out

    def unhealthy(self, ranks: list[int]) -> dict[int, str]:
        """Why each of ``ranks`` is unhealthy (absent: healthy) by the configured deadline."""
        out = {r: silent_for(age, self.deadline_s, why) for r, (age, why) in self.silent(ranks).items()}
        out.update(self.failed(ranks))
        return out

    def forget(self, rank: int) -> None:
        """``rank`` left the world (or was fenced): its number may be given to a new rank."""
        self.last_seen.pop(rank, None)
        self.reported.pop(rank, None)
        self.probe_error.pop(rank, None)
        self.answers.pop(rank, None)

    def view(self, ranks: list[int]) -> dict[str, dict[str, Any]]:
        """Per member: heartbeat age and the reason it is unhealthy, for ``eepctl status``."""
        now = time.time()
        bad = self.unhealthy(ranks)
        return {
            str(r): {"age_s": round(now - self.last_seen.get(r, now), 2), "unhealthy": bad.get(r, "")} for r in ranks
        }


def probe_wait_s(deadline_s: float) -> float:
    """How long a status probe waits for an answer: several probes fit in one deadline."""
    return max(1.0, deadline_s / 2)


def silent_for(age_s: float, deadline_s: float, why: str, extended: str = "") -> str:
    """The reason a silent member is fenced (``extended``: the suspicion that extended its deadline)."""
    return f"silent for {age_s:.1f}s (deadline {deadline_s:g}s{extended}; probe: {why})"[:300]


def _why(answer: Any) -> str:
    if isinstance(answer, asyncio.TimeoutError):
        return "timed out"
    if isinstance(answer, BaseException):
        text = str(answer).strip().splitlines()
        return (text[-1] if text else type(answer).__name__)[:200]
    if isinstance(answer, dict):
        return f"answer from a fenced epoch {answer.get('epoch')}"
    return "no answer"
