"""The controller's side of its ingresses (engine_ext.ray.ingress): the router's control surface
(what the orchestrator, the recovery and the reconcile loop call on ``World.router``), carried out
by every ingress instead of a router in the controller.

Decisions (members, exclusions, pause, resume, unhealthy, closed, fences) become one world
message, pushed to every ingress when it changes; actions on requests (re-route a dead rank's,
hand back a drained rank's, expire or fail the parked ones) are sent to every ingress, or to the
one that owns the request. Every reconcile tick asks each ingress for its counts and re-sends the
world to one that holds another version (it was restarted by Ray, or missed a message). Nothing
here waits on a request; the counts the recovery records (re-routed requests) arrive with the
ingresses' answers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from engine_ext.control.rank_client import RankClient
from engine_ext.ray import ray_private
from engine_ext.ray.names import ingress_name, owner_of

TICK_TIMEOUT_S = 2.0
HAND_BACK_S = 60.0  # how long requests handed back are offered to an ingress that does not answer
HAND_BACK_RETRY_S = 0.5


class IngressLink:
    """Stands where the controller's router stood (``World.router``)."""

    def __init__(
        self,
        deployment: str,
        namespace: str,
        count: int,
        fenced: Callable[[], dict[int, int]],
        seen: Callable[[int, float], None] = lambda r, at: None,
        limits: dict[str, int] | None = None,
    ) -> None:
        self.deployment, self.namespace, self.count = deployment, namespace, count
        self.limits = limits  # the model's (vocabulary, max_model_len, prompt): each ingress checks requests
        self._fenced = fenced  # rank -> the epoch it is fenced at (the world's)
        self._seen = seen  # told when an ingress last heard a token or a result of a rank (health)
        self.clients: dict[int, RankClient] = {}
        self.excluded: set[int] = set()
        self._paused = False
        self._unhealthy: str | None = None
        self._closed = False
        self.rerouted = 0  # re-routed requests, as the ingresses answered
        self._expired = 0
        self._version = [uuid.uuid4().hex[:8], 0]  # this controller's, then its message count
        self.stats: dict[int, dict[str, Any]] = {}  # ingress index -> its last answer
        self._handles: dict[int, Any] = {}
        self.pushes = 0
        self._handing: set[asyncio.Task] = set()  # hand-backs under way (held: a bare task may be collected)
        self.handed_back = 0  # requests an ingress took back from a removing rank
        self.handed_back_lost = 0  # requests whose ingress never answered the hand-back
        self._last: dict[str, Any] | None = None  # the world last pushed (without its version)

    # ---- the world ---------------------------------------------------------------------------
    def set_ranks(self, clients: dict[int, RankClient]) -> None:
        self.excluded = {r for r in self.excluded if r in clients and clients[r] is self.clients.get(r)}
        self.clients = dict(clients)
        self._push()

    def exclude(self, rank: int) -> None:
        self.excluded.add(rank)
        self._push()

    def include(self, rank: int) -> None:
        self.excluded.discard(rank)
        self._push()

    def pause(self) -> None:
        self._paused = True
        self._push()

    async def resume(self) -> None:
        self._paused, self._unhealthy = False, None
        self._push()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def unhealthy(self) -> str | None:
        return self._unhealthy

    @unhealthy.setter
    def unhealthy(self, why: str | None) -> None:
        self._unhealthy = why
        self._push()

    @property
    def closed(self) -> bool:
        return self._closed

    @closed.setter
    def closed(self, closed: bool) -> None:
        self._closed = closed
        self._push()

    def world(self) -> dict[str, Any]:
        members = {}
        for r, c in self.clients.items():
            handle = getattr(c, "handle", None)
            members[str(r)] = [getattr(c, "actor_name", ""), ray_private.actor_id(handle) if handle is not None else ""]
        return {
            "members": members,
            "excluded": sorted(self.excluded),
            "paused": self._paused,
            "unhealthy": self._unhealthy,
            "closed": self._closed,
            "fenced": {str(r): e for r, e in self._fenced().items()},
            "limits": self.limits,
        }

    def _push(self, only: int | None = None) -> None:
        """Send the world to every ingress when it changed (or to one, as it is). Never an empty
        world before this controller knows its members (a restarted one taking over): the
        ingresses keep the one they have."""
        if not self.clients and not self._closed:
            return
        world = self.world()
        if only is None:
            if world == self._last:
                return
            self._last = world
            self._version[1] += 1
        world["version"] = list(self._version)
        for i in range(self.count) if only is None else [only]:
            h = self._handle(i)
            if h is not None:
                self.pushes += 1
                h.set_world.remote(world)

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            try:
                h = self._handles[index] = ray.get_actor(ingress_name(self.deployment, index), namespace=self.namespace)
            except ValueError:
                return None
        return h

    # ---- requests ----------------------------------------------------------------------------
    def reroute(self, dead: set[int]) -> None:
        """Each ingress parks what the dead ranks held, in the background: how many arrives with
        their answers (the ``rerouted`` count), not here."""
        for i in range(self.count):
            if (h := self._handle(i)) is not None:
                asyncio.ensure_future(self._add(h.reroute.remote(sorted(dead)), "rerouted"))

    async def resubmit(self, moved: list[dict[str, Any]], from_rank: int | None = None) -> None:
        """Requests a removing rank handed back go to the ingress that owns them, in the
        background (a scale does not wait on an ingress); ``from_rank``: see ``resubmit_from``."""
        by_owner: dict[int, list[dict[str, Any]]] = {}
        for wire in moved:
            owner = owner_of(wire["request_id"])
            if owner is not None:
                by_owner.setdefault(owner, []).append(wire)
        for i, wires in by_owner.items():
            task = asyncio.ensure_future(self.hand_back(i, wires, from_rank=from_rank))
            self._handing.add(task)
            task.add_done_callback(self._handing.discard)

    async def resubmit_from(self, rank: int, given: list[dict[str, Any]]) -> int:
        """Requests ``rank`` gave back (a scale-up's re-dispatch) go to their ingresses as a removing
        rank's do; each ingress's router sends on those it still routes to ``rank`` (one re-routed
        while the answer was on its way is not sent twice). How many were handed on."""
        await self.resubmit(given, from_rank=rank)
        return len(given)

    async def hand_back(
        self, index: int, wires: list[dict[str, Any]], within_s: float = HAND_BACK_S, from_rank: int | None = None
    ) -> bool:
        """Give ``wires`` to ingress ``index`` until it answers: a call to an ingress Ray is
        restarting fails at once, and a request sent nowhere would wait in its ingress forever.
        The ingress that answers runs those it owns and drops those of its predecessor (their
        client left with it). False, counted in ``handed_back_lost``, when none answered within
        ``within_s`` (the ingress is gone for good)."""
        deadline = time.monotonic() + within_s
        while True:
            h = self._handle(index)
            if h is not None:
                try:
                    answer = await h.resubmit.remote(wires, from_rank)
                    self.handed_back += int(answer.get("resubmitted", 0)) if isinstance(answer, dict) else len(wires)
                    return True
                except Exception:  # noqa: BLE001 - being restarted, or just died: asked again
                    self._handles.pop(index, None)
            if time.monotonic() > deadline:
                self.handed_back_lost += len(wires)
                return False
            await asyncio.sleep(HAND_BACK_RETRY_S)

    async def retry_parked(self) -> None:
        """The reconcile tick: each ingress re-sends what it parked and answers its counts; one
        holding another world version (restarted, or it missed a message) is sent this one."""
        self._push()  # a fence of a rank already dead changed no other field
        idx = [i for i in range(self.count) if self._handle(i) is not None]
        answers = await asyncio.gather(*(self._tick(i) for i in idx))
        for i, a in zip(idx, answers):
            if isinstance(a, dict):
                self.stats[i] = a
                for r, at in (a.get("heard") or {}).items():
                    self._seen(int(r), float(at))
                if a.get("version") != self._version:
                    self._push(only=i)

    async def _tick(self, index: int) -> Any:
        try:
            return await asyncio.wait_for(self._handles[index].tick.remote(), TICK_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - being restarted by Ray: asked again next tick
            return e

    def expire_parked(self, max_wait_s: float, reason: str) -> int:
        """Each ingress fails what waited too long; returns the count answered since the last call."""
        for i in range(self.count):  # only where requests wait (idle: no call)
            if int(self.stats.get(i, {}).get("parked", 1)) > 0 and (h := self._handle(i)) is not None:
                asyncio.ensure_future(self._add(h.expire_parked.remote(max_wait_s, reason), "_expired"))
        n, self._expired = self._expired, 0
        return n

    def fail_parked(self, reason: str) -> None:
        for i in range(self.count):
            if (h := self._handle(i)) is not None:
                h.fail_parked.remote(reason)

    async def _add(self, ref: Any, attr: str) -> None:
        try:
            setattr(self, attr, getattr(self, attr) + int(await ref))
        except Exception:  # noqa: BLE001 - an ingress being restarted lost what it held
            pass

    @property
    def parked(self) -> int:
        return sum(int(s.get("parked", 0)) for s in self.stats.values())

    @property
    def stale_dropped(self) -> int:
        return sum(int(s.get("stale_dropped", 0)) for s in self.stats.values())

    @property
    def fenced_dropped(self) -> int:
        return sum(int(s.get("fenced_dropped", 0)) for s in self.stats.values())

    def admissions(self) -> dict[str, int]:
        """What the ingresses admitted, summed from their answers to this tick (the autoscaler's
        arrival signal; an ingress restarted by Ray counts from 0 again)."""
        out = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0}
        for s in self.stats.values():
            for k, v in (s.get("admitted") or {}).items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def shown(self) -> list[dict[str, Any]]:
        """Each ingress as `eepctl status` shows it."""
        keys = (
            "index",
            "url",
            "parked",
            "completed",
            "failed",
            "inflight",
            "restarted",
            "listen",
            "key_required",
            "note",
            "listen_error",
        )
        return [{k: s.get(k) for k in keys} for _, s in sorted(self.stats.items())]
