"""An ingress of a reference deployment: a named, detached async actor that owns the requests it
admits. The controller is never on a request's path.

It holds the router (engine_ext.control.router): requests enter here (``generate``, or HTTP:
engine_ext.ray.ingress_http), go to a rank, and the rank streams their tokens and results back to
the ingress that owns them (the request id says which: ``names.request_prefix``). The tokens so far
stay here, so a request whose rank died continues on a survivor from where it was.

The controller tells every ingress the world (``set_world``: members, epoch fences, excluded
ranks, pause, resume, unhealthy, closed, the model's limits that HTTP requests are checked
against) and what to do with requests (``reroute``, ``resubmit``, ``expire_parked``,
``fail_parked``); between its messages the ingress keeps the world it has. So
the controller can die under load and nothing is lost: new requests go to the members it last
named; a request whose rank died waits here (its owner is not re-routed without a controller)
and is served once the restarted controller recovered the world. A restarted ingress starts
from the controller's durable state (engine_ext.ray.durable) until the controller speaks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import ray
from engine_ext.control.router import Router
from engine_ext.ray import ray_private
from engine_ext.ray.names import controller_name, request_prefix
from engine_ext.ray.spawner import RayRankClient

RETRY_PARKED_S = 0.5  # how often the ingress itself re-sends requests no rank took
REFENCE_EVERY_S = 3.0  # a fenced rank still sending is reported to the controller at most this often
LISTEN_RETRY_S = 1.0  # a restarted ingress whose pinned port is taken tries it again this often


class Ingress:
    """One ingress: the router, the world as the controller last said, and the request API."""

    def __init__(
        self,
        deployment: str,
        namespace: str,
        index: int,
        api_key_sha256: str = "",
        port: int = 0,
        host: str = "0.0.0.0",
    ) -> None:
        self.deployment, self.namespace, self.index = deployment, namespace, index
        self.api_key_sha256 = api_key_sha256  # the deployment's API key, hashed (HTTP wants the key)
        self.router = Router()
        self.limits: dict[str, int] | None = None  # the model's, from the world (HTTP checks requests)
        self.version: list[Any] | None = None  # the controller's world version last applied
        self.fenced: dict[int, int] = {}  # rank -> the newest epoch it is fenced at
        self.fenced_dropped = 0
        self.heard: dict[int, float] = {}  # rank -> when it last sent a token or a result (accepted)
        self._told: dict[int, float] = {}
        self.started_at = time.time()
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._from_durable()
        loop = asyncio.get_event_loop()
        self._retry = loop.create_task(self._retry_loop())
        self.incarnation = uuid.uuid4().hex[:6]  # in its request ids: a restarted ingress knows its own
        self.handed_back = {"resubmitted": 0, "dropped": 0}  # requests removing ranks handed back
        self.url = ""
        self.listen_error = ""  # why the HTTP server does not listen (a pinned port taken), while it does not
        self.http: Any = None
        self._http = loop.create_task(self._serve_http(host, port))  # a restarted ingress serves again too

    async def _serve_http(self, host: str, port: int) -> None:
        """Serve HTTP. A pinned port that is taken fails the first start (`up` says so); a
        restarted ingress tries it again every LISTEN_RETRY_S until it is free (status says why)."""
        from engine_ext.ray.ingress_http import IngressHttp
        from engine_ext.ray.ingress_listen import ListenError

        self.http = IngressHttp(self)
        while True:
            try:
                self.url = await self.http.start(host, port)
                self.listen_error = ""
                return
            except ListenError as e:
                self.listen_error = str(e)
                if not self.restarted:
                    raise
            await asyncio.sleep(LISTEN_RETRY_S)

    async def ready(self) -> dict[str, Any]:
        """Once the HTTP server listens: where (as status shows it); else why it does not, as an
        error record (a port that is taken: exit 4; any other failure of the server: exit 5)."""
        from engine_ext.errors import PreconditionError, TransitionFailed, error_record
        from engine_ext.ray.ingress_listen import ListenError

        try:
            await asyncio.shield(self._http)
        except ListenError as e:
            return error_record(PreconditionError(f"ingress {self.index} of {self.deployment!r}: {e}"))
        except Exception as e:  # noqa: BLE001 - the HTTP server's own failure, reported whole
            return error_record(
                TransitionFailed(
                    f"ingress {self.index} of {self.deployment!r} could not start "
                    f"its HTTP server: {type(e).__name__}: {e}"
                )
            )
        return {**self.where(), "node_id": ray.get_runtime_context().get_node_id()}

    def where(self) -> dict[str, Any]:
        """How clients reach it: the URL, the address it listens on, whether requests need a key,
        why its port changed or why it does not listen."""
        http = self.http
        return {
            "index": self.index,
            "url": self.url,
            "listen": getattr(http, "listen", ""),
            "key_required": bool(self.api_key_sha256),
            "note": getattr(http, "note", ""),
            "listen_error": self.listen_error,
        }

    # ---- the world, as the controller says ---------------------------------------------------
    def set_world(self, world: dict[str, Any]) -> None:
        """The controller's world: applied whole (a newer message replaces it)."""
        r = self.router
        self._set_members({int(k): v for k, v in world["members"].items()})
        self.fenced = {int(k): int(v) for k, v in world.get("fenced", {}).items()}
        r.excluded = {int(x) for x in world.get("excluded", []) if int(x) in r.clients}
        if world.get("closed") and not r.closed:
            r.closed = True
            r.fail_parked("the deployment is stopping")
        if world.get("paused"):
            r.pause()
        elif r.paused or r.parked:
            r.paused = False  # resume: the parked requests go out now, with their tokens so far
            asyncio.ensure_future(r.retry_parked())
        r.unhealthy = world.get("unhealthy")
        self.limits = world.get("limits") or self.limits
        self.version = world.get("version")

    def _set_members(self, members: dict[int, list[str]]) -> None:
        """Rank clients by actor name and id: a rank rebuilt under the same name is a new actor."""
        clients: dict[int, Any] = {}
        for rank, (name, actor_id) in members.items():
            old = self.router.clients.get(rank)
            if old is not None and getattr(old, "actor_id", None) == actor_id:
                clients[rank] = old
                continue
            if not name:
                continue  # gone when a restarted controller took over: its recovery follows
            try:
                handle = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                continue  # gone: the controller's next world says what replaced it
            client = RayRankClient(rank, handle, 0, actor_name=name)
            client.actor_id = ray_private.actor_id(handle)
            clients[rank] = client
        self.router.set_ranks(clients)

    def _from_durable(self) -> None:
        """A (re)started ingress serves the members the controller last wrote down."""
        from engine_ext.ray.durable import DurableState

        try:
            saved = DurableState(self.namespace, self.deployment).load() or {}
        except Exception:  # noqa: BLE001 - no state yet: the controller's first world says it
            return
        actors = saved.get("actors") or {}
        members = {}
        for r in saved.get("members") or []:
            try:
                h = ray.get_actor(actors.get(str(r), ""), namespace=self.namespace)
            except ValueError:
                continue
            members[int(r)] = [actors[str(r)], ray_private.actor_id(h)]
        self._set_members(members)
        self.fenced = {int(k): int(f.get("epoch", 0)) for k, f in (saved.get("fenced") or {}).items()}

    # ---- what ranks send ---------------------------------------------------------------------
    def on_tokens(self, tokens: dict[str, list[float]], rank: int = -1, epoch: int = -1) -> None:
        if self._accept(rank, epoch):
            self.router.on_tokens(tokens, rank if rank >= 0 else None)

    def on_results(self, results: list[dict[str, Any]], rank: int = -1, epoch: int = -1) -> None:
        if self._accept(rank, epoch):
            self.router.on_results(results, rank if rank >= 0 else None)

    def _accept(self, rank: int, epoch: int) -> bool:
        """Never from a fenced world (a rank that hung or was cut off and came back): the
        controller is told, and ends it again."""
        fenced_at = self.fenced.get(rank)
        if rank < 0 or fenced_at is None or epoch > fenced_at:
            if rank >= 0:
                self.heard[rank] = time.time()  # a sign of life the controller's health check counts
            return True
        self.fenced_dropped += 1
        now = time.time()
        if now - self._told.get(rank, 0.0) >= REFENCE_EVERY_S:
            self._told[rank] = now
            try:
                ray.get_actor(controller_name(self.deployment), namespace=self.namespace).heard_fenced.remote(rank)
            except Exception:  # noqa: BLE001 - no controller now: the restarted one fences it
                pass
        return False

    # ---- what the controller asks -------------------------------------------------------------
    def reroute(self, dead: list[int]) -> int:
        return self.router.reroute(set(dead))

    async def resubmit(self, wires: list[dict[str, Any]], from_rank: int | None = None) -> dict[str, int]:
        """Requests a removing rank handed back continue on a remaining rank. Only this
        incarnation's: a request of the ingress before a restart lost its client with it (the
        client sends it again), so running it would serve no one. With ``from_rank`` (a rank's
        give-back to joiners) only those the router still routes to that rank: one it re-routed
        meanwhile (the rank fenced or dead while its answer was on its way) is not sent twice.
        Answers both counts."""
        mine = f"{request_prefix(self.index)}{self.incarnation}-"
        own = [w for w in wires if str(w.get("request_id", "")).startswith(mine)]
        if from_rank is None:
            await self.router.resubmit(own)
            sent = len(own)
        else:
            sent = await self.router.resubmit_from(from_rank, own)
        self.handed_back["resubmitted"] += sent
        self.handed_back["dropped"] += len(wires) - sent
        return {"resubmitted": sent, "dropped": len(wires) - sent}

    def expire_parked(self, max_wait_s: float, reason: str) -> int:
        return self.router.expire_parked(max_wait_s, reason)

    def fail_parked(self, reason: str) -> None:
        self.router.fail_parked(reason)

    async def tick(self) -> dict[str, Any]:
        """The controller's per-second look: parked requests go out again; what status shows."""
        await self.router.retry_parked()
        return self.stats()

    def stats(self) -> dict[str, Any]:
        r = self.router
        return {
            "index": self.index,
            "version": self.version,
            "url": self.url,
            "parked": r.parked,
            "paused": r.paused,
            "completed": r.completed,
            "failed": r.failed,
            "rerouted": r.rerouted,
            "stale_dropped": r.stale_dropped,
            "fenced_dropped": self.fenced_dropped,
            "inflight": sum(r.inflight.values()),
            "members": sorted(r.clients),
            "restarted": self.restarted,
            "heard": {str(k): t for k, t in self.heard.items()},
            "admitted": r.admissions(),  # the autoscaler's arrival signal
            "handed_back": dict(self.handed_back),
            **self.where(),
        }

    def pid(self) -> int:
        import os

        return os.getpid()

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """One request, answered when done (tokens, or why it failed)."""
        t0 = time.time()
        res = await self.router.submit(prompt, max_tokens, self.new_request_id())
        res["latency_s"] = time.time() - t0
        res["ingress"] = self.index
        return res

    def new_request_id(self) -> str:
        return f"{request_prefix(self.index)}{self.incarnation}-{uuid.uuid4().hex[:12]}"

    async def _retry_loop(self) -> None:
        """Requests no rank took wait here; with no controller to retry them, the ingress does."""
        while True:
            await asyncio.sleep(RETRY_PARKED_S)
            if self.router.parked and not self.router.paused:
                try:
                    await self.router.retry_parked()
                except Exception:  # noqa: BLE001 - the next round tries again
                    pass
