"""Orphaned shared-memory segments removed on every node of the cluster (engine_ext.shm_orphans
says which count): one zero-CPU task pinned to each alive node, since a segment lives in the
/dev/shm of the node whose process made it. ``eepctl repair`` on a vLLM deployment runs it: vLLM's
engine processes that were killed (a scale-down's, a dead rank's) leave their message queues
there. Ray is imported inside the function."""

from __future__ import annotations

from typing import Any


def _remove_here(since: float, min_age_s: float) -> list[dict[str, Any]]:
    from engine_ext.shm_orphans import remove_orphan_segments

    return [{"name": o.path.name, "bytes": o.bytes} for o in remove_orphan_segments(since, min_age_s)]


def remove_orphan_segments_on_nodes(
    since: float = 0.0, min_age_s: float | None = None, timeout_s: float = 60.0
) -> list[str]:
    """Remove the orphaned segments of every alive node; one line per segment removed
    ("orphaned shared memory <name> (<MiB>) on <node address>"). A node whose task does not
    answer within ``timeout_s`` is named instead."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray
    from engine_ext.shm_orphans import MIN_AGE_S

    task = ray.remote(num_cpus=0, max_retries=0)(_remove_here)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            since, MIN_AGE_S if min_age_s is None else min_age_s
        )
        for n in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done: list[str] = []
    for node, ref in zip(nodes, refs):
        where = node.get("NodeManagerAddress", node["NodeID"][:8])
        if ref not in ready:
            done.append(f"orphaned shared memory on {where}: not checked (no answer in {timeout_s:.0f}s)")
            continue
        done += [
            f"removed orphaned shared memory {s['name']} ({s['bytes'] / 2**20:.0f} MiB) on {where}"
            for s in ray.get(ref)
        ]
    return done
