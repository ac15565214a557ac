"""Helpers shared by the engine tests (not a test module: nothing here is collected)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """Run a scenario in a fresh event loop, bounded so a hang fails instead of blocking CI."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def oracle_mismatch(
    pairs: list[tuple[int, dict]], ref: list[dict], *, rel_tol: float = 1e-9, logits: bool = True
) -> str:
    """'' when every (prompt index, result) equals the oracle's greedy tokens (and logits), else why not."""
    for idx, got in pairs:
        if got.get("error"):
            return f"request for prompt {idx} failed: {got['error']}"
        want = ref[idx]
        if got["output"] != want["output"]:
            return f"prompt {idx}: tokens {got['output']} != oracle {want['output']}"
        if logits:
            for a, b in zip(got["logits"], want["logits"], strict=True):
                if not math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0):
                    return f"prompt {idx}: logit {a!r} != oracle {b!r}"
    return ""


async def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


async def wait_decoding(dep: Any, rank: int) -> None:
    """Return once ``rank``'s live status (of a ``LocalDeployment``) shows requests that have run two
    more steps since it was first seen holding them: each of those has tokens to continue with, so a
    kill now must move requests that resume with them."""
    client = dep.orch.router.clients[rank]
    first: int | None = None
    while True:
        st = await client.status(timeout=10)
        if st["requests_running"] > 0:
            if first is None:
                first = st["steps"]
            elif st["steps"] >= first + 2:
                return
        await asyncio.sleep(0.005)  # poll interval of the wait, not a synchronisation


class OneRank:
    """A world-1 RankEngine driven step by step in this process (no group, no threads): the real
    scheduler, step loop, replay path and warm-up, so a test can act between two steps."""

    def __init__(self, cfg: Any, experts: int | None = None) -> None:
        from engine_ext.elastic.eplb import build_layout
        from engine_ext.rank.engine import RankEngine

        self.results: dict[str, dict] = {}
        n = experts or cfg.num_experts
        self.engine = RankEngine(cfg, "one", 0, build_layout(n, cfg.slots_per_rank, 1), sink=self._sink)
        self.engine.warm_and_capture("startup")

    def _sink(self, kind: str, payload: dict) -> None:
        if kind == "results":
            for r in payload["results"]:
                self.results[r["request_id"]] = r

    def add(self, prompts: list[list[int]], max_tokens: int) -> None:
        for i, p in enumerate(prompts):
            self.engine.add_request({"request_id": str(i), "prompt": p, "max_tokens": max_tokens})

    def steps(self, n: int | None = None) -> None:
        """Run ``n`` steps (None: until no work is left)."""
        e = self.engine
        done = 0
        while e.sched.has_work and (n is None or done < n):
            items = e.sched.schedule()
            e.loop.step(items, e.loop.header(items))
            done += 1

    def outputs(self, count: int) -> list[dict]:
        return [self.results[str(i)] for i in range(count)]


def watch_reported_states(dep: Any) -> dict[int, set[str]]:
    """Every state each rank of a ``LocalDeployment`` reported, as its registry received them
    (the reports themselves are passed on unchanged)."""
    seen: dict[int, set[str]] = {}
    report = dep.registry.report_status

    def spy(status: dict) -> dict:
        seen.setdefault(status["rank"], set()).add(status["state"])
        return report(status)

    dep.registry.report_status = spy
    return seen


def watch_reported_reasons(dep: Any, state: str) -> dict[int, list[str]]:
    """Every reason each rank of a ``LocalDeployment`` gave when it reported ``state``."""
    seen: dict[int, list[str]] = {}
    report = dep.registry.report_status

    def spy(status: dict) -> dict:
        if status["state"] == state:
            seen.setdefault(status["rank"], []).append(status.get("state_reason", ""))
        return report(status)

    dep.registry.report_status = spy
    return seen


async def kill_between_steps(
    dep: Any, victim: int, prompts: list[list[int]], max_tokens: int, bound_s: float, report_delay_s: float = 3.0
) -> list[dict | None]:
    """SIGKILL ``victim`` (of a ``LocalDeployment``) while the world is idle, its death reported
    ``report_delay_s`` late (as Ray reports it), and submit every prompt at once: the survivors
    wake into the next step's header all-reduce before any recovery. On gloo that is a ring: the
    dead rank's right-hand neighbour fails on its connection, and a survivor after it waits on a
    survivor that left (only a group abort releases it). Each result within ``bound_s``, or None."""
    import os
    import signal

    dep.death_report_delay_s = report_delay_s
    await asyncio.sleep(1.0)  # the world sleeps on its store (no step in flight)
    os.kill(dep.processes[victim].pid(), signal.SIGKILL)
    tasks = [asyncio.ensure_future(dep.generate(p, max_tokens)) for p in prompts]
    await asyncio.sleep(0.5)  # the victim's pipe reader took the delay; later deaths are told at once
    dep.death_report_delay_s = 0.0
    _, pending = await asyncio.wait(tasks, timeout=bound_s)
    return [None if t in pending else t.result() for t in tasks]
