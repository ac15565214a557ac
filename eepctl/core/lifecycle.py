"""What eepctl does, without the command framework: each function returns plain data.

eepctl is a client: actors are created by engine_ext.ray.deployment; a deployment is planned,
scaled, repaired and sent requests through its driver (engine_ext.drivers, whose kind this module
never asks); load comes from eepctl.loadgen. Ray is imported inside the functions that talk to the
cluster; torch never is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from eepctl import cluster, loadgen
from eepctl.api_access import check_listen, key_digest
from eepctl.loadgen import DEFAULT_PROMPTS, percentiles
from engine_ext.drivers import Driver, endpoints, open_deployment, request_key, served_model, status_view
from engine_ext.drivers.base import Submit
from engine_ext.drivers.completions import CompletionsClient, TokenSink
from engine_ext.drivers.reference import check_outcome
from engine_ext.protocol import (
    DEFAULT_NAMESPACE,
    EepError,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    UsageError,
    validate_name,
)
from engine_ext.ray.deployment import list_deployments
from engine_ext.ray.names import controller_name, registry_name

__all__ = [
    "DEFAULT_PROMPTS",
    "Target",
    "autoscale",
    "autoscale_decisions",
    "autoscale_show",
    "check_outcome",
    "down",
    "events",
    "generate",
    "list_deployments",
    "load",
    "percentiles",
    "plan",
    "requests",
    "scale",
    "status",
    "up",
]


@dataclass
class Target:
    """Which cluster, namespace and deployment a command addresses."""

    address: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    name: str = "moe"

    def validated(self) -> Target:
        validate_name(self.name)
        validate_name(self.namespace, "namespace")
        return self


def _connect(t: Target) -> str:
    return cluster.connect(t.address, t.namespace)


def _get(ref: Any, timeout: float | None = 30.0) -> Any:
    from engine_ext.ray.deployment import call

    return call(ref, timeout=timeout)


def _deployment(t: Target, controller: bool = True) -> tuple[Any, Any]:
    """(registry, controller) handles; read-only commands skip the controller handle, whose
    class import is heavier."""
    from engine_ext.ray.deployment import actor

    registry = actor(registry_name(t.name), t.namespace)
    ctl = actor(controller_name(t.name), t.namespace) if controller or registry is None else None
    if registry is None and ctl is None:
        known = list_deployments(t.namespace)
        hint = f" (deployments here: {', '.join(known)})" if known else " (none exist in this namespace)"
        raise UnreachableError(f"deployment {t.name!r} not found in namespace {t.namespace!r}{hint}")
    return registry, ctl


def _driver(t: Target, api_key: str | None) -> Driver:
    """Connect, find the deployment's actors, and open its driver (the kind is decided there)."""
    _connect(t)
    registry, controller = _deployment(t)
    return open_deployment(t.name, registry, controller, api_key=api_key)


# ---- up / down ---------------------------------------------------------------------------------
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
    from engine_ext.config import EngineConfig, RankFailurePolicy
    from engine_ext.ray.deployment import actor, create_deployment
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
    check_listen(host, port, ingress)
    from engine_ext.capture_memory import kv_budget_error, size_captures, up_summary  # torch-free

    try:
        cfg = EngineConfig(**engine, instance_id=t.name)
        choice = size_captures(cfg, max_dp)  # capture policy auto: reuse where the KV budget allows it
        cfg.validate()
    except ValueError as e:
        raise UsageError(f"invalid engine option: {e}") from None

    why = kv_budget_error(cfg, dp)  # refused before a cluster is touched (the controller checks it too)
    if why:
        raise PreconditionError(f"cannot start DP {dp}: {why}")
    t0 = time.time()
    address, started = cluster.connect_or_start(t.address, t.namespace, say)
    if actor(registry_name(t.name), t.namespace) is not None:
        raise PreconditionError(f"deployment {t.name!r} already exists in namespace {t.namespace!r}")
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
    # Heartbeats lag the start by up to a second: never less than a few seconds for them.
    deadline = max(t0 + timeout_s, time.time() + 5.0)
    snap = wait_serving(lambda: _get(handles.registry.snapshot.remote()), t.name, dp, deadline)
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


def standby(t: Target, count: int) -> dict[str, Any]:
    """Resize the deployment's standby pool; returns its summary once the pool is filled."""
    t.validated()
    if count < 0:
        raise UsageError(f"--count must be >= 0, got {count}")
    _connect(t)
    _, controller = _deployment(t)
    if controller is None:
        raise UnreachableError(f"the controller of {t.name!r} is gone")
    return _get(controller.set_standby.remote(count), timeout=600)


