"""What a controller writes down so that a restarted one can take over, and how it takes over.

``snapshot`` is the durable state (engine_ext.ray.durable): the desired spec, the members with
their actor names and the world's epoch, the store, the layout, the fenced ranks, the operation
log with the running operation's last recorded phase, the idempotency keys, the controller's
own events and the points of the cost model learned from the deployment's scales. ``take_over``
is the restarted controller's first act: re-attach to the live rank actors by name, remove every
rank actor and placement group of the deployment that no member holds (a joiner of the
interrupted scale, its reservation, a dead member's, a standby: the pool refills), then settle the
interrupted operation — one that had not begun commit is rolled back; one that had is driven to a
consistent world by a recovery that restores every expert from the weight source.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_ext.control.cost_learn import LearnedCost
from engine_ext.control.rank_client import GoneRankClient, RankClient
from engine_ext.control.world import quiet
from engine_ext.elastic.eplb import ExpertLayout
from engine_ext.elastic.identity import STANDBY_RANK_BASE, standby_number
from engine_ext.protocol import Operation, OpState, Phase
from engine_ext.ray import leftovers
from engine_ext.records import from_builtins

if TYPE_CHECKING:
    from engine_ext.control.orchestrator import Orchestrator
    from engine_ext.ray.spawner import RaySpawner

STATE_VERSION = 1
_AFTER_COMMIT = (Phase.COMMIT.value, Phase.CLEANUP.value)


def snapshot(orch: Orchestrator, **extra: Any) -> dict[str, Any]:
    """The controller's durable state (JSON-ready)."""
    w = orch.world
    running = w.running_op()
    return {
        "version": STATE_VERSION,
        "desired": orch.desired,
        "members": list(w.members),
        "actors": {str(r): getattr(c, "actor_name", "") for r, c in w.clients.items()},
        "epoch": w.epoch,
        "serving_epoch": w.serving_epoch,
        "store": list(w.store) if w.store else None,
        "store_host": w.store_host,
        "layout": w.layout.to_dict() if w.layout else None,
        "fenced": {str(r): f for r, f in w.fenced.items()},
        "history": w.history[-100:],
        "running": running.op_id if running is not None else None,
        "cost_fit": orch.admission.learned.to_dict(),  # the points of the deployment's own cost model
        **extra,
    }


def restore_learned(orch: Orchestrator, state: dict[str, Any] | None) -> None:
    """The cost model the deployment learned from its own scales, as the durable state kept it."""
    orch.admission.learned = LearnedCost.from_dict((state or {}).get("cost_fit"))


async def take_over(orch: Orchestrator, spawner: RaySpawner, state: dict[str, Any]) -> list[str]:
    """Re-attach to the world ``state`` describes, remove every rank resource of the deployment
    that no re-attached member holds (found from Ray's state: engine_ext.ray.leftovers), and
    settle the interrupted operation. Returns what it did."""
    w, done = orch.world, []
    orch.desired = int(state.get("desired", 0))
    w.epoch, w.serving_epoch = int(state.get("epoch", 0)), int(state.get("serving_epoch", 0))
    w.fenced = {int(r): f for r, f in (state.get("fenced") or {}).items()}
    w.history = list(state.get("history") or [])
    # Not restored: ``rerouted_base`` is a baseline of this process's router count, which starts
    # at 0 again here (the old process's baseline would make the count negative).
    if state.get("store"):
        w.move_store((state["store"][0], int(state["store"][1])), int(state.get("store_host", 0)))
    actors = state.get("actors") or {}
    clients: dict[int, RankClient] = {}
    gone: list[int] = []
    for r in state.get("members") or []:
        name = actors.get(str(r), "")
        client = await spawner.reattach(r, name) if name else None
        if client is None:
            clients[r] = GoneRankClient(r, "gone when the controller restarted")
            gone.append(r)
        else:
            clients[r] = client
    if state.get("layout"):
        w.adopt(clients, ExpertLayout.from_dict(state["layout"]), w.serving_epoch)
    done.append(
        f"re-attached to rank(s) {sorted(set(clients) - set(gone))}" + (f"; rank(s) {gone} gone" if gone else "")
    )
    # Not what the dead controller remembered: a joiner's group reserved before its actor
    # existed, a dead member's group, a standby (the pool refills) are all found by name, in a
    # thread (the whole placement group table is read once: a reservation may have no actor).
    kept = [n for c in clients.values() if (n := getattr(c, "actor_name", ""))]
    removed = await asyncio.to_thread(leftovers.remove_unheld, spawner.namespace, spawner.deployment, kept)
    left = await leftovers.wait_gone(spawner.namespace, spawner.deployment, removed)
    for item in removed:  # status must not list an ended standby as ready
        kind, _, name = item.rpartition(" ")
        if kind == "actor" and (n := standby_number(spawner.deployment, name)) is not None:
            w.forget_rank(STANDBY_RANK_BASE + n)
    if removed:
        done.append(
            f"removed what no member holds: {', '.join(removed)}"
            + (f" (still held: {', '.join(left)})" if left else "")
        )
    done += await _settle(orch, state)
    for r in gone:
        orch.recovery.on_death(r, "gone when the controller restarted")
    return done


