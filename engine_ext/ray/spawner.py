"""Rank actors on Ray: ``RaySpawner`` launches them (each in a placement group of its own, on the
node the deployment's placement policy picks) and ``RayRankClient`` calls them.

``RaySpawner`` is the ``Spawner`` (engine_ext.control.spawner) of the Ray controller.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from engine_ext.config import EngineConfig
from engine_ext.control.rank_client import RankClient
from engine_ext.control.standby_pool import StandbyPool
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.identity import STANDBY_RANK_BASE, dp_suffixed, standby_identity
from engine_ext.protocol import EepError
from engine_ext.ray import leftovers, placement
from engine_ext.ray.leftovers import kill_local as _kill_local
from engine_ext.ray.rank_actor import RankActor


class RayRankClient(RankClient):
    """A rank actor, called through its ``call`` method (checked against RANK_METHODS there)."""

    def __init__(
        self,
        rank: int,
        handle: Any,
        pid: int,
        release: Callable[[], None] | None = None,
        actor_name: str = "",
        node_id: str = "",
    ) -> None:
        self.rank = rank
        self.handle = handle
        self.actor_name = actor_name  # a restarted controller finds the rank by it
        self.node_id = node_id  # on the controller's node, a fence ends the process by pid at once
        self._pid = pid
        self._release = release  # frees the rank's placement group once the rank is gone
        self._watch: asyncio.Task | None = None

    def renumber(self, rank: int, release: Callable[[], None]) -> None:
        """The rank became DP rank ``rank`` (an adopted standby): its placement is released as that."""
        self.rank = rank
        self._release = release

    def watch(self, on_death: Any) -> None:
        """Call ``on_death(rank, cause)`` the moment the actor dies (its pending ``until_dead`` raises)."""

        async def wait() -> None:
            try:
                await self.handle.until_dead.remote()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - RayActorError: the process is gone
                on_death(self.rank, f"actor died: {str(e).strip().splitlines()[0][:200]}")

        self._watch = asyncio.ensure_future(wait())

    def pid(self) -> int:
        return self._pid

    async def _invoke(self, method: str, *args: Any, timeout: float | None) -> Any:
        return await asyncio.wait_for(self.handle.call.remote(method, *args), timeout)

    async def ping(self, *, timeout: float | None = None) -> None:
        """The actor's own ``pid`` method: an answer shows its process and actor runtime alive,
        with no engine code in the way (the status probe goes through the engine)."""
        await asyncio.wait_for(self.handle.pid.remote(), timeout)

    async def kill(self) -> None:
        """End the rank: SIGKILL by pid when it runs on this node (a stopped process too, at
        once), and through Ray in every case; then wait briefly until Ray says it is gone, so
        its name is free for a new rank."""
        _kill_local(self._pid, self.node_id)
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:
            pass
        if self._watch is not None and not self._watch.done():
            await asyncio.wait({self._watch}, timeout=10)
        if self._release is not None:
            self._release()


class RaySpawner:
    """Launches rank actors, each in a placement group of its own on the node the deployment's
    placement policy picks (engine_ext/ray/placement.py)."""

    def __init__(
        self,
        deployment: str,
        namespace: str,
        cfg: EngineConfig,
        cpus: float,
        gpus: float,
        spec: placement.PlacementSpec | None = None,
    ) -> None:
        self.deployment = deployment
        self.namespace = namespace
        self.cfg = cfg
        self.cpus = cpus
        self.gpus = gpus
        self.on_death: Any = lambda rank, cause: None
        self.spec = spec or placement.PlacementSpec()
        self.rank_nodes: dict[int, placement.Node] = {}
        self._pgs: dict[int, Any] = {}
        self._planned: dict[int, placement.Node] = {}  # the last preflight's node per new rank
        self._pooled: dict[int, tuple[int, placement.Node | None]] = {}  # joiner -> (standby, its node)
        self.pool: StandbyPool | None = None  # ranks launched ahead (engine_ext/ray/standby.py)
        self.stale_removed: list[str] = []  # stale resources a launch found holding its names

    def _held(self) -> Counter[str]:
        return Counter(n.node_id for n in self.rank_nodes.values())

    def check_capacity(self, new_ranks: int, ranks: list[int] | None = None) -> str | None:
        """None when the policy can place ``new_ranks`` more ranks, else why not. ``ranks`` are
        the joiners' numbers (the plan's); the first ones are taken from the standby pool, in the
        order it hands them out, and need no new node."""
        self._planned, self._pooled = {}, {}
        if new_ranks <= 0:
            return None
        if ranks is None:  # after the last DP rank (standbys' provisional numbers are not DP ranks)
            first = max((r for r in self.rank_nodes if r < STANDBY_RANK_BASE), default=-1) + 1
            ranks = list(range(first, first + new_ranks))
        ready = sorted(self.pool.ready) if self.pool is not None else []
        self._pooled = {r: (n, self.rank_nodes.get(STANDBY_RANK_BASE + n)) for r, n in zip(ranks, ready)}
        fresh = ranks[len(self._pooled) :]
        if not fresh:
            return None
        try:
            nodes = placement.predict_nodes(self.spec.policy, self._held(), len(fresh), self.cpus, self.gpus)
        except placement.PlacementError as e:
            return str(e)
        self._planned = dict(zip(fresh, nodes))
        return None

    def predicted(self) -> list[dict[str, Any]]:
        """The node of each new rank, as the last check_capacity planned it (for `--dry-run`): a
        standby's own node for a joiner taken from the pool."""
        rows = [{"rank": r, "node_id": n.node_id, "node_ip": n.ip} for r, n in self._planned.items()]
        for r, (n, node) in self._pooled.items():
            rows.append(
                {
                    "rank": r,
                    "node_id": node.node_id if node else None,
                    "node_ip": node.ip if node else None,
                    "from_standby": n,
                }
            )
        return sorted(rows, key=lambda row: row["rank"])

    def adopt_standby(self, client: RayRankClient, rank: int) -> RayRankClient:
        """A standby became DP rank ``rank``: its node and placement group move with it."""
        old = client.rank
        if old in self.rank_nodes:
            self.rank_nodes[rank] = self.rank_nodes.pop(old)
        if old in self._pgs:
            self._pgs[rank] = self._pgs.pop(old)
        client.renumber(rank, release=lambda: self.forget(rank))
        return client

    def forget(self, rank: int) -> None:
        self.rank_nodes.pop(rank, None)
        pg = self._pgs.pop(rank, None)
        if pg is not None:
            placement.release(pg)

    async def spawn(self, rank: int, layout: ExpertLayout, joining: bool) -> RayRankClient:
        """DP rank ``rank``; a joiner is a standby from the pool when one is ready."""
        if joining and self.pool is not None and (c := await self.pool.take(rank, layout)) is not None:
            assert isinstance(c, RayRankClient)
            return self.adopt_standby(c, rank)
        return await self.launch(rank, layout, joining)

    async def launch_standby(self, n: int, layout: ExpertLayout) -> RayRankClient:
        """Standby ``n`` of the pool: a joining rank at a rank number no world uses."""
        return await self.launch(STANDBY_RANK_BASE + n, layout, True, standby=n)

    async def launch(self, rank: int, layout: ExpertLayout, joining: bool, standby: int = -1) -> RayRankClient:
        """A new rank actor in a placement group of its own (``standby`` >= 0: a standby's)."""
        base = self.cfg.instance_id or self.deployment
        identity = dp_suffixed(base, rank) if standby < 0 else standby_identity(base, standby)
        device = "cuda" if self.gpus > 0 else "cpu"
        node = self._planned.pop(rank, None)
        if node is None:
            try:
                node = placement.predict_nodes(self.spec.policy, self._held(), 1, self.cpus, self.gpus)[0]
            except placement.PlacementError as e:
                raise EepError(str(e)) from None
        self.rank_nodes[rank] = node  # before any await: concurrent joiners see this rank's node
        try:
            # No member holds this identity (the caller launches it anew): what holds its names
            # is a stale resource of this deployment, left by a dead controller's attempt.
            stale = await leftovers.free_identity(self.namespace, self.deployment, identity)
            self.stale_removed = (self.stale_removed + stale)[-20:]
            pg = await placement.reserve(node, self.cpus, self.gpus, self.spec.policy, f"{identity}-pg")
        except BaseException:
            self.rank_nodes.pop(rank, None)
            raise
        self._pgs[rank] = pg
        actor = ray.remote(RankActor).options(
            name=identity,
            namespace=self.namespace,
            lifetime="detached",
            num_cpus=self.cpus,
            num_gpus=self.gpus,
            max_concurrency=64,
            max_restarts=0,
            scheduling_strategy=placement.scheduling(pg),
        )
        try:
            handle = actor.remote(
                self.cfg.to_dict(),
                self.deployment,
                self.namespace,
                rank,
                layout.to_dict(),
                joining,
                device,
                self.spec.ifname,
                standby,
            )
        except ValueError as e:  # the name is taken: refuse a duplicate identity (I1)
            self.forget(rank)
            raise EepError(f"identity {identity} is already taken by a live actor: {e}") from None
        try:
            pid = await asyncio.wait_for(handle.pid.remote(), 120)
        except BaseException:
            ray.kill(handle, no_restart=True)
            self.forget(rank)
            raise
        client = RayRankClient(
            rank, handle, pid, release=lambda: self.forget(rank), actor_name=identity, node_id=node.node_id
        )
        client.watch(lambda r, cause: self.on_death(r, cause))
        return client

    async def reattach(self, rank: int, actor_name: str) -> RayRankClient | None:
        """A restarted controller takes back the live rank actor ``actor_name`` as DP rank
        ``rank`` (its placement group is detached and found by name); None when it is gone."""
        from ray.util import get_placement_group

        try:
            handle = ray.get_actor(actor_name, namespace=self.namespace)
            pid = await asyncio.wait_for(handle.pid.remote(), 10)
            st = await asyncio.wait_for(handle.call.remote("status"), 10)
        except Exception:  # noqa: BLE001 - gone, or not answering: the recovery runs without it
            return None
        node = placement.Node(st.get("node_id", ""), st.get("node_ip", ""), self.cpus, self.gpus)
        self.rank_nodes[rank] = node
        try:
            self._pgs[rank] = get_placement_group(f"{actor_name}-pg")
        except Exception:  # noqa: BLE001 - an adopted standby's group has its standby name
            pass
        client = RayRankClient(
            rank, handle, pid, release=lambda: self.forget(rank), actor_name=actor_name, node_id=node.node_id
        )
        client.watch(lambda r, cause: self.on_death(r, cause))
        return client
