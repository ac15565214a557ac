"""The standby pool on Ray (engine_ext.control.standby_pool): standby rank actors launched by the
RaySpawner under the actor name ``<base>_standby<N>`` (a Ray actor name cannot change, so an
adopted rank keeps it while its identity becomes ``_dp<rank>``), each in a placement group of its
own that moves to the DP rank it becomes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine_ext.elastic.identity import strip_dp_suffix
from engine_ext.control.standby_pool import StandbyPool
from engine_ext.elastic.identity import STANDBY_RANK_BASE

if TYPE_CHECKING:
    from engine_ext.control.rank_client import RankClient
    from engine_ext.ray.controller import Controller, RaySpawner, RayRankClient


async def _alive(client: RankClient) -> bool:
    try:
        await client.status(timeout=10)
        return True
    except Exception:  # noqa: BLE001 - an actor that does not answer is replaced
        return False


def make_pool(ctl: Controller, size: int) -> StandbyPool:
    """The controller's pool: launches through its spawner, refills when no operation runs."""
    async def launch(n: int) -> Any:
        assert ctl.orch.layout is not None
        return await ctl.spawner.spawn(STANDBY_RANK_BASE + n, ctl.orch.layout, True, standby=n)

    async def kill(c: RankClient) -> None:
        await c.kill()  # type: ignore[attr-defined]

    pool = StandbyPool(size, launch, _alive, kill, ctl._forget_rank, lambda: ctl.orch.running_op() is not None)
    pool.identity_base = strip_dp_suffix(ctl.cfg.instance_id or ctl.deployment)
    return pool


def adopt_placement(spawner: RaySpawner, client: RayRankClient, rank: int) -> RayRankClient:
    """Move the standby's node and placement group to the DP rank it became."""
    old = client.rank
    if old in spawner.rank_nodes:
        spawner.rank_nodes[rank] = spawner.rank_nodes.pop(old)
    if old in spawner._pgs:
        spawner._pgs[rank] = spawner._pgs.pop(old)
    client.rank = rank
    client._release = lambda: spawner.forget(rank)
    return client