def down(t: Target, *, stop_cluster: bool) -> dict[str, Any]:
    import ray
    from engine_ext.ray.deployment import DeploymentHandles, destroy_deployment, has_leftovers

    t.validated()
    _connect(t)
    try:
        registry, controller = _deployment(t)
    except UnreachableError:
        if not has_leftovers(t.name, t.namespace):  # nothing of it at all: say so (exit 3)
            raise
        registry = controller = None  # its control actors are gone; what they left is removed
    removed = destroy_deployment(t.name, t.namespace, DeploymentHandles(registry, controller))
    result: dict[str, Any] = {
        "deployment": t.name,
        "stopped": True,
        "cluster_stopped": False,
        "removed_by_name": removed,
    }
    if stop_cluster:
        ray.shutdown()
        stopped = cluster.stop_started(cluster.resolve_address(t.address))
        result["cluster_stopped"] = stopped is not None
        if stopped is None:
            result["cluster_note"] = "the cluster was not started by eepctl; left running"
    return result


# ---- status / events ---------------------------------------------------------------------------------
def status(t: Target) -> dict[str, Any]:
    t.validated()
    return _ray_status_reader(t)()


def _ray_status_reader(t: Target) -> Callable[[], dict[str, Any]]:
    """The registry snapshot through a Ray driver, with the registry handle looked up once."""
    _connect(t)
    registry, _ = _deployment(t, controller=False)
    if registry is None:
        raise UnreachableError(
            f"the registry of {t.name!r} is gone while its controller still runs; "
            "per-rank status is unavailable until a registry exists again"
        )
    return lambda: status_view(_get(registry.snapshot.remote(), timeout=10))


def status_reader(t: Target) -> Callable[[], dict[str, Any]]:
    """A function returning the registry snapshot, with the deployment resolved once: the light
    read path (eepctl.readpath) when the registry publishes one, else the Ray driver."""
    from eepctl import readpath

    t.validated()
    fast = readpath.reader(t.address, t.namespace, t.name)
    if fast is not None:
        return lambda: status_view(fast())
    return _ray_status_reader(t)


def events(t: Target, op_id: str | None = None, since_seq: int = 0) -> dict[str, Any]:
    """The registry's operations and events: over the light read path when it answers, else
    through a Ray driver (which reports a missing deployment or registry)."""
    from eepctl import readpath

    t.validated()
    data = readpath.events(t.address, t.namespace, t.name, op_id, since_seq)
    if data is None:
        _connect(t)
        registry, _ = _deployment(t, controller=False)
        if registry is None:
            raise UnreachableError(f"the registry of {t.name!r} is gone; operation history is unavailable")
        data = _get(registry.events.remote(op_id, since_seq), timeout=10)
    if op_id and not data["operations"] and not data["events"]:
        raise UnreachableError(f"no operation {op_id!r} in deployment {t.name!r}")
    return data


# ---- generate / load --------------------------------------------------------------------------------
def generate(
    t: Target,
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float,
    api_key: str | None = None,
    note: Callable[[str], None] = lambda s: None,
    on_token: TokenSink | None = None,
    on_answer: Callable[[int, dict[str, Any]], None] = lambda i, r: None,
) -> dict[str, Any]:
    """Every prompt at once, streamed (``on_token``: each token by prompt position, ``on_answer``: each answer in order)."""
    t.validated()
    if max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    deadline = time.time() + timeout_s
    results = []
    with requests(t, max_tokens, timeout_s, api_key, note, on_token) as submit:
        pending = [submit(p) for p in prompts]
        for i, (p, sent) in enumerate(zip(prompts, pending)):
            r = sent.wait(max(0.1, deadline - time.time()))
            results.append(
                {
                    "prompt": p,
                    "output": r.get("output", []),
                    "error": loadgen.error_text(r),
                    "latency_s": round(r.get("latency_s") or 0.0, 4),
                    **{
                        k: r.get(k, d)
                        for k, d in (("rank", None), ("moved_from", []), ("resumed_with", 0), ("resent", 0))
                    },
                }
            )
            on_answer(i, results[-1])
    return {"deployment": t.name, "results": results}


