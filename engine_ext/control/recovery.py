"""The controller side of self-healing: a rank's death becomes a ``recover`` operation.

A death is reported by the transport that saw it (Ray: the rank actor's ``until_dead`` call
raised; the launcher: the rank's pipe closed). The router stops sending (requests wait in it),
the dead rank's requests are queued for re-submission with their tokens so far, and, in single
flight with scales, the survivors rebuild the world without the dead ranks (a new store if its
host died), restore the experts, re-warm, capture once and serve. Policy ``replace`` then grows
back to the desired size through the normal scale-up path (the orchestrator's ``regrow``, the
one growth path, which the reconcile loop takes too).

What the recovery may change, all through ``World`` (engine_ext.control.world): the members,
their clients and layout (``adopt``, with the survivors), the store (``move_store``, when its
host died), the router (exclude, pause, reroute, resume, fail requests) and the operation
record. It never scales by itself: ``regrow`` decides that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine_ext.config import EngineConfig
from engine_ext.control.world import World, quiet
from engine_ext.elastic.eplb import ExpertLayout, build_layout, min_world_size
from engine_ext.elastic.transition_plan import TransitionPlan, new_op_id
from engine_ext.faults import variant_on
from engine_ext.protocol import Operation, OpState, to_builtins

RANK_RECOVER_TIMEOUT_S = 90.0  # shorter than gloo's 300 s: a stuck recovery fails, it never hangs


@dataclass
class Growth:
    """What policy ``replace``'s growth back to the desired size did (``Orchestrator.regrow``)."""

    target: int = 0  # the size it grows to; 0: no growth is due
    op: dict[str, Any] | None = None  # the scale it ran, however that ended
    no_capacity: str = ""  # why the new ranks cannot be placed now (no scale started)
    refused: str = ""  # why admission refused the scale (no scale started)


