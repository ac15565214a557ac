"""The standby pool: K ranks launched ahead so a scale-up skips its launch phase.

A standby is a rank process started, torch imported, model built and KV allocated, named
``<deployment>_standby<N>`` (engine_ext.rank.standby), in no DP group and serving nothing: its step
loop is not running, so it idles at near-zero CPU. The spawner asks the pool first
(``take``): the standby is adopted as the joiner's DP rank (identity re-based to ``_dp<rank>``)
and the rest are launched as before. After the operation the pool refills in the background;
a standby that died is dropped and replaced, without touching the serving ranks.

Numbers are never taken twice: an adopted standby keeps its name (a Ray actor name cannot
change), so the next number skips those ``in_use`` says live ranks hold, and a restarted
controller continues from the number its durable state kept. A launch that fails is recorded
(``last_error``, which ``eepctl status`` shows) and tried again later, never swallowed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine_ext.control.rank_client import RankClient
from engine_ext.control.world import short_error
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.identity import STANDBY_RANK_BASE

RETRY_S = 10.0  # a failed launch is tried again after this long (by ``watch``)


class StandbyPool:
    """Keeps ``size`` standby ranks ready; one pool per deployment, driven by its spawner."""

    def __init__(
        self,
        size: int,
        launch: Callable[[int], Awaitable[RankClient]],
        alive: Callable[[RankClient], Awaitable[bool]],
        kill: Callable[[RankClient], Awaitable[None]],
        forget: Callable[[int], None],
        busy: Callable[[], bool],
        in_use: Callable[[], set[int]] = set,
    ) -> None:
        self.size = size
        self._launch, self._alive, self._kill, self._forget, self._busy = launch, alive, kill, forget, busy
        self._in_use = in_use  # standby numbers live ranks hold as their (unchangeable) names
        self.ready: dict[int, RankClient] = {}  # standby number -> client
        self.next_number = 0  # durable: a restarted controller continues from here
        self.last_error: dict[str, Any] | None = None  # {at, standby, error}: the last failed launch
        self._retry_at = 0.0
        self._launching = 0
        self._refill: asyncio.Task[None] | None = None
        self.taken = 0  # standbys adopted as joiners, over the pool's life
        self.identity_base: str | None = None  # <base> of <base>_standby<N>, for --dry-run

    async def resize(self, size: int) -> None:
        """``eepctl standby --count``: grow now, or stop the surplus standbys."""
        self.size = size
        while len(self.ready) > size:
            n = max(self.ready)
            await self._kill(self.ready.pop(n))
            self._forget(STANDBY_RANK_BASE + n)
        if len(self.ready) >= size:
            self.last_error = None  # not short any more
        await self.fill()

    def summary(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "ready": sorted(self.ready),
            "launching": self._launching,
            "taken": self.taken,
            "last_error": self.last_error,
        }

    def _take_numbers(self, count: int) -> list[int]:
        used = self._in_use() | set(self.ready)
        numbers: list[int] = []
        while len(numbers) < count:
            n, self.next_number = self.next_number, self.next_number + 1
            if n not in used:
                numbers.append(n)
        return numbers

    async def _drop_dead(self) -> list[int]:
        dead = [n for n, c in list(self.ready.items()) if not await self._alive(c)]
        for n in dead:
            self.ready.pop(n, None)
            self._forget(STANDBY_RANK_BASE + n)
        return dead

    async def fill(self) -> None:
        """Launch standbys until ``size`` are ready (dead ones dropped first)."""
        await self._drop_dead()
        missing = self.size - len(self.ready) - self._launching
        if missing <= 0:
            return
        numbers = self._take_numbers(missing)
        self._launching += missing
        try:
            clients = await asyncio.gather(*(self._launch(n) for n in numbers), return_exceptions=True)
        finally:
            self._launching -= missing
        for n, c in zip(numbers, clients):
            if isinstance(c, BaseException):
                self.last_error = {"at": time.time(), "standby": n, "error": f"{type(c).__name__}: {short_error(c)}"}
                self._retry_at = time.time() + RETRY_S
            else:
                self.ready[n] = c
                self.last_error = None

    async def take(self, rank: int, layout: ExpertLayout) -> RankClient | None:
        """A ready standby adopted as DP rank ``rank``, or None (the spawner launches one)."""
        await self._drop_dead()
        while self.ready:
            n = min(self.ready)
            client = self.ready.pop(n)
            try:
                await client.adopt(rank, layout.to_dict(), timeout=30)
            except Exception:  # noqa: BLE001 - a broken standby is not a failed scale: launch instead
                await self._kill(client)
                self._forget(STANDBY_RANK_BASE + n)
                continue
            self._forget(STANDBY_RANK_BASE + n)
            self.taken += 1
            self.refill_later()
            return client
        self.refill_later()
        return None

    def refill_later(self) -> None:
        """Refill once no operation runs, so new standbys never compete with a transition."""
        if self._refill is None or self._refill.done():
            self._refill = asyncio.get_running_loop().create_task(self._refill_when_idle())

    async def _refill_when_idle(self) -> None:
        while self._busy():
            await asyncio.sleep(0.1)
        await self.fill()

    async def watch(self, interval_s: float = 0.5) -> None:
        """Replace standbys that died, forever (run as a task)."""
        while True:
            await asyncio.sleep(interval_s)
            short = len(self.ready) + self._launching < self.size and time.time() >= self._retry_at
            if await self._drop_dead() or short:  # short: a launch failed; try again
                self.refill_later()

    async def stop(self) -> None:
        if self._refill is not None:
            self._refill.cancel()
        for c in self.ready.values():
            await self._kill(c)
        self.ready.clear()


def mark_pool_joiners(plan: Any, pool: StandbyPool | None) -> None:
    """``--dry-run``: the first joiners come from the pool's ready standbys, in number order."""
    if pool is None:
        return
    for j, n in zip(plan.joining, sorted(pool.ready)):
        j["from_standby"] = standby_identity_of(pool, n)


def standby_identity_of(pool: StandbyPool, n: int) -> str:
    return f"standby{n}" if pool.identity_base is None else f"{pool.identity_base}_standby{n}"
