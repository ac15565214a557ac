"""A deployment's life: ``up`` (every option checked before a cluster is touched, then the
deployment created and waited for until it serves), ``down``, and ``repair`` of what
self-healing could not recover."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from eepctl import cluster
from eepctl.api_access import check_listen, key_digest
from eepctl.core.target import Target, connect, deployment_actors, driver
from engine_ext.capture_memory import kv_budget_error, size_captures, up_summary
from engine_ext.config import EngineConfig, RankFailurePolicy
from engine_ext.drivers import open_deployment
from engine_ext.protocol import (
    EepError,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    UsageError,
)
from engine_ext.ray.deployment import (
    DeploymentHandles,
    actor,
    call,
    create_deployment,
    destroy_deployment,
    has_leftovers,
)
from engine_ext.ray.names import registry_name

DOWN_RELEASE_S = 120.0  # how long `down` waits for the driver's ``release`` (what the engine holds outside its actors)


def up(
    t: Target,
    *,
    dp: int,
    max_dp: int,
    engine: dict[str, Any],
    cpus_per_rank: float,
    gpus_per_rank: float,
    timeout_s: float,
    say: Callable[[str], None] = lambda s: None,
    placement: dict[str, Any] | None = None,
    on_rank_failure: str = "replace",
    standby: int = 0,
    health_deadline_s: float = 5.0,
    ingress: int = 1,
    api_key: str | None = None,
    host: str = "0.0.0.0",
    port: int = 0,
) -> dict[str, Any]:
    """Start a deployment (and a local Ray head if none answers); what `up` reports once ``dp`` ranks serve."""
    spec = check_ranks(t, dp, max_dp, placement, on_rank_failure, standby, ingress, health_deadline_s)
    check_listen(host, port, ingress)
    cfg, choice = engine_config(t.name, engine, dp, max_dp)
    t0 = time.time()
    address, started = connect_new(t, say)
    handles, result = create_deployment(
        t.name,
        t.namespace,
        cfg.to_dict(),
        dp,
        max_dp,
        cpus_per_rank,
        gpus_per_rank,
        timeout_s,
        placement=spec.to_dict(),
        on_rank_failure=on_rank_failure,
        standby=standby,
        health_deadline_s=health_deadline_s,
        ingress=ingress,
        api_key_sha256=key_digest(api_key) if api_key else "",
        host=host,
        port=port,
    )
    deadline = max(t0 + timeout_s, time.time() + 5.0)  # heartbeats lag the start by up to a second
    snap = wait_serving(lambda: call(handles.registry.snapshot.remote()), t.name, dp, deadline)
    return {
        "deployment": t.name,
        "namespace": t.namespace,
        "address": address,
        "dp": result["dp"],
        "max_dp": max_dp,
        "cluster_started": started is not None,
        "elapsed_s": round(time.time() - t0, 2),
        "ranks": snap.get("ranks", []),
        "ingress": result.get("ingress") or (snap.get("info") or {}).get("ingress", []),
        "capture": up_summary(cfg, dp, max_dp, choice),
    }


def connect_new(t: Target, say: Callable[[str], None]) -> tuple[str, Any]:
    """Connect to the cluster (a local Ray head started where none answers, said through ``say``)
    where no deployment of ``t``'s name exists yet; returns its address and what was started."""
    address, started = cluster.connect_or_start(t.address, t.namespace, say)
    if actor(registry_name(t.name), t.namespace) is not None:
        raise PreconditionError(f"deployment {t.name!r} already exists in namespace {t.namespace!r}")
    return address, started


def check_ranks(
    t: Target,
    dp: int,
    max_dp: int,
    placement: dict[str, Any] | None,
    on_rank_failure: str,
    standby: int,
    ingress: int,
    health_deadline_s: float,
) -> Any:
    """The target's names and the options that shape the ranks and their failure handling, each
    named by its option when wrong (exit 2); returns the checked ``PlacementSpec``."""
    from engine_ext.ray.placement import PlacementSpec  # torch- and ray-free

    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    if max_dp < dp:
        raise UsageError(f"--max-dp ({max_dp}) must be >= --dp ({dp})")
    try:
        RankFailurePolicy.parse(on_rank_failure, "--on-rank-failure")
        spec = PlacementSpec.from_dict(placement)
        spec.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    for opt, value, least in (("--standby", standby, 0), ("--ingress", ingress, 1)):
        if value < least:
            raise UsageError(f"{opt} must be >= {least}, got {value}")
    if not health_deadline_s > 0:
        raise UsageError(f"--health-deadline must be > 0, got {health_deadline_s}")
    return spec


