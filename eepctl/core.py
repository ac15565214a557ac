"""What eepctl does, without the command framework: each function returns plain data.

eepctl is a client: actors are created by engine_ext.ray.deployment, a vLLM transition is driven
by engine_ext.drivers.vllm_scale, load comes from eepctl.loadgen. Ray is imported inside the
functions that talk to the cluster; torch never is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
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
from engine_ext.ray.deployment import list_deployments
from engine_ext.ray.names import controller_name, registry_name
from eepctl import cluster, loadgen
from eepctl.loadgen import DEFAULT_PROMPTS, Submit, percentiles

__all__ = ["DEFAULT_PROMPTS", "Target", "check_outcome", "down", "events", "generate", "list_deployments", "load",
           "percentiles", "plan", "scale", "status", "up"]


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


def _vllm_snapshot(registry: Any, controller: Any) -> dict[str, Any] | None:
    """The registry snapshot of a vLLM deployment (a registry, no controller), else None."""
    if controller is not None or registry is None:
        return None
    from engine_ext.drivers.vllm_scale import info_if_vllm

    return info_if_vllm(registry)


def _raise_if_error(result: Any) -> Any:
    if isinstance(result, dict) and isinstance(result.get("error"), dict):
        raise error_from_record(result["error"])
    return result


# ---- up / down ---------------------------------------------------------------------------------
def up(t: Target, *, dp: int, max_dp: int, engine: dict[str, Any], cpus_per_rank: float, gpus_per_rank: float,
       timeout_s: float, say: Callable[[str], None] = lambda s: None,
       placement: dict[str, Any] | None = None, on_rank_failure: str = "replace",
       standby: int = 0) -> dict[str, Any]:
    from engine_ext.config import EngineConfig
    from engine_ext.ray.placement import PlacementSpec  # torch- and ray-free
    from engine_ext.ray.deployment import actor, create_deployment

    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    if max_dp < dp:
        raise UsageError(f"--max-dp ({max_dp}) must be >= --dp ({dp})")
    if on_rank_failure not in ("shrink", "replace"):
        raise UsageError(f"--on-rank-failure must be shrink or replace, not {on_rank_failure!r}")
    if standby < 0:
        raise UsageError(f"--standby must be >= 0, got {standby}")
    cfg = EngineConfig(**engine, instance_id=t.name)
    if cfg.capture_policy == "reuse" and not cfg.capture_world:
        cfg.capture_world = max_dp  # reuse sizes captures for the largest world scale may reach
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(f"invalid engine option: {e}") from None
    spec = PlacementSpec.from_dict(placement)
    try:
        spec.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
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
    if actor(registry_name(t.name), t.namespace) is not None:
        raise PreconditionError(f"deployment {t.name!r} already exists in namespace {t.namespace!r}")
    handles, result = create_deployment(t.name, t.namespace, cfg.to_dict(), dp, max_dp, cpus_per_rank,
                                        gpus_per_rank, timeout_s, placement=spec.to_dict(),
                                        on_rank_failure=on_rank_failure, standby=standby)
    # Wait until every rank's heartbeat says it serves.
    deadline = time.time() + 15
    snap: dict[str, Any] = {}
    while time.time() < deadline:
        snap = _get(handles.registry.snapshot.remote())
        if len(snap["ranks"]) == dp and all(r["state"] == "serving" for r in snap["ranks"]):
            break
        time.sleep(0.2)
    return {"deployment": t.name, "namespace": t.namespace, "address": address, "dp": result["dp"],
            "max_dp": max_dp, "cluster_started": started is not None, "elapsed_s": round(time.time() - t0, 2),
            "ranks": snap.get("ranks", [])}


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

    from engine_ext.ray.deployment import DeploymentHandles, destroy_deployment

    t.validated()
    _connect(t)
    registry, controller = _deployment(t)
    destroy_deployment(t.name, t.namespace, DeploymentHandles(registry, controller))
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
    return _with_engine_health(_get(registry.snapshot.remote(), timeout=10))


def _with_engine_health(snap: dict[str, Any]) -> dict[str, Any]:
    """A vLLM deployment's snapshot with each engine's health from vLLM's fault tolerance, where
    the server has it (whichever path read the snapshot)."""
    if snap.get("kind") == "vllm":
        import os

        from engine_ext.drivers.vllm_fault_tolerance import health

        snap["fault_tolerance"] = health(snap, api_key=os.environ.get("VLLM_API_KEY"))
    return snap


def status_reader(t: Target) -> Callable[[], dict[str, Any]]:
    """A function returning the registry snapshot, with the deployment resolved once: the light
    read path (eepctl.readpath) when the registry publishes one, else the Ray driver."""
    from eepctl import readpath

    t.validated()
    fast = readpath.reader(t.address, t.namespace, t.name)
    if fast is not None:
        return lambda: _with_engine_health(fast())
    _connect(t)
    registry, _ = _deployment(t, controller=False)
    if registry is None:
        raise UnreachableError(f"the registry of {t.name!r} is gone while its controller still runs; "
                               "per-rank status is unavailable until a registry exists again")
    return lambda: _with_engine_health(_get(registry.snapshot.remote(), timeout=10))


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
class _RayPending:
    """A request to the reference controller."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def wait(self, timeout_s: float) -> dict[str, Any]:
        return _get(self.ref, timeout=timeout_s)


