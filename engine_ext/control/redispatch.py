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

from engine_ext.control.world import World, quiet

STATUS_TIMEOUT_S = 5.0
# No bound on a give-back's answer: the rank took the requests out before it answered, so an answer
# given up on would leave them answered by nobody. A rank that dies (or is fenced and killed) instead
# fails the call, and the router, which still routes those requests to it, re-routes them with its death.
GIVE_BACK_TIMEOUT_S: float | None = None
# How long a scale waits for the count; the give-backs and their re-submits run on past it, in a
# task of their own that neither this wait nor the scale's own timeout cancels.
COUNT_WAIT_S = 10.0
_moving: set[asyncio.Task] = set()  # the running moves (the loop keeps only weak references to tasks)


def fair_share(waiting: dict[int, int], width: int) -> int:
    """How many waiting requests each old rank keeps: the old ranks' waiting spread over ``width``."""
    total = sum(max(0, n) for n in waiting.values())
    return -(-total // max(1, width))


async def redispatch(world: World, old: list[int], width: int) -> int:
    """Ask each rank of ``old`` (members before the scale-up) for its waiting requests beyond the
    fair share of ``width`` ranks and re-submit them through the router; how many moved (0 when the
    count is not known within ``COUNT_WAIT_S``: the moves still complete)."""
    ranks = [r for r in old if r in world.clients]
    statuses = await asyncio.gather(*(quiet(world.clients[r].status(timeout=STATUS_TIMEOUT_S)) for r in ranks))
    waiting = {r: int(st.get("requests_waiting", 0)) for r, st in zip(ranks, statuses) if isinstance(st, dict)}
    keep = fair_share(waiting, width)
    over = [r for r, n in sorted(waiting.items()) if n > keep]
    if not over:
        return 0
    task = asyncio.ensure_future(_move(world, over, keep))
    _moving.add(task)
    task.add_done_callback(_moving.discard)
    try:
        return await asyncio.wait_for(asyncio.shield(task), COUNT_WAIT_S)
    except asyncio.TimeoutError:
        return 0


async def _move(world: World, ranks: list[int], keep: int) -> int:
    async def one(rank: int) -> int:
        client = world.clients[rank]
        given = await quiet(client.give_back_waiting(keep, timeout=GIVE_BACK_TIMEOUT_S))
        return await world.router.resubmit_from(rank, given) if isinstance(given, list) and given else 0

    return sum(await asyncio.gather(*(one(r) for r in ranks)))
