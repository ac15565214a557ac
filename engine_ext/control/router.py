"""The frontend of a deployment: admits requests, spreads them over the serving ranks
(least in-flight first, ties taken in turn) and gathers their results.

It keeps every request it has not answered yet, with the tokens its rank streamed so far, so
a request whose rank died is re-submitted to a survivor and continues where it was (greedy
outputs do not change). While a recovery runs, requests wait here (``pause``/``resume``).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine_ext.control.rank_client import RankClient
from engine_ext.errors import rank_refusal
from engine_ext.records import Refusal


def refusal_line(e: BaseException) -> str:
    """One line of why a rank call failed: a remote traceback's last line, without the module
    path of its exception class (``ray.exceptions.ActorDiedError: ...`` -> ``ActorDiedError: ...``)."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*:)", "", lines[-1].strip())[:200]


class Router:
    """Admits requests, spreads them over the serving ranks, and gathers their results."""

    def __init__(self) -> None:
        self.clients: dict[int, RankClient] = {}
        self.excluded: set[int] = set()
        self.inflight: dict[int, int] = {}
        self._futures: dict[str, asyncio.Future] = {}
        self._owner: dict[str, int] = {}
        self._ids = itertools.count()
        self.completed = 0
        self.failed = 0
        self.rerouted = 0
        self.stale_dropped = 0  # tokens and results a non-owner sent, or a token out of place
        self._wires: dict[str, dict[str, Any]] = {}  # unanswered requests, with tokens so far
        self.paused = False
        self._parked: list[dict[str, Any]] = []
        self._parked_at: dict[str, float] = {}  # request id -> when it first waited for a world
        self._parked_why: dict[str, str] = {}  # request id -> why no rank took it
        self.closed = False  # the deployment stops: requests fail at once
        self.unhealthy: str | None = None  # why no rank can serve (a recovery failed), until one succeeds
        self._last_pick = -1  # ties go to the next rank after it
        self.watchers: dict[str, Callable[[int], None]] = {}  # request id -> told each new token (a stream)
        self.admitted = [0, 0, 0]  # requests submitted, their prompt tokens and output tokens asked for

    def set_ranks(self, clients: dict[int, RankClient]) -> None:
        # A rank number now held by a new process (a rebuild, a joiner) is not excluded any more.
        self.excluded = {r for r in self.excluded if r in clients and clients[r] is self.clients.get(r)}
        self.clients = dict(clients)
        for r in clients:
            self.inflight.setdefault(r, 0)

    def exclude(self, rank: int) -> None:
        """No new request goes to ``rank`` (it is leaving or dead); what it holds stays its own."""
        self.excluded.add(rank)

    def include(self, rank: int) -> None:
        self.excluded.discard(rank)

    def _pick(self, avoid: set[int] = frozenset()) -> int | None:  # type: ignore[assignment]
        """The least-loaded rank; among equally loaded ones the next in turn. (Lowest-numbered first
        sent every request of a light load to rank 0: the other ranks only ran dummy steps, and
        a rank's fault could go untried because it never held a request.)"""
        ranks = sorted(r for r in self.clients if r not in self.excluded and r not in avoid)
        if not ranks:
            return None
        least = min(self.inflight.get(r, 0) for r in ranks)
        tied = [r for r in ranks if self.inflight.get(r, 0) == least]
        pick = next((r for r in tied if r > self._last_pick), tied[0])
        self._last_pick = pick
        return pick

    async def submit(self, prompt: list[int], max_tokens: int, request_id: str | None = None) -> dict[str, Any]:
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        self.admitted = [self.admitted[0] + 1, self.admitted[1] + len(prompt), self.admitted[2] + int(max_tokens)]
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._futures[rid] = fut
        await self._send({"request_id": rid, "prompt": list(prompt), "max_tokens": int(max_tokens)})
        return await fut

    async def _send(self, wire: dict[str, Any]) -> None:
        """Hand the request to the least-loaded rank; a rank that refuses (failed, leaving,
        dead) is skipped for this request. When every rank refused, the request waits here for a
        world that can serve it (a recovery, a rebuild, the reconcile loop's retry), up to the
        bound after which it fails with why; it fails at once while the deployment stops, and
        when a rank refuses it as beyond the model's limits (every rank would: ``rejected``)."""
        self._wires[wire["request_id"]] = wire
        if self.paused:
            self._park(wire)
            return
        refused: dict[int, str] = {}
        while True:
            rank = self._pick(set(refused))
            if rank is None:
                reasons = "; ".join(f"rank {r}: {m}" for r, m in refused.items()) or "no rank is accepting requests"
                if not self.closed:
                    # A rank died or hung and the controller has not acted yet, the survivors are
                    # rebuilding, or no healthy rank is left: what follows resumes parked requests.
                    self._park(wire, reasons)
                    return
                if self.unhealthy is not None:
                    reasons = f"{self.unhealthy}; {reasons}"
                self._resolve(dict(wire, rank=-1, error=f"no rank accepted the request ({reasons})"))
                return
            self._owner[wire["request_id"]] = rank
            self.inflight[rank] = self.inflight.get(rank, 0) + 1
            try:
                await self.clients[rank].add_request(wire, timeout=30)
                return
            except Exception as e:  # noqa: BLE001 - any refusal: try the next rank
                self.inflight[rank] = max(0, self.inflight.get(rank, 0) - 1)
                self._owner.pop(wire["request_id"], None)
                refusal = rank_refusal(e)  # None: the call itself failed (a dead rank, a timeout)
                if refusal is not None and refusal.code is Refusal.INVALID:
                    self._reject(wire, str(refusal))
                    return
                refused[rank] = str(refusal) if refusal is not None else refusal_line(e)

    def _reject(self, wire: dict[str, Any], why: str) -> None:
        """A request beyond the model's limits is answered now. A client's request is ``rejected``
        (its input: HTTP 400); one that moved here with tokens already streamed was valid, and
        fails because its prompt and output no longer fit one prefill."""
        if wire.get("output"):
            self._resolve(dict(wire, rank=-1, error=f"cannot continue the request on another rank: {why}"))
        else:
            self._resolve(dict(wire, rank=-1, error=why, rejected=True))

    def _resolve(self, res: dict[str, Any]) -> None:
        rid = res["request_id"]
        self._wires.pop(rid, None)
        self._parked_at.pop(rid, None)
        self._parked_why.pop(rid, None)
        rank = self._owner.pop(rid, None)
        if rank is not None:
            self.inflight[rank] = max(0, self.inflight.get(rank, 0) - 1)
        fut = self._futures.pop(rid, None)
        if res.get("error"):
            self.failed += 1
        else:
            self.completed += 1
        if fut is not None and not fut.done():
            fut.set_result(res)

    def _from_owner(self, rid: str, rank: int | None) -> bool:
        """Whether what ``rank`` sent about request ``rid`` counts: only while it still owns it.
        A rank the request was moved off (it died, hung, or was cut off) may still deliver what
        it sent before; that stream and that result belong to a run the router gave up on."""
        return rid in self._wires and (rank is None or self._owner.get(rid) == rank)

    def on_results(self, results: list[dict[str, Any]], rank: int | None = None) -> None:
        """Finished requests from ``rank`` (None: a sender the caller does not know)."""
        for res in results:
            if self._from_owner(res["request_id"], rank):
                self._resolve(res)
            else:
                self.stale_dropped += 1

    async def resubmit(self, moved: list[dict[str, Any]]) -> None:
        """Requests handed back by a removing rank continue on a remaining one (re-prefilled)."""
        for wire in moved:
            old = self._owner.pop(wire["request_id"], None)
            if old is not None:
                self.inflight[old] = max(0, self.inflight.get(old, 0) - 1)
            await self._send(wire)

    async def resubmit_from(self, rank: int, given: list[dict[str, Any]]) -> int:
        """Requests ``rank`` gave back continue through the normal pick; one the router no longer
        routes to ``rank`` (re-routed with its death or fencing while the answer was on its way) is
        not sent twice. How many were sent on."""
        mine = [w for w in given if self._owner.get(w["request_id"]) == rank]
        await self.resubmit(mine)
        return len(mine)

    def on_tokens(self, tokens: dict[str, list[float]], rank: int | None = None) -> None:
        """Tokens ``rank`` produced this step: ``{request_id: [token, logit, index]}``, ``index``
        the token's place in the request's output. A token counts only from the request's owner
        and only at the next index: a token the router already has (the old owner's late stream
        of a moved request, then the new owner's own token at that index) must not be appended
        twice, or the request continues elsewhere from a wrong prefix."""
        for rid, (tok, logit, *at) in tokens.items():
            if not self._from_owner(rid, rank):
                self.stale_dropped += 1
                continue
            wire = self._wires[rid]
            output = wire.setdefault("output", [])
            if at and int(at[0]) != len(output):
                self.stale_dropped += 1  # a repeat, or after a gap: the prefix held stays exact
                continue
            output.append(int(tok))
            wire.setdefault("logits", []).append(float(logit))
            if (watch := self.watchers.get(rid)) is not None:
                watch(int(tok))

    def _park(self, wire: dict[str, Any], why: str = "") -> None:
        self._parked_at.setdefault(wire["request_id"], time.time())
        if why:
            self._parked_why[wire["request_id"]] = why
        self._parked.append(wire)

    async def retry_parked(self) -> None:
        """Send the waiting requests again (the reconcile loop, when no recovery holds them)."""
        if not self.paused and self._parked:
            parked, self._parked = self._parked, []
            for wire in parked:
                await self._send(wire)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def admissions(self) -> dict[str, int]:
        """Counters of what was submitted here (the autoscaler's arrival signal): requests, their
        prompt tokens and the output tokens they asked for."""
        return dict(zip(("requests", "prompt_tokens", "output_tokens"), self.admitted))

    def mid_decode(self, rank: int) -> int:
        """Unanswered requests ``rank`` owns that streamed tokens already: what its death would
        move with their tokens so far."""
        return sum(1 for rid, r in self._owner.items() if r == rank and self._wires.get(rid, {}).get("output"))

    def pause(self) -> None:
        """A recovery starts: new and re-routed requests wait here until ``resume``."""
        self.paused = True

    async def resume(self) -> None:
        self.paused, self.unhealthy = False, None
        parked, self._parked = self._parked, []
        for wire in parked:
            await self._send(wire)

    def reroute(self, dead: set[int]) -> int:
        """Requests owned by dead ranks wait for a survivor, with their tokens so far."""
        n = 0
        for rid, rank in list(self._owner.items()):
            if rank in dead:
                self._owner.pop(rid)
                self.inflight[rank] = max(0, self.inflight.get(rank, 0) - 1)
                wire = self._wires.get(rid)
                if wire is None:
                    continue
                wire["moved_from"] = list(wire.get("moved_from", [])) + [rank]
                self._park(wire)
                n += 1
        self.rerouted += n
        return n

    def expire_parked(self, max_wait_s: float, reason: str) -> int:
        """Fail the requests that waited longer than ``max_wait_s`` for a world to serve them
        (a rebuild that cannot happen): a bounded wait, with why in the error."""
        now = time.time()
        keep: list[dict[str, Any]] = []
        expired = 0
        for wire in self._parked:
            if now - self._parked_at.get(wire["request_id"], now) > max_wait_s:
                why = self._parked_why.get(wire["request_id"]) or reason
                self._resolve(
                    dict(
                        wire, rank=-1, error=f"no rank accepted the request within {max_wait_s:.0f}s ({why}; {reason})"
                    )
                )
                expired += 1
            else:
                keep.append(wire)
        self._parked = keep
        return expired

    def fail_parked(self, reason: str) -> None:
        parked, self._parked = self._parked, []
        for wire in parked:
            self._resolve(dict(wire, rank=-1, error=reason))
