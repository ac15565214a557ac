"""Where ranks run: a placement policy over the Ray cluster's nodes.

The policy is deployment-wide (``spread`` means across every rank of the deployment, joiners
included), but a Ray placement group cannot grow or shrink. So each rank gets a placement group of
its own (one bundle: its CPUs/GPUs plus a sliver of the chosen node's ``node:<ip>`` resource),
created with the policy's Ray strategy and removed with the rank. The node is chosen here from the
deployment's ranks per node and each node's free resources, which is also what ``--dry-run``
shows (:func:`choose_nodes` is pure; :func:`predict_nodes` feeds it the live cluster).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

POLICIES: dict[str, str] = {"pack": "PACK", "spread": "SPREAD", "strict-spread": "STRICT_SPREAD"}
DEFAULT_POLICY = "pack"
NODE_PIN = 0.001  # of a node's `node:<ip>` resource: pins a bundle there without limiting ranks per node
_EPS = 1e-9


class PlacementError(ValueError):
    """The policy cannot be met on this cluster; the message says why (preflight, exit 4)."""


@dataclass(frozen=True)
class PlacementSpec:
    """What the operator asked for at `up`: the policy and an optional interface override."""

    policy: str = DEFAULT_POLICY
    ifname: str = ""

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--placement must be one of {', '.join(POLICIES)}, got {self.policy!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "ifname": self.ifname}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> PlacementSpec:
        d = d or {}
        return cls(str(d.get("policy") or DEFAULT_POLICY), str(d.get("ifname") or ""))


@dataclass(frozen=True)
class Node:
    """An alive Ray node and what is free on it."""

    node_id: str
    ip: str
    cpus: float
    gpus: float

    def label(self) -> str:
        return f"{self.node_id[:8]}/{self.ip}"


def choose_nodes(
    policy: str, nodes: list[Node], held: Counter[str], count: int, cpus: float, gpus: float
) -> list[Node]:
    """The node of each of ``count`` new ranks. ``held`` counts this deployment's ranks per node id.

    pack: the node already holding most ranks first; spread: the node holding fewest;
    strict-spread: only nodes holding none, one rank each."""
    if policy not in POLICIES:
        raise PlacementError(f"unknown placement policy {policy!r}")
    free = {n.node_id: [n.cpus, n.gpus] for n in nodes}
    held = Counter(held)
    chosen: list[Node] = []
    for i in range(count):
        fits = [n for n in nodes if free[n.node_id][0] + _EPS >= cpus and free[n.node_id][1] + _EPS >= gpus]
        if policy == "strict-spread":
            fits = [n for n in fits if held[n.node_id] == 0]
        if not fits:
            raise PlacementError(_why(policy, nodes, held, count, i, cpus, gpus))
        if policy == "pack":
            node = min(fits, key=lambda n: (-held[n.node_id], -free[n.node_id][0], n.node_id))
        else:
            node = min(fits, key=lambda n: (held[n.node_id], -free[n.node_id][0], n.node_id))
        chosen.append(node)
        held[node.node_id] += 1
        free[node.node_id][0] -= cpus
        free[node.node_id][1] -= gpus
    return chosen


def _why(policy: str, nodes: list[Node], held: Counter[str], count: int, placed: int, cpus: float, gpus: float) -> str:
    need = f"{cpus:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")
    if policy == "strict-spread":
        empty = sum(1 for n in nodes if held[n.node_id] == 0) + placed
        return (
            f"placement strict-spread puts one rank per node: {count} new rank(s) need {count} node(s) "
            f"without a rank of this deployment ({need} free each); the cluster has {len(nodes)} alive "
            f"node(s), {empty} of them without one"
        )
    free = ", ".join(f"{n.label()}: {n.cpus:g} CPU" + (f" {n.gpus:g} GPU" if gpus else "") for n in nodes)
    return (
        f"placement {policy}: {count} new rank(s) need {need} each; only {placed} fit on the cluster's "
        f"{len(nodes)} alive node(s) (free: {free or 'none'})"
    )


def after_pending(nodes: list[Node], pending: list[dict[str, float]]) -> list[Node]:
    """``nodes`` less the bundles that already wait for resources (pending placement groups, the
    deployment's own or anyone's): a bundle pinned by ``node:<ip>`` counts on that node, any other
    on the node with the most free CPU that fits it, as Ray would likely place it; one that fits
    nowhere waits for a node and takes nothing. Without this a growth checked as placeable races
    the earlier demand for the same CPUs and waits out its whole placement bound when it loses."""
    free = {n.node_id: [n.cpus, n.gpus] for n in nodes}
    by_ip = {n.ip: n.node_id for n in nodes}
    for b in pending:
        cpus, gpus = float(b.get("CPU", 0.0)), float(b.get("GPU", 0.0))
        pinned = [by_ip[k[5:]] for k in b if k.startswith("node:") and k[5:] in by_ip]
        fits = [i for i in (pinned or list(free)) if free[i][0] + _EPS >= cpus and free[i][1] + _EPS >= gpus]
        if fits:
            best = max(fits, key=lambda i: (free[i][0], free[i][1]))
            free[best][0] -= cpus
            free[best][1] -= gpus
    return [Node(n.node_id, n.ip, max(0.0, free[n.node_id][0]), max(0.0, free[n.node_id][1])) for n in nodes]


# ---- the live cluster (Ray imported only here) ------------------------------------------------------
def pending_bundles() -> list[dict[str, float]]:
    """The bundles of every placement group Ray has not placed yet."""
    from ray.util import placement_group_table

    return [
        dict(b)
        for pg in placement_group_table().values()
        if pg.get("state") == "PENDING"
        for b in (pg.get("bundles") or {}).values()
    ]


def cluster_nodes() -> list[Node]:
    """Alive nodes with what is free on them once the pending placement groups are placed."""
    import ray
    from engine_ext.ray import ray_private

    avail = ray_private.available_resources_per_node()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        free = avail.get(n["NodeID"], {})
        out.append(Node(n["NodeID"], n["NodeManagerAddress"], float(free.get("CPU", 0.0)), float(free.get("GPU", 0.0))))
    return after_pending(sorted(out, key=lambda n: n.node_id), pending_bundles())


def predict_nodes(policy: str, held: Counter[str], count: int, cpus: float, gpus: float) -> list[Node]:
    """choose_nodes on the live cluster (what a scale's `--dry-run` shows)."""
    return choose_nodes(policy, cluster_nodes(), held, count, cpus, gpus)


def bundle(node: Node, cpus: float, gpus: float) -> dict[str, float]:
    b = {"CPU": cpus, f"node:{node.ip}": NODE_PIN}
    if gpus:
        b["GPU"] = gpus
    return {k: v for k, v in b.items() if v > 0}


async def reserve(
    node: Node, cpus: float, gpus: float, policy: str, name: str, timeout_s: float = 60.0, check_s: float = 1.0
) -> Any:
    """A ready placement group of one bundle pinned to ``node``; removed again if it is not ready
    in time (someone else took its resources) or as soon as Ray marks ``node`` dead (checked every
    ``check_s``): a bundle pinned to a lost node never becomes ready, and a growth tried just
    before Ray noticed the loss would otherwise wait out the whole ``timeout_s``."""
    import asyncio

    from ray.util.placement_group import placement_group, remove_placement_group

    # Detached: a rank's reservation outlives a controller restart (the rank keeps running in
    # it); `eepctl down` and the controller remove it (``release``, ``remove_named``).
    pg = placement_group([bundle(node, cpus, gpus)], strategy=POLICIES[policy], name=name, lifetime="detached")
    ready = asyncio.ensure_future(_awaited(pg.ready()))
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise asyncio.TimeoutError(f"placement group {name} not ready in {timeout_s:.0f}s")
            done, _ = await asyncio.wait({ready}, timeout=min(check_s, left))
            if done:
                ready.result()
                return pg
            if not node_alive(node.node_id):
                raise RuntimeError(f"node {node.label()} was lost before rank {name} could be placed on it")
    except BaseException:
        ready.cancel()
        remove_placement_group(pg)
        raise


async def _awaited(ref: Any) -> Any:
    return await ref


def node_alive(node_id: str) -> bool:
    """Whether Ray's GCS lists ``node_id`` as alive (True when the GCS cannot be asked: only a
    node Ray declared dead ends a wait early)."""
    import ray

    try:
        nodes = ray.nodes()
    except Exception:  # noqa: BLE001 - the GCS restarting: keep waiting on the bound
        return True
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in nodes)


def scheduling(pg: Any) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)


def on_this_node() -> Any:
    """Pin an actor to the node of the calling process. The control plane (registry, controller)
    lives where `eepctl up` ran, normally the head node: left to Ray, a zero-CPU actor may land on
    a worker node and die with it, and then nothing is left to heal the ranks."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def release(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already gone with its creator
        pass


def control_nodes() -> list[Node]:
    """Where the control plane may run, in order of preference: the head node, then the other
    alive nodes (by id). The head holds Ray's GCS: losing it loses the cluster anyway."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    alive.sort(key=lambda n: ("node:__internal_head__" not in n.get("Resources", {}), n["NodeID"]))
    return [Node(n["NodeID"], n["NodeManagerAddress"], 0.0, 0.0) for n in alive]


def on_node(node: Node, soft: bool) -> Any:
    """Place an actor on ``node``; ``soft``: elsewhere when that node is gone (a restart by Ray)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=soft)
