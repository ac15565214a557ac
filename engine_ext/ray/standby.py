"""The standby pool on Ray (engine_ext.control.standby_pool): standby rank actors launched by the
RaySpawner under the actor name ``<base>_standby<N>`` (a Ray actor name cannot change, so an
adopted rank keeps it while its identity becomes ``_dp<rank>``), each in a placement group of its
own that moves to the DP rank it becomes (``RaySpawner.spawn``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_ext.control.rank_client import RankClient
from engine_ext.control.standby_pool import StandbyPool
from engine_ext.control.world import World
from engine_ext.elastic.identity import standby_number, strip_dp_suffix

if TYPE_CHECKING:
    from engine_ext.ray.spawner import RaySpawner


async def _alive(client: RankClient) -> bool:
    try:
        await client.status(timeout=10)
        return True
    except Exception:  # noqa: BLE001 - an actor that does not answer is replaced
        return False


async def _kill(client: RankClient) -> None:
    await client.kill()


def make_pool(spawner: RaySpawner, world: World, forget: Callable[[int], None], size: int) -> StandbyPool:
    """A deployment's pool: launches through its spawner for the world's layout, refills when no
    operation runs; ``forget`` drops a standby's record from the registry."""

    async def launch(n: int) -> RankClient:
        assert world.layout is not None
        return await spawner.launch_standby(n, world.layout)

    base = strip_dp_suffix(spawner.cfg.instance_id or spawner.deployment)

    def in_use() -> set[int]:  # adopted standbys keep their actor names: <base>_standby<N>
        numbers = (standby_number(base, getattr(c, "actor_name", "")) for c in world.clients.values())
        return {n for n in numbers if n is not None}

    pool = StandbyPool(size, launch, _alive, _kill, forget, lambda: world.running_op() is not None, in_use)
    pool.identity_base = base
    return pool
