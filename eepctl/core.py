"""What eepctl does, without the command framework: each function returns plain data.

Ray is imported inside the functions that talk to the cluster; torch never is (the engine
config is plain dataclasses, and ranks build their engines inside the cluster).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_ext.protocol import (
    DEFAULT_NAMESPACE,
    EepError,
    OpState,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    UsageError,
    error_from_record,
    validate_name,
)
from engine_ext.ray.names import REGISTRY_PREFIX, controller_name, registry_name
from eepctl import cluster

DEFAULT_PROMPTS: list[list[int]] = [
    [1, 2, 3, 4, 5],
    [17, 42, 99, 7],
    [200, 13, 13, 8, 250, 3, 61],
    [5, 6, 7, 8, 9, 10, 11, 12],
    [128],
    [77, 78, 79],
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


def _actor(name: str, namespace: str) -> Any:
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _deployment(t: Target, controller: bool = True) -> tuple[Any, Any]:
    """(registry, controller) handles; read-only commands skip the controller handle, whose
    class import is heavier."""
    registry = _actor(registry_name(t.name), t.namespace)
    controller = _actor(controller_name(t.name), t.namespace) if controller else None
    if registry is None and not controller:
        controller = _actor(controller_name(t.name), t.namespace)
    if registry is None and controller is None:
        known = list_deployments(t.namespace)
        hint = f" (deployments here: {', '.join(known)})" if known else " (none exist in this namespace)"
        raise UnreachableError(f"deployment {t.name!r} not found in namespace {t.namespace!r}{hint}")
    return registry, controller


def _get(ref: Any, timeout: float | None = 30.0) -> Any:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise TransitionTimeout(f"the cluster did not answer within {timeout:.0f}s") from None
    except RayActorError as e:
        raise UnreachableError(f"an actor of the deployment is gone: {str(e).splitlines()[0]}") from None


def _raise_if_error(result: Any) -> Any:
    if isinstance(result, dict) and isinstance(result.get("error"), dict):
        raise error_from_record(result["error"])
    return result


def list_deployments(namespace: str) -> list[str]:
    from ray.util import list_named_actors

    names = list_named_actors(all_namespaces=True)
    return sorted(a["name"][len(REGISTRY_PREFIX):] for a in names
                  if a.get("namespace") == namespace and a["name"].startswith(REGISTRY_PREFIX))


# ---- up / down ---------------------------------------------------------------------------------
def up(t: Target, *, dp: int, max_dp: int, engine: dict[str, Any], cpus_per_rank: float, gpus_per_rank: float,
       timeout_s: float, say: Callable[[str], None] = lambda s: None,
       placement: dict[str, Any] | None = None) -> dict[str, Any]:
    import ray

    from engine_ext.engine.config import EngineConfig
    from engine_ext.ray.controller import Controller
    from engine_ext.ray.registry import Registry

    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    if max_dp < dp:
        raise UsageError(f"--max-dp ({max_dp}) must be >= --dp ({dp})")
    cfg = EngineConfig(**engine, instance_id=t.name)
    from engine_ext.ray.placement import PlacementSpec  # torch- and ray-free

    spec = PlacementSpec.from_dict(placement)
    try:
        spec.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    placement = spec.to_dict()
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(f"invalid engine option: {e}") from None
    started = None
    t0 = time.time()
    try:
        address = _connect(t)
    except UnreachableError:
        if cluster.resolve_address(t.address) is not None:
            raise
        say("No Ray cluster is running: starting a local Ray head (eepctl started it; "
            "`eepctl down --stop-cluster` stops it).")
        started = cluster.start_local()
        address = cluster.connect(started["address"], t.namespace)
    if _actor(registry_name(t.name), t.namespace) is not None:
        raise PreconditionError(f"deployment {t.name!r} already exists in namespace {t.namespace!r}")
    registry = ray.remote(Registry).options(name=registry_name(t.name), namespace=t.namespace,
                                            lifetime="detached", num_cpus=0).remote(t.name)
    info = {"dp": dp, "max_dp": max_dp, "created": time.time(), "cpus_per_rank": cpus_per_rank,
            "gpus_per_rank": gpus_per_rank, "config": cfg.to_dict(), "placement": placement}
    _get(registry.set_info.remote(info))
    controller = ray.remote(Controller).options(
        name=controller_name(t.name), namespace=t.namespace, lifetime="detached", num_cpus=0,
        max_concurrency=1000,
    ).remote(t.name, t.namespace, cfg.to_dict(), max_dp, cpus_per_rank, gpus_per_rank, placement)
    try:
        result = _raise_if_error(_get(controller.start.remote(dp, timeout_s), timeout=timeout_s + 30))
    except BaseException:
        for h in (controller, registry):
            ray.kill(h, no_restart=True)
        raise
    # Wait until every rank's heartbeat says it serves.
    deadline = time.time() + 15
    snap: dict[str, Any] = {}
    while time.time() < deadline:
        snap = _get(registry.snapshot.remote())
        if len(snap["ranks"]) == dp and all(r["state"] == "serving" for r in snap["ranks"]):
            break
        time.sleep(0.2)
    return {"deployment": t.name, "namespace": t.namespace, "address": address, "dp": result["dp"],
            "max_dp": max_dp, "cluster_started": started is not None, "elapsed_s": round(time.time() - t0, 2),
            "ranks": snap.get("ranks", [])}


def down(t: Target, *, stop_cluster: bool) -> dict[str, Any]:
    import ray

    t.validated()
    _connect(t)
    registry, controller = _deployment(t)
    if controller is not None:
        try:
            _get(controller.stop.remote(), timeout=60)
        except EepError:
            pass
    # Rank actors are named by identity; kill any the controller no longer knew about.
    killed = []
    from ray.util import list_named_actors

    for a in list_named_actors(all_namespaces=True):
        if a.get("namespace") == t.namespace and a["name"].startswith(f"{t.name}_dp"):
            h = _actor(a["name"], t.namespace)
            if h is not None:
                ray.kill(h, no_restart=True)
                killed.append(a["name"])
    for h in (controller, registry):
        if h is not None:
            ray.kill(h, no_restart=True)
    # ray.kill only queues the request: wait until the names are really gone, so `down`
    # exiting 0 means the deployment is stopped.
    names = {registry_name(t.name), controller_name(t.name), *killed}
    deadline = time.time() + 30
    while time.time() < deadline:
        alive = {a["name"] for a in list_named_actors(all_namespaces=True)
                 if a.get("namespace") == t.namespace and a["name"] in names}
        if not alive:
            break
        time.sleep(0.2)
    else:
        raise TransitionTimeout(f"deployment {t.name!r} did not stop within 30s (still alive: {sorted(alive)})")
    result: dict[str, Any] = {"deployment": t.name, "stopped": True, "cluster_stopped": False}
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
    _connect(t)
    registry, _ = _deployment(t, controller=False)
    if registry is None:
        raise UnreachableError(f"the registry of {t.name!r} is gone while its controller still runs; "
                               "per-rank status is unavailable until a registry exists again")
    return _get(registry.snapshot.remote(), timeout=10)


def events(t: Target, op_id: str | None = None, since_seq: int = 0) -> dict[str, Any]:
    t.validated()
    _connect(t)
    registry, _ = _deployment(t, controller=False)
    if registry is None:
        raise UnreachableError(f"the registry of {t.name!r} is gone; operation history is unavailable")
    data = _get(registry.events.remote(op_id, since_seq), timeout=10)
    if op_id and not data["operations"] and not data["events"]:
        raise UnreachableError(f"no operation {op_id!r} in deployment {t.name!r}")
    return data


# ---- generate / load --------------------------------------------------------------------------------
def generate(t: Target, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> dict[str, Any]:
    t.validated()
    if max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    _connect(t)
    _, controller = _deployment(t)
    refs = [controller.generate.remote(p, max_tokens) for p in prompts]
    results = _get(refs, timeout=timeout_s)
    return {"deployment": t.name, "results": [
        {"prompt": p, "output": r.get("output", []), "error": _err_text(r), "latency_s": round(r.get("latency_s", 0.0), 4),
         "rank": r.get("rank"), "moved_from": r.get("moved_from", [])} for p, r in zip(prompts, results)]}


def _err_text(r: dict[str, Any]) -> str | None:
    e = r.get("error")
    if e is None:
        return None
    return e if isinstance(e, str) else str(e)


def load(t: Target, prompts: list[list[int]], max_tokens: int, rate: float, duration_s: float,
         timeout_s: float, seed: int = 0) -> dict[str, Any]:
    """Open-loop load: ``rate`` requests per second for ``duration_s``; report outcomes and latency."""
    t.validated()
    if rate <= 0 or duration_s <= 0:
        raise UsageError("--rate and --duration must be > 0")
    _connect(t)
    _, controller = _deployment(t)
    rng = random.Random(seed)
    n = max(1, int(rate * duration_s))
    t0 = time.time()
    sent: list[tuple[int, Any, float]] = []
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        idx = rng.randrange(len(prompts))
        sent.append((idx, controller.generate.remote(prompts[idx], max_tokens), time.time()))
    records = []
    for idx, ref, _ in sent:
        try:
            r = _get(ref, timeout=max(1.0, timeout_s - (time.time() - t0)))
        except EepError as e:
            r = {"error": e.message}
        records.append({"prompt_index": idx, "output": r.get("output", []), "error": _err_text(r),
                        "latency_s": r.get("latency_s"), "moved_from": r.get("moved_from", [])})
    lat = sorted(r["latency_s"] for r in records if not r["error"] and r["latency_s"] is not None)
    return {"deployment": t.name, "sent": n, "completed": len(lat), "failed": n - len(lat),
            "duration_s": round(time.time() - t0, 2), "rate": rate, "latency_s": percentiles(lat),
            "prompts": prompts, "records": records}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    v = sorted(values)

    def pct(p: float) -> float:
        return round(v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))], 4)

    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "max": round(v[-1], 4),
            "mean": round(statistics.fmean(v), 4)}


# ---- scale -------------------------------------------------------------------------------------------
def plan(t: Target, dp: int, api_key: str | None = None) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    _connect(t)
    registry, controller = _deployment(t)
    if controller is None and registry is not None:  # a vLLM deployment has a registry only
        from eepctl import vllm_client

        if (snap := vllm_client.info_if_vllm(registry, _get)) is not None:
            return vllm_client.plan(t, dp, registry, snap, _get, api_key=api_key)
    result = _raise_if_error(_get(controller.plan.remote(dp), timeout=30))
    return result


def scale(t: Target, dp: int, *, drain_timeout_s: float, timeout_s: float, wait: bool,
          on_event: Callable[[dict[str, Any]], None] = lambda e: None, api_key: str | None = None) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    if timeout_s <= 0 or drain_timeout_s < 0:
        raise UsageError("--timeout must be > 0 and --drain-timeout >= 0")
    _connect(t)
    registry, controller = _deployment(t)
    if controller is None and registry is not None:  # a vLLM deployment has a registry only
        from eepctl import vllm_client

        if (snap := vllm_client.info_if_vllm(registry, _get)) is not None:
            return vllm_client.scale(t, dp, registry, snap, _get, drain_timeout_s=drain_timeout_s,
                                     timeout_s=timeout_s, wait=wait, api_key=api_key, on_event=on_event)
    if controller is None:
        raise UnreachableError(f"the controller of {t.name!r} is gone; the deployment cannot scale")
    accepted = _raise_if_error(_get(controller.scale.remote(dp, drain_timeout_s, timeout_s, False), timeout=60))
    op_id = accepted["op_id"]
    if not wait:
        return accepted
    seq = 0
    deadline = time.time() + timeout_s + 30
    while True:
        result = _get(controller.wait_op.remote(op_id, 0.25), timeout=30)
        if registry is not None:
            try:
                data = _get(registry.events.remote(op_id, seq), timeout=10)
                for ev in data["events"]:
                    seq = max(seq, ev["seq"])
                    on_event(ev)
            except EepError:
                pass
        if result.get("state") != "running":
            break
        if time.time() > deadline:
            raise TransitionTimeout(f"{op_id} still running after {timeout_s:.0f}s")
    if registry is not None and "op_id" in result:  # the registry adds the ranks' phase timings
        try:
            merged = _get(registry.events.remote(op_id, 0), timeout=10)["operations"]
            if merged:
                result = dict(result, phase_durations=merged[-1]["phase_durations"])
        except EepError:
            pass
    return check_outcome(result)


def check_outcome(op: dict[str, Any]) -> dict[str, Any]:
    """Map a finished operation to the exit-code table (raises for every failure)."""
    _raise_if_error(op)
    state = op.get("state")
    if state == OpState.SUCCEEDED.value:
        return op
    msg = f"{op['op_id']} {state.replace('_', ' ')}: {op.get('error') or 'no reason given'}"
    if op.get("rank_states"):
        msg += " (ranks: " + ", ".join(f"{r}={s}" for r, s in sorted(op["rank_states"].items())) + ")"
    code = int(op.get("error_code") or 5)
    if state == OpState.TIMED_OUT.value or code == 6:
        raise TransitionTimeout(msg, detail={"operation": op})
    if code == 4:
        raise PreconditionError(msg, detail={"operation": op})
    raise TransitionFailed(msg, detail={"operation": op})