class _HttpPending:
    """A request to a vLLM API server, run on a client thread."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self.future.result(timeout=timeout_s)
        except FutureTimeout:
            raise TransitionTimeout(f"vLLM did not answer within {timeout_s:.0f}s") from None


@contextmanager
def _requests(t: Target, max_tokens: int, api_key: str | None, timeout_s: float) -> Iterator[Submit]:
    """How to send one prompt to the deployment: its controller (reference) or the OpenAI
    completions API of its vLLM server."""
    _connect(t)
    registry, controller = _deployment(t)
    snap = _vllm_snapshot(registry, controller)
    if snap is None:
        if controller is None:
            raise UnreachableError(f"the controller of {t.name!r} is gone; the deployment cannot serve requests")
        yield lambda prompt: _RayPending(controller.generate.remote(prompt, max_tokens))
        return
    from engine_ext.drivers.vllm_scale import api_for

    api = api_for(snap, api_key, timeout_s=timeout_s)
    model = (snap.get("info") or {}).get("model") or api.served_model()

    def complete(prompt: list[int], submitted: float) -> dict[str, Any]:
        answer = api.complete(model, prompt, max_tokens, timeout_s)
        if answer["error"] is None:  # open loop: a request waiting for a client thread counts too
            answer["latency_s"] = round(time.time() - submitted, 4)
        return answer

    pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="eepctl-request")
    try:
        yield lambda prompt: _HttpPending(pool.submit(complete, prompt, time.time()))
    finally:  # after a timeout, do not wait for answers nobody reads
        pool.shutdown(wait=False, cancel_futures=True)


def generate(t: Target, prompts: list[list[int]], max_tokens: int, timeout_s: float,
             api_key: str | None = None) -> dict[str, Any]:
    """Every prompt once, concurrently; outputs and latencies."""
    t.validated()
    if max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    deadline = time.time() + timeout_s
    with _requests(t, max_tokens, api_key, timeout_s) as submit:
        pending = [submit(p) for p in prompts]
        results = [p.wait(max(0.1, deadline - time.time())) for p in pending]
    return {"deployment": t.name, "results": [
        {"prompt": p, "output": r.get("output", []), "error": loadgen.error_text(r),
         "latency_s": round(r.get("latency_s") or 0.0, 4), "rank": r.get("rank"), "moved_from": r.get("moved_from", [])}
        for p, r in zip(prompts, results)]}


def load(t: Target, prompts: list[list[int]], max_tokens: int, rate: float, duration_s: float,
         timeout_s: float, seed: int = 0, api_key: str | None = None) -> dict[str, Any]:
    """Open-loop load: ``rate`` requests per second for ``duration_s``; report outcomes and latency."""
    t.validated()
    if rate <= 0 or duration_s <= 0:
        raise UsageError("--rate and --duration must be > 0")
    if max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    with _requests(t, max_tokens, api_key, timeout_s) as submit:
        res = loadgen.open_loop(submit, prompts, rate, duration_s, timeout_s, seed)
    return {"deployment": t.name, **res}


# ---- scale -------------------------------------------------------------------------------------------
def plan(t: Target, dp: int, api_key: str | None = None) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    _connect(t)
    registry, controller = _deployment(t)
    if (snap := _vllm_snapshot(registry, controller)) is not None:
        from engine_ext.drivers import vllm_scale as scale_driver

        return scale_driver.plan(snap, dp, api_key=api_key)
    if controller is None:
        raise UnreachableError(f"the controller of {t.name!r} is gone; there is nothing to plan with")
    return _raise_if_error(_get(controller.plan.remote(dp), timeout=30))


def scale(t: Target, dp: int, *, drain_timeout_s: float, timeout_s: float, wait: bool,
          on_event: Callable[[dict[str, Any]], None] = lambda e: None, api_key: str | None = None,
          on_op: Callable[[dict[str, Any]], None] = lambda o: None) -> dict[str, Any]:
    t.validated()
    if dp < 1:
        raise UsageError(f"--dp must be >= 1, got {dp}")
    if timeout_s <= 0 or drain_timeout_s < 0:
        raise UsageError("--timeout must be > 0 and --drain-timeout >= 0")
    _connect(t)
    registry, controller = _deployment(t)
    if (snap := _vllm_snapshot(registry, controller)) is not None:
        from engine_ext.drivers import vllm_scale as scale_driver

        if not wait:
            raise UsageError("--no-wait is not available for a vLLM deployment: vLLM answers /scale_elastic_ep "
                             "only when the transition has ended")
        return scale_driver.scale(registry, snap, dp, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s,
                                  api_key=api_key, on_event=on_event)
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
        on_op(result)  # its current phase, for the live display
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


def repair(t: Target, *, timeout_s: float = 300.0, api_key: str | None = None) -> dict[str, Any]:
    """Recover what the automatic self-healing could not (dead members, a size below the
    desired one) and say what was done."""
    t.validated()
    _connect(t)
    registry, controller = _deployment(t)
    if (snap := _vllm_snapshot(registry, controller)) is not None:
        try:
            from engine_ext.drivers import vllm_fault_tolerance as fault_tolerance
        except ImportError:
            raise UsageError("repair of vLLM deployments is not available") from None
        return fault_tolerance.repair(snap, api_key=api_key, timeout_s=timeout_s)
    if controller is None:
        raise UnreachableError(f"the controller of {t.name!r} is gone; recreate the deployment "
                               f"(`eepctl down --name {t.name}` then `eepctl up --name {t.name}`)")
    return _raise_if_error(_get(controller.repair.remote(), timeout=timeout_s))


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
