"""What a deployment owns on Ray, found from Ray's own state, and the removal of what no member holds.

A controller that dies in the middle of an operation forgets what it was creating: a joiner's
placement group reserved before its actor existed, a dead member's group, a standby. Its
successor, and ``eepctl down`` with no controller at all, find them by what the deployment owns —
the names Ray's GCS lists in the deployment's namespace: rank actors ``<name>_dp<r>`` and
``<name>_standby<n>``, and their placement groups ``<actor>-pg`` — never by what the dead
controller remembered, and remove every one that no member holds. A second pass finds nothing
(idempotent). Ray is imported inside the functions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine_ext.elastic.identity import standby_number
from engine_ext.ray import ray_private
from engine_ext.ray.names import is_rank_actor

PG_SUFFIX = "-pg"


def pg_name(actor_name: str) -> str:
    """The placement group of the rank actor ``actor_name`` (an adopted standby keeps its standby name)."""
    return actor_name + PG_SUFFIX


@dataclass
class Owned:
    """A deployment's rank resources as Ray lists them now."""

    actors: list[str] = field(default_factory=list)  # live named rank actors (DP ranks and standbys)
    placement_groups: dict[str, str] = field(default_factory=dict)  # name -> id (hex), not removed

    def names(self) -> set[str]:
        return set(self.actors) | set(self.placement_groups)


def _actor_names(namespace: str, deployment: str) -> list[str]:
    """The deployment's live rank actors: the named actors Ray lists in ``namespace`` (asked of the
    GCS for that namespace alone where this process runs in it), filtered by name."""
    from ray.util import list_named_actors

    import ray

    if ray.get_runtime_context().namespace == namespace:
        names = list_named_actors()
    else:
        names = [a["name"] for a in list_named_actors(all_namespaces=True) if a.get("namespace") == namespace]
    return sorted(n for n in names if is_rank_actor(deployment, n))


def _pg_id(name: str) -> str | None:
    """The id (hex) of the placement group named ``name`` in this process's namespace (the one
    its creator, the deployment's controller, ran in), or None."""
    from ray.util import get_placement_group

    try:
        return get_placement_group(name).id.hex()
    except ValueError:
        return None


def _rank_pg_names(deployment: str) -> set[str]:
    """The names of the deployment's rank placement groups in Ray's whole table (one read)."""
    from ray.util import placement_group_table

    names = {str(info.get("name") or "") for info in placement_group_table().values() if info.get("state") != "REMOVED"}
    return {n for n in names if n.endswith(PG_SUFFIX) and is_rank_actor(deployment, n[: -len(PG_SUFFIX)])}


def owned(namespace: str, deployment: str, *, everything: bool = True) -> Owned:
    """Every rank actor of ``deployment`` in ``namespace`` and their placement groups, looked up by
    name. ``everything``: also a placement group whose actor never existed or is gone (a dead
    controller's reservation), found in Ray's placement group table (one read of the whole table:
    ``eepctl down`` and a controller's take-over, not its periodic sweep)."""
    actors = _actor_names(namespace, deployment)
    names = {pg_name(a) for a in actors} | (_rank_pg_names(deployment) if everything else set())
    pgs = {n: pg_id for n in sorted(names) if (pg_id := _pg_id(n)) is not None}
    return Owned(actors, pgs)


def kill_local(pid: int, node_id: str) -> None:
    """SIGKILL ``pid`` if it is a rank actor's process on this node (Ray's own kill of a stopped
    process waits out a grace period first)."""
    import os
    import signal

    import ray

    if pid <= 0 or not node_id or node_id != ray.get_runtime_context().get_node_id():
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"RankActor" not in f.read():
                return  # the pid was reused by another process
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _kill_actor(namespace: str, name: str) -> None:
    """End the named actor: SIGKILL by pid when it runs on this node (a SIGSTOPped process too,
    at once), and through Ray in every case."""
    import ray

    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    try:
        kill_local(*ray_private.actor_process(ray_private.actor_id(handle)))
    except Exception:  # noqa: BLE001 - Ray's kill below still ends it
        pass
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _remove_pg(pg_id: str) -> None:
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    import ray

    try:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    except Exception:  # noqa: BLE001 - already removed
        pass


def remove_unheld(
    namespace: str, deployment: str, keep: Collection[str], *, standbys: bool = True, everything: bool = True
) -> list[str]:
    """End every rank actor and remove every rank placement group of ``deployment`` that the
    actors named in ``keep`` do not hold (``standbys`` False: leave the standby pool's, which may
    be launching one; ``everything`` as :func:`owned`). Returns what it removed ("actor X",
    "placement group X-pg"); removal is asked of Ray here, :func:`wait_gone` waits until the names
    are free. Blocking: the controller runs it in a thread, off its event loop."""
    held = set(keep) | {pg_name(n) for n in keep}
    found = owned(namespace, deployment, everything=everything)
    removed = []
    for name in found.actors:
        if name not in held and (standbys or standby_number(deployment, name) is None):
            _kill_actor(namespace, name)
            removed.append(f"actor {name}")
    for name, pg_id in found.placement_groups.items():
        if name not in held and (standbys or standby_number(deployment, name[: -len(PG_SUFFIX)]) is None):
            _remove_pg(pg_id)
            removed.append(f"placement group {name}")
    return removed


def still_held(namespace: str, deployment: str, removed: list[str]) -> list[str]:
    """Which of ``removed`` (as :func:`remove_unheld` returns them: names of ``deployment``) Ray
    still lists, each looked up by its name."""
    import ray

    def held(item: str) -> bool:
        kind, _, name = item.rpartition(" ")
        if kind == "actor":
            try:
                ray.get_actor(name, namespace=namespace)
                return True
            except ValueError:
                return False
        return _pg_id(name) is not None

    return [r for r in removed if held(r)]


async def wait_gone(namespace: str, deployment: str, removed: list[str], wait_s: float = 15.0) -> list[str]:
    """Wait (off the event loop: each look is a thread's) until the names are free; those still
    held after ``wait_s``."""
    deadline = time.time() + wait_s
    while (left := await asyncio.to_thread(still_held, namespace, deployment, removed)) and time.time() < deadline:
        await asyncio.sleep(0.2)
    return left


async def free_identity(namespace: str, deployment: str, identity: str, wait_s: float = 15.0) -> list[str]:
    """Make the rank actor name ``identity`` and its placement group name free for a new rank: a
    launch asks for them only when no member holds them, so what holds them is a stale resource of
    this deployment (a dead controller's joiner, a dead member's reservation) and is removed.
    Returns what was removed; raises when a name is still taken after ``wait_s``."""
    from engine_ext.protocol import EepError

    def remove() -> list[str]:
        gone = []
        if still_held(namespace, deployment, [f"actor {identity}"]):
            _kill_actor(namespace, identity)
            gone.append(f"actor {identity}")
        if (pg_id := _pg_id(pg_name(identity))) is not None:
            _remove_pg(pg_id)
            gone.append(f"placement group {pg_name(identity)}")
        return gone

    removed = await asyncio.to_thread(remove)
    left = await wait_gone(namespace, deployment, removed, wait_s)
    if left:
        raise EepError(
            f"the name(s) {', '.join(left)} of a stale resource of this deployment are still taken "
            f"{wait_s:.0f}s after it was removed"
        )
    return removed
