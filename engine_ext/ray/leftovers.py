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


def owned(namespace: str, deployment: str) -> Owned:
    """Every rank actor and rank placement group of ``deployment`` in ``namespace``."""
    from ray._private.state import state
    from ray.util import list_named_actors, placement_group_table

    actors = sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                    if a.get("namespace") == namespace and is_rank_actor(deployment, a["name"]))
    pgs: dict[str, str] = {}
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if (info.get("state") == "REMOVED" or not name.endswith(PG_SUFFIX)
                or not is_rank_actor(deployment, name[:-len(PG_SUFFIX)])):
            continue
        found = state.get_placement_group_by_name(name, namespace)  # the one of this namespace, if any
        if found is not None and found.get("state") != "REMOVED":
            pgs[name] = found["placement_group_id"]
    return Owned(actors, dict(sorted(pgs.items())))


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
        from ray._private.state import state

        info = state.actor_table(handle._actor_id.hex())
        kill_local(int(info.get("Pid") or 0), str((info.get("Address") or {}).get("NodeID") or ""))
    except Exception:  # noqa: BLE001 - Ray's kill below still ends it
        pass
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _remove_pg(pg_id: str) -> None:
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
    except Exception:  # noqa: BLE001 - already removed
        pass


def remove_unheld(namespace: str, deployment: str, keep: Collection[str], *, standbys: bool = True) -> list[str]:
    """End every rank actor and remove every rank placement group of ``deployment`` that the
    actors named in ``keep`` do not hold (``standbys`` False: leave the standby pool's, which may
    be launching one). Returns what it removed ("actor X", "placement group X-pg"); removal is
    asked of Ray here, :func:`wait_gone` waits until the names are free."""
    held = set(keep) | {pg_name(n) for n in keep}
    found = owned(namespace, deployment)
    removed = []
    for name in found.actors:
        if name not in held and (standbys or "_standby" not in name[len(deployment):]):
            _kill_actor(namespace, name)
            removed.append(f"actor {name}")
    for name, pg_id in found.placement_groups.items():
        if name not in held and (standbys or "_standby" not in name[len(deployment):]):
            _remove_pg(pg_id)
            removed.append(f"placement group {name}")
    return removed


def still_held(namespace: str, deployment: str, removed: list[str]) -> list[str]:
    """Which of the names in ``removed`` (as :func:`remove_unheld` returns them) Ray still lists."""
    if not removed:
        return []
    now = owned(namespace, deployment).names()
    return [r for r in removed if r.split(" ")[-1] in now]


def wait_gone(namespace: str, deployment: str, removed: list[str], wait_s: float = 15.0) -> list[str]:
    """Block until the names are free (``eepctl down``); those still held after ``wait_s``."""
    deadline = time.time() + wait_s
    while (left := still_held(namespace, deployment, removed)) and time.time() < deadline:
        time.sleep(0.2)
    return left


async def wait_gone_async(namespace: str, deployment: str, removed: list[str], wait_s: float = 15.0) -> list[str]:
    """:func:`wait_gone` for the controller's event loop."""
    deadline = time.time() + wait_s
    while (left := still_held(namespace, deployment, removed)) and time.time() < deadline:
        await asyncio.sleep(0.2)
    return left


async def free_identity(namespace: str, deployment: str, identity: str, wait_s: float = 15.0) -> list[str]:
    """Make the rank actor name ``identity`` and its placement group name free for a new rank: a
    launch asks for them only when no member holds them, so what holds them is a stale resource of
    this deployment (a dead controller's joiner, a dead member's reservation) and is removed.
    Returns what was removed; raises when a name is still taken after ``wait_s``."""
    from engine_ext.protocol import EepError

    found = owned(namespace, deployment)
    removed = []
    if identity in found.actors:
        _kill_actor(namespace, identity)
        removed.append(f"actor {identity}")
    if pg_name(identity) in found.placement_groups:
        _remove_pg(found.placement_groups[pg_name(identity)])
        removed.append(f"placement group {pg_name(identity)}")
    left = await wait_gone_async(namespace, deployment, removed, wait_s)
    if left:
        raise EepError(f"the name(s) {', '.join(left)} of a stale resource of this deployment are still taken "
                       f"{wait_s:.0f}s after it was removed")
    return removed