class Recovery:
    """Dead ranks, and the recovery operations that replace them."""

    def __init__(self, world: World, cfg: EngineConfig, regrow: Callable[[], Awaitable[Growth]]) -> None:
        self.world = world
        self.cfg = cfg
        self.regrow = regrow  # policy replace: grow back to the desired size (its ``op``: None when none ran)
        self.dead: dict[int, dict[str, Any]] = {}  # global rank -> {cause, at}
        self._task: asyncio.Task | None = None
        self.recovered = 0
        self.last_recovery_s = 0.0
        self.rebuild_reason = ""  # a rebuild is due although no member died (a failed commit)
        self.untrusted = False
        # Why the last recovery failed, until a rebuild from the weight source succeeds: the
        # reconcile loop rebuilds the world while requests wait in the router.
        self.failed_reason = ""
        self.rerouted_base = 0  # the router's re-route count when the last recovery ended

    def on_death(self, rank: int, cause: str) -> None:
        """A rank's process is gone. Called on the controller's event loop."""
        o = self.world
        if o.stopping or rank in self.dead or rank not in o.members:
            return  # a joiner of a running scale fails that scale; its rollback cleans up
        self._mark_dead(rank, cause)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def _mark_dead(self, rank: int, cause: str) -> None:
        """Out of the router's choice; its requests wait for a survivor with their tokens so far."""
        o = self.world
        self.dead[rank] = {"rank": rank, "cause": cause, "at": time.time()}
        o.router.exclude(rank)
        o.router.pause()
        if not variant_on(self.cfg.faults, "no_reroute"):
            o.router.reroute({rank})

    def rebuild(self, reason: str, *, untrusted: bool) -> None:
        """Rebuild the members' world although none died (a scale failed inside its commit)."""
        self.rebuild_reason = reason
        self.untrusted = self.untrusted or untrusted
        self.world.router.pause()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        await asyncio.sleep(0.2)  # deaths of one incident arrive together: recover them at once
        replaced = False
        for _ in range(4):
            if any(r in self.world.members for r in self.dead) or self.rebuild_reason:
                done = await self.recover()
                if done.get("state") != OpState.SUCCEEDED.value and not self._died_during(done.get("dead_ranks", [])):
                    return  # reported in the operation; `eepctl repair` takes it from here
            elif not replaced:
                replaced = True  # once per incident: a replacement that fails is not retried in a loop
                if (await self.regrow()).op is None:  # a failure in its commit asks for one more rebuild
                    return
            else:
                return

    def running(self) -> bool:
        """Whether a recovery (or the replacement it started) runs now."""
        return self._task is not None and not self._task.done()

    def _died_during(self, dead: list[int]) -> bool:
        """A member died while the recovery of ``dead`` ran (and failed it): recover again."""
        return any(r in self.world.members and r not in dead for r in self.dead)

    async def wait(self) -> None:
        """Until no recovery (nor the replacement it started) runs."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def recover(self) -> dict[str, Any]:
        """One recovery operation, in single flight with scales."""
        o = self.world
        async with o.op_lock:
            await self._probe()
            dead = [r for r in o.members if r in self.dead]
            if not dead and not self.rebuild_reason:
                return {}
            survivors = [r for r in o.members if r not in self.dead]
            first_death = min([self.dead[r]["at"] for r in dead] or [time.time()])
            untrusted = tuple(survivors) if self.untrusted else ()
            self.rebuild_reason, self.untrusted = "", False
            op = Operation(new_op_id(), o.name, len(o.members), len(survivors), kind="recover", dead_ranks=dead)
            op.rerouted_requests = o.router.rerouted - self.rerouted_base
            o.op = op
            o.phase_done(
                op, "detect", first_death, time.time(), dead=dead, causes={str(r): self.dead[r]["cause"] for r in dead}
            )
            try:
                await asyncio.wait_for(self._rebuild(op, survivors, untrusted), RANK_RECOVER_TIMEOUT_S + 30)
                op.state = OpState.SUCCEEDED.value
                self.recovered += 1
                self.last_recovery_s = time.time() - first_death
            except Exception as e:  # noqa: BLE001 - reported in the operation record
                op.state, op.error_code = OpState.FAILED.value, 5
                last_line = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
                op.error = f"recovery failed: {type(e).__name__}: {last_line}"
                # A survivor that died in it may not be reported yet (its pipe or actor's end
                # arrives after the call that failed on it): without this probe the failure read
                # as "no healthy world" and the whole world was rebuilt to the desired size.
                await self._probe()
                if not self._died_during(dead):  # else a member died in it: the next recovery takes the requests
                    # No healthy world: the reconcile loop rebuilds it from the weight source.
                    # Requests (the survivors' own too) wait in the router, up to its bound.
                    self.failed_reason = f"{op.op_id} failed: {op.error}"
                    o.router.reroute(set(o.members))
                    o.router.unhealthy = f"no healthy rank ({op.op_id} failed; rebuilding from the weight source)"
            finally:
                op.finished = time.time()
                self.rerouted_base = o.router.rerouted
                o.record(op)
            return to_builtins(op)

    async def _probe(self) -> None:
        """Members not known dead that do not answer a status call in 3 s count as dead."""
        o = self.world
        alive = [r for r in o.members if r not in self.dead]
        probes = await asyncio.gather(*(quiet(o.clients[r].status(timeout=3)) for r in alive))
        for r, st in zip(alive, probes):
            if not isinstance(st, dict) and r not in self.dead:  # no answer: as good as dead
                self._mark_dead(r, f"did not answer: {st}")

    async def _rebuild(self, op: Operation, survivors: list[int], untrusted: tuple[int, ...]) -> None:
        o, cfg = self.world, self.cfg
        assert o.layout is not None
        need = min_world_size(cfg.num_experts, cfg.slots_per_rank)
        if len(survivors) < need:
            raise RuntimeError(
                f"{len(survivors)} surviving rank(s) cannot hold {cfg.num_experts} experts "
                f"({need} needed); `eepctl repair` or `eepctl up` again"
            )
        old_members = list(o.members)
        for r in op.dead_ranks:
            await quiet(o.clients[r].kill())
        # the store died with its host: a survivor hosts a new one
        if o.store_host in op.dead_ranks and not variant_on(cfg.faults, "no_store_rehost"):
            t = time.time()
            o.move_store(await o.clients[survivors[0]].host_store(timeout=30), survivors[0])
            o.phase_done(op, "regroup", t, time.time(), new_store_host=survivors[0])
        old = o.layout
        kept = tuple(e for r in survivors for e in old.local_logical(old_members.index(r)))
        previous = ExpertLayout(old.num_logical, old.slots_per_rank, len(survivors), kept)
        new_layout = build_layout(old.num_logical, old.slots_per_rank, len(survivors), None, previous)
        plan = TransitionPlan(
            op_id=op.op_id,
            kind="recover",
            old_size=len(old_members),
            new_size=len(survivors),
            rdzv=o.rendezvous(op.op_id),
            old_layout=old,
            new_layout=new_layout,
            timeout_s=RANK_RECOVER_TIMEOUT_S,
            old_members=tuple(old_members),
            new_members=tuple(survivors),
            untrusted=untrusted,
        )
        op.plan = {"members": survivors, "dead": op.dead_ranks, "layout": new_layout.to_dict()}
        t = time.time()
        clients = {r: o.clients[r] for r in survivors}
        results = await World.call_all(clients, "recover", lambda c: c.recover(plan, timeout=RANK_RECOVER_TIMEOUT_S))
        end = time.time()
        restored: set[int] = set()
        for r, res in results.items():
            op.captures_per_rank[str(r)] = int(res.get("captures_this_op", 0))
            op.workspace_after[str(r)] = int(res.get("workspace_after", 0))
            op.serving_pause_s = max(op.serving_pause_s, float(res.get("pause_s", 0.0)))
            restored.update(res.get("restored_from_weight_source", []))
        spans = [res.get("phase_s", {}) for res in results.values()]
        for name in ("abort", "regroup", "restore_experts", "warm+capture"):
            op.phase_durations[name] = round(max((s.get(name, 0.0) for s in spans), default=0.0), 6)
        o.phase_done(op, "rebuild", t, end, restored_from_weight_source=sorted(restored))
        for r in op.dead_ranks:
            o.forget_rank(r)
        t = time.time()
        o.adopt(clients, new_layout, plan.rdzv.epoch)
        op.rerouted_requests = o.router.rerouted - self.rerouted_base
        await o.router.resume()
        o.phase_done(op, "resume", t, time.time(), rerouted=op.rerouted_requests)