async def _settle(orch: Orchestrator, state: dict[str, Any]) -> list[str]:
    """The operation that was running when the controller died: rolled back before commit,
    recovered from commit on."""
    w = orch.world
    running = state.get("running")
    rec = next((h for h in reversed(w.history) if h.get("op_id") == running), None) if running else None
    if rec is None:
        return []
    op = from_builtins(rec, Operation)
    w.op = op
    if op.kind == "scale":  # a scale that did not finish leaves the desired size as it was
        orch.desired = op.from_size
    phase = op.phase
    if op.kind == "scale" and phase not in _AFTER_COMMIT:
        t = time.time()
        for c in list(w.clients.values()):
            await quiet(c.abort(op.op_id, timeout=10))
        op.state, op.error_code = OpState.ROLLED_BACK.value, 5
        op.error = f"the controller restarted while the scale was in phase {phase}: rolled back"
        w.phase_done(op, Phase.ROLLBACK.value, t)
        action = f"rolled back {op.op_id} (interrupted in {phase})"
    else:
        op.state, op.error_code = OpState.FAILED.value, 5
        op.error = (
            f"the controller restarted while the {op.kind} was in phase {phase}: the world is "
            "rebuilt by a recovery (every expert restored from the weight source)"
        )
        orch.recovery.rebuild(f"{op.op_id} interrupted by a controller restart in {phase}", untrusted=True)
        action = f"recovering after {op.op_id} (interrupted in {phase})"
    op.finished = time.time()
    w.record(op)
    return [action]


async def sweep_orphans(orch: Orchestrator, spawner: RaySpawner, namespace: str, deployment: str) -> list[str]:
    """While no operation runs, end DP rank actors and remove DP placement groups of the
    deployment that no member holds (a joiner a dead controller was launching, which finished
    starting after the take-over). The standby pool's are left alone: it may be launching one."""
    if orch.world.op_lock.locked():
        return []
    kept = [n for c in orch.clients.values() if (n := getattr(c, "actor_name", ""))]
    # Looked up by the deployment's names only (its namespace's named actors, their placement
    # groups by name), in a thread: the controller's loop never waits on Ray's state.
    removed = await asyncio.to_thread(
        leftovers.remove_unheld, namespace, deployment, kept, standbys=False, everything=False
    )
    return [f"removed orphaned {r}" for r in removed]


async def forget_unheld_ranks(registry: Callable[[], Any], members: set[int]) -> list[str]:
    """The registry's records of ranks that are not members (the interrupted scale's joiners,
    standbys): a restarted controller removes them with their actors."""
    try:
        handle = registry()
        ranks = (await asyncio.wait_for(handle.snapshot.remote(), 10)).get("ranks") or []
        gone = sorted({int(r["rank"]) for r in ranks} - members)
        for r in gone:
            handle.forget_rank.remote(r)
    except Exception:  # noqa: BLE001 - a registry being recreated starts without them
        return []
    return [f"forgot the registry records of rank(s) {gone}"] if gone else []
