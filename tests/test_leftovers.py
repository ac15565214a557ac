"""The controller's looks at Ray's state (engine_ext.ray.leftovers, through controller_memory) run
off its event loop: the loop keeps serving while one is slow. No cluster: a stand-in for Ray's
answer that takes a second (a GCS under load) is the one thing replaced; test_leftovers_ray.py
runs the real lookups against a crowded cluster."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from engine_ext.ray import controller_memory, leftovers


def test_the_orphan_sweep_leaves_the_event_loop_free(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_gcs(namespace: str, deployment: str, keep: list[str], **kw: object) -> list[str]:
        time.sleep(1.0)
        return [f"actor {deployment}_dp3"]

    monkeypatch.setattr(leftovers, "remove_unheld", slow_gcs)
    orch = SimpleNamespace(world=SimpleNamespace(op_lock=asyncio.Lock()), clients={})

    async def scenario() -> tuple[list[str], int]:
        done, turns = False, 0

        async def other_work() -> None:  # what the controller's loop also serves: status, scales
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0.01)

        worker = asyncio.ensure_future(other_work())
        await asyncio.sleep(0)
        removed = await controller_memory.sweep_orphans(orch, None, "ns", "dep")  # type: ignore[arg-type]
        done = True
        await worker
        return removed, turns

    removed, turns = asyncio.run(scenario())
    assert removed == ["removed orphaned actor dep_dp3"]
    assert turns >= 5, f"the loop ran {turns} time(s) while the sweep waited on Ray's state: it was blocked"