def engine_config(name: str, engine: dict[str, Any], dp: int, max_dp: int) -> tuple[Any, Any]:
    """The checked ``EngineConfig`` and its capture sizing (policy auto: reuse where the KV budget
    allows it); a KV budget that cannot hold ``dp`` ranks is refused before a cluster is touched
    (the controller checks it too)."""
    try:
        cfg = EngineConfig(**engine, instance_id=name)
        choice = size_captures(cfg, max_dp)
        cfg.validate()
    except ValueError as e:
        raise UsageError(f"invalid engine option: {e}") from None
    why = kv_budget_error(cfg, dp)
    if why:
        raise PreconditionError(f"cannot start DP {dp}: {why}")
    return cfg, choice


def wait_serving(
    snapshot: Callable[[], dict[str, Any]], name: str, dp: int, deadline: float, interval_s: float = 0.2
) -> dict[str, Any]:
    """The registry's snapshot once ``dp`` DP ranks report serving (their heartbeats lag the
    start): a rank that failed ends the wait at once (exit 5), the deadline (``up --timeout``)
    with exit 6, each naming the ranks' states."""
    while True:
        snap = snapshot()
        ranks = [r for r in snap["ranks"] if r["state"] not in ("standby", "removed")]
        states = (
            ", ".join(f"rank {r['rank']} {r['state']}" for r in sorted(ranks, key=lambda r: r["rank"]))
            or "no rank reported"
        )
        if [r for r in ranks if r["state"] == "failed"]:
            raise TransitionFailed(
                f"{name!r} did not come up: {states}; `eepctl status --name {name}` says why, "
                f"`eepctl down --name {name}` removes it"
            )
        if len(ranks) == dp and all(r["state"] == "serving" for r in ranks):
            return snap
        if time.time() >= deadline:
            raise TransitionTimeout(
                f"{name!r} did not serve at DP {dp} before --timeout: {states}; `eepctl down --name {name}` removes it"
            )
        time.sleep(interval_s)  # the poll interval


def down(t: Target, *, stop_cluster: bool) -> dict[str, Any]:
    import ray

    t.validated()
    connect(t)
    try:
        registry, controller = deployment_actors(t)
    except UnreachableError:
        if not has_leftovers(t.name, t.namespace):  # nothing of it at all: say so (exit 3)
            raise
        registry = controller = None  # its control actors are gone; what they left is removed
    released = _release(t, registry, controller)
    removed = destroy_deployment(t.name, t.namespace, DeploymentHandles(registry, controller))
    result: dict[str, Any] = {
        "deployment": t.name,
        "stopped": True,
        "cluster_stopped": False,
        "removed_by_name": removed,
        "released": released,
    }
    if stop_cluster:
        ray.shutdown()
        stopped = cluster.stop_started(cluster.resolve_address(t.address))
        result["cluster_stopped"] = stopped is not None
        if stopped is None:
            result["cluster_note"] = "the cluster was not started by eepctl; left running"
    return result


def _release(t: Target, registry: Any, controller: Any) -> dict[str, Any] | None:
    """What the engine holds outside the deployment's actors, given back first (the driver's ``release``);
    a deployment that cannot say is removed all the same."""
    if registry is None and controller is None:
        return None
    try:
        return open_deployment(t.name, registry, controller).release(timeout_s=DOWN_RELEASE_S)
    except EepError as e:
        return {"dropped": False, "error": e.message}


def repair(t: Target, *, timeout_s: float = 300.0, api_key: str | None = None) -> dict[str, Any]:
    """Recover what the automatic self-healing could not (dead members, a size below the
    desired one) and say what was done."""
    t.validated()
    return driver(t, api_key).repair(timeout_s=timeout_s)


def check_repair(res: dict[str, Any]) -> None:
    """Exit 5 (one line naming what failed) when an action of the repair failed."""
    failed = res.get("failed") or []
    if failed:
        raise TransitionFailed(
            f"repair of {res.get('deployment')!r} failed ({len(failed)} action(s)): "
            + "; ".join(failed)
            + f"; DP {res.get('dp')} of desired {res.get('desired_dp')}",
            detail={"repair": res},
        )