def load(
    t: Target,
    prompts: list[list[int]],
    max_tokens: int,
    rate: float,
    duration_s: float,
    timeout_s: float,
    seed: int = 0,
    api_key: str | None = None,
    note: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Open-loop load: ``rate`` requests per second for ``duration_s``; report outcomes and latency."""
    t.validated()
    if rate <= 0 or duration_s <= 0 or max_tokens < 1:
        raise UsageError("--rate and --duration must be > 0" if max_tokens >= 1 else "--max-tokens must be >= 1")
    with requests(t, max_tokens, timeout_s, api_key, note) as submit, loadgen.interrupt_ends_sending() as stop:
        res = loadgen.open_loop(submit, prompts, rate, duration_s, timeout_s, seed, stop, note)
    return {"deployment": t.name, **res}


def requests(
    t: Target,
    max_tokens: int,
    timeout_s: float,
    api_key: str | None = None,
    note: Callable[[str], None] = lambda s: None,
    on_token: TokenSink | None = None,
) -> AbstractContextManager[Submit]:
    """Prompts through the deployment's HTTP endpoint, whatever engine serves it (the URLs `status`
    shows, from the snapshot; else asked of the cluster), looked up again when one drops a request."""
    try:
        read: Callable[[], dict[str, Any]] | None = status_reader(t)
    except UnreachableError:
        read = None  # the registry is gone (or the deployment): the driver says which
    snap: dict[str, Any] | None = None

    def lookup() -> list[str]:
        nonlocal snap
        try:
            snap = read() if read is not None else None
        except EepError:
            snap = None
        return (endpoints(snap) if snap else []) or _driver(t, api_key).endpoints()

    urls = lookup()
    key = request_key(snap, api_key)
    model = served_model(snap, t.name, urls[0], key)
    return CompletionsClient(lookup, key, model, max_tokens, timeout_s, note, on_token).requests()


# ---- scale / repair ------------------------------------------------------------------------------------
def check_retire(retire: list[int] | None) -> list[int] | None:
    """``--retire``: distinct rank numbers >= 0 (whether they are members is the controller's check)."""
    if retire is None:
        return None
    if any(r < 0 for r in retire) or len(set(retire)) != len(retire):
        raise UsageError(f"--retire takes distinct rank numbers >= 0, got {','.join(map(str, retire))}")
    return sorted(retire)


def plan(t: Target, dp: int, api_key: str | None = None, retire: list[int] | None = None) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    retire = check_retire(retire)
    return _driver(t, api_key).plan(dp, retire)


def scale(
    t: Target,
    dp: int,
    *,
    drain_timeout_s: float,
    timeout_s: float,
    wait: bool,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
    api_key: str | None = None,
    on_op: Callable[[dict[str, Any]], None] = lambda o: None,
    request_id: str | None = None,
    retire: list[int] | None = None,
) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    if timeout_s <= 0 or drain_timeout_s < 0:
        raise UsageError("--timeout must be > 0 and --drain-timeout >= 0")
    if request_id is not None and not (0 < len(request_id) <= 128 and request_id.isprintable()):
        raise UsageError("--request-id must be 1 to 128 printable characters")
    retire = check_retire(retire)
    return _driver(t, api_key).scale(
        dp,
        drain_timeout_s=drain_timeout_s,
        timeout_s=timeout_s,
        wait=wait,
        on_event=on_event,
        on_op=on_op,
        request_id=request_id,
        retire=retire,
    )


# ---- autoscale -----------------------------------------------------------------------------------
def check_autoscale_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """Each given policy field's type and range, before the cluster is asked (the controller
    checks the merged policy again)."""
    from engine_ext.control.autoscale_policy import AutoscalePolicy

    lo = changes.get("min_dp", 1)
    probe: dict[str, Any] = {"min_dp": lo, "max_dp": max(lo, changes.get("max_dp", lo)) if isinstance(lo, int) else 1}
    untouched = [
        k for k in ("target_queue", "target_kv", "slo_ttft_ms", "slo_tpot_ms", "target_utilization") if k not in changes
    ]
    if untouched:  # a target the deployment may keep: "at least one target" is the controller's check
        probe[untouched[0]] = 0.5
    try:
        AutoscalePolicy(**{**probe, **changes}).validated()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return changes


def autoscale(t: Target, changes: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
    """Set the autoscaling policy (``changes`` over the one the deployment keeps)."""
    t.validated()
    if not changes:
        raise UsageError("nothing to set: give --min-dp/--max-dp, --mode or a target (or --show)")
    changes = check_autoscale_changes(changes)
    return _driver(t, api_key).set_autoscale(changes)


def autoscale_show(t: Target, api_key: str | None = None) -> dict[str, Any]:
    t.validated()
    return _driver(t, api_key).autoscale_policy()


def autoscale_decisions(t: Target, since: float = 0.0, api_key: str | None = None) -> dict[str, Any]:
    t.validated()
    return _driver(t, api_key).autoscale_decisions(since)


def repair(t: Target, *, timeout_s: float = 300.0, api_key: str | None = None) -> dict[str, Any]:
    """Recover what the automatic self-healing could not (dead members, a size below the
    desired one) and say what was done."""
    t.validated()
    return _driver(t, api_key).repair(timeout_s=timeout_s)


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
