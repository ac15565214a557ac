"""Joiners take the queue: once a scale-up committed, the old ranks give back the requests still
waiting on them (admitted, not yet prefilled) beyond a fair share of the new width, and the router
sends them on through its normal pick (least in-flight first), so the backlog drains at the new
width instead of on the ranks it queued on.

The fair share is ``ceil(waiting on the old ranks / new width)``: each old rank keeps that many of
its oldest waiting requests and gives back the rest. A rank gives back under the lock its step loop
schedules under, so a request is either given back or prefilled there, never both; the router
then owns it as it owns a request a removing rank hands back (``Router.resubmit``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine_ext.control.world import World, quiet

STATUS_TIMEOUT_S = 5.0
# A give-back is a few microseconds under the rank's lock; the call waits long, because requests a
# rank gave back whose answer never arrives would be answered by nobody (a rank that dies instead
# still owns them in the router, which re-routes them with its death).
GIVE_BACK_TIMEOUT_S = 60.0


def fair_share(waiting: dict[int, int], width: int) -> int:
    """How many waiting requests each old rank keeps: the old ranks' waiting spread over ``width``."""
    total = sum(max(0, n) for n in waiting.values())
    return -(-total // max(1, width))


async def redispatch(world: World, old: list[int], width: int) -> int:
    """Ask each rank of ``old`` (members before the scale-up) for its waiting requests beyond the
    fair share of ``width`` ranks and re-submit them through the router; how many moved."""
    ranks = [r for r in old if r in world.clients]
    statuses = await asyncio.gather(*(quiet(world.clients[r].status(timeout=STATUS_TIMEOUT_S)) for r in ranks))
    waiting = {r: int(st.get("requests_waiting", 0)) for r, st in zip(ranks, statuses) if isinstance(st, dict)}
    keep = fair_share(waiting, width)
    over = [r for r, n in sorted(waiting.items()) if n > keep]
    if not over:
        return 0
    given = await asyncio.gather(
        *(quiet(world.clients[r].give_back_waiting(keep, timeout=GIVE_BACK_TIMEOUT_S)) for r in over)
    )
    wires: list[dict[str, Any]] = [w for g in given if isinstance(g, list) for w in g]
    if wires:
        await world.router.resubmit(wires)
    return len(wires)
