"""What the orchestrator needs from whatever starts rank processes: Ray actors
(``engine_ext.ray.controller.RaySpawner``) or local processes (``engine_ext.launcher.ProcessSpawner``).

A spawner also owns the deployment's standby pool, if it has one: ``spawn`` of a joiner asks
the pool first, and ``pool`` is what ``--dry-run`` shows the joiners taken from it.
"""

from __future__ import annotations

from typing import Protocol

from engine_ext.control.rank_client import RankClient
from engine_ext.control.standby_pool import StandbyPool
from engine_ext.elastic.eplb import ExpertLayout


class Spawner(Protocol):
    async def spawn(self, rank: int, layout: ExpertLayout, joining: bool) -> RankClient:
        """DP rank ``rank`` of ``layout``, started (a joiner may be a standby adopted from the pool)."""

    def check_capacity(self, new_ranks: int, ranks: list[int] | None = None) -> str | None:
        """None if the cluster can host ``new_ranks`` more ranks (numbered ``ranks``, the plan's
        joiners, when given), else the reason."""

    @property
    def pool(self) -> StandbyPool | None:
        """The standby ranks launched ahead, or None when the deployment keeps none."""
