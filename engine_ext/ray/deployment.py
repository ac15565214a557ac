"""A deployment's actors on Ray: create them with their placement options, find them, stop them.

Clients (eepctl, benchmarks) call these functions instead of building actors themselves, so the
actor options (detached, named, zero CPUs for the control actors) live in one place. Ray is
imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine_ext.protocol import (
    EepError,
    TransitionTimeout,
    UnreachableError,
    error_from_record,
)
from engine_ext.ray.names import (
    REGISTRY_PREFIX,
    controller_name,
    ingress_name,
    registry_name,
    vllm_controller_name,
)


@dataclass
class DeploymentHandles:
    """The two named actors of a reference deployment (either may be None when looked up)."""

    registry: Any
    controller: Any


def call(ref: Any, timeout: float | None = 30.0) -> Any:
    """``ray.get`` with Ray's failures turned into the exit-code table's errors."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise TransitionTimeout(f"the cluster did not answer within {timeout:.0f}s") from None
    except ActorUnavailableError as e:  # a controller being restarted by Ray: the call may be retried
        raise UnreachableError(
            "an actor of the deployment is being restarted by Ray; retry in a few seconds",
            detail={"retriable": True, "ray": str(e).splitlines()[0]},
        ) from None
    except RayActorError as e:
        raise UnreachableError(f"an actor of the deployment is gone: {str(e).splitlines()[0]}") from None


def actor(name: str, namespace: str) -> Any:
    """The named actor, or None when there is none."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def list_deployments(namespace: str) -> list[str]:
    """Names of the deployments that have a registry in ``namespace``."""
    from ray.util import list_named_actors

    names = list_named_actors(all_namespaces=True)
    return sorted(
        a["name"][len(REGISTRY_PREFIX) :]
        for a in names
        if a.get("namespace") == namespace and a["name"].startswith(REGISTRY_PREFIX)
    )


def create_deployment(
    name: str,
    namespace: str,
    cfg: dict[str, Any],
    dp: int,
    max_dp: int,
    cpus: float,
    gpus: float,
    timeout_s: float,
    placement: dict[str, Any] | None = None,
    on_rank_failure: str = "replace",
    standby: int = 0,
    health_deadline_s: float = 5.0,
    ingress: int = 1,
    api_key_sha256: str = "",
    host: str = "0.0.0.0",
    port: int = 0,
) -> tuple[DeploymentHandles, dict[str, Any]]:
    """Create the registry, ``ingress`` ingresses (listening on ``host``; ingress i at ``port`` + i,
    or any free port with ``port`` 0) and the controller (detached, named) and start ``dp`` ranks.

    Returns the handles and the controller's start result. When anything of it fails (an
    ingress that cannot listen included), everything it created is removed again and gone
    before the error is raised, so a failed ``up`` leaves nothing behind and the next one starts
    clean."""
    cfg, control = _prepare(name, namespace, cfg, max_dp)
    handles = DeploymentHandles(None, None)
    try:
        handles.registry = _registry(name, namespace, control)
        info = {
            "dp": dp,
            "max_dp": max_dp,
            "created": time.time(),
            "cpus_per_rank": cpus,
            "gpus_per_rank": gpus,
            "config": cfg,
            "placement": placement or {},
            "desired_dp": dp,
            "on_rank_failure": on_rank_failure,
        }
        ingresses = create_ingresses(name, namespace, ingress, api_key_sha256, host=host, port=port)
        info["ingress"] = [ready(h) for h in ingresses]
        call(handles.registry.set_info.remote(info))
        handles.controller = _controller(name, namespace, info, placement, standby, health_deadline_s, ingress, control)
        result = call(handles.controller.start.remote(dp, timeout_s), timeout=timeout_s + 30)
        if isinstance(result, dict) and isinstance(result.get("error"), dict):
            raise error_from_record(result["error"])
    except BaseException as e:
        _remove_created(name, namespace, handles, quick=not isinstance(e, Exception))
        raise
    return handles, {**result, "ingress": info["ingress"]}  # where each ingress listens, as it answered


def _prepare(name: str, namespace: str, cfg: dict[str, Any], max_dp: int) -> tuple[dict[str, Any], Any]:
    """The deployment's config with its capture policy resolved, and the control plane's place;
    a durable state an old deployment of this name left is deleted (nothing is taken over)."""
    from engine_ext.capture_memory import size_captures
    from engine_ext.config import EngineConfig
    from engine_ext.ray.durable import DurableState
    from engine_ext.ray.placement import control_nodes, on_node

    DurableState(namespace, name).delete()  # a new deployment takes nothing over from an old one
    engine_cfg = EngineConfig.from_dict(cfg)
    size_captures(engine_cfg, max_dp)  # resolves capture policy auto before any rank starts
    # The control plane's place is the policy's (the head node, docs/operations.md), never the
    # caller's. Hard: Ray's soft affinity put a zero-CPU actor on another node (1 of 3 tries on the
    # two-node test cluster), and the head's loss is the cluster's anyway.
    return engine_cfg.to_dict(), on_node(control_nodes()[0], soft=False)


def _registry(name: str, namespace: str, control: Any) -> Any:
    """The registry actor (detached, named, zero CPUs, on the control plane's node)."""
    import ray
    from engine_ext.ray.registry import Registry

    return (
        ray.remote(Registry)
        .options(
            name=registry_name(name),
            namespace=namespace,
            lifetime="detached",
            num_cpus=0,
            scheduling_strategy=control,
        )
        .remote(name)
    )


def _remove_created(name: str, namespace: str, handles: DeploymentHandles, quick: bool) -> None:
    """A start that failed: remove everything the deployment owns (found by name) and wait until it
    is gone. ``quick`` (an interrupt): kill the actors only; `eepctl down` removes the rest."""
    import ray

    if quick:
        for h in (handles.controller, handles.registry, *(actor(n, namespace) for n in ingress_names(name, namespace))):
            if h is not None:
                ray.kill(h, no_restart=True)
        return
    try:
        destroy_deployment(name, namespace, handles)
    except Exception:  # noqa: BLE001 - the start's error is the one to report; `eepctl down` removes the rest
        pass


def _controller(
    name: str,
    namespace: str,
    info: dict[str, Any],
    placement: dict[str, Any] | None,
    standby: int,
    health_deadline_s: float,
    ingress: int,
    control: Any,
) -> Any:
    """The controller actor, made with what the registry was told at creation (``info``: config,
    sizes, resources per rank, failure policy). Restarted by Ray whenever it dies (its state is
    durable: engine_ext.ray.durable); calls in flight at its death fail, and are not retried, so a
    scale is never sent twice."""
    import ray
    from engine_ext.ray.controller import Controller

    return (
        ray.remote(Controller)
        .options(
            name=controller_name(name),
            namespace=namespace,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=1000,
            scheduling_strategy=control,
            max_restarts=-1,
            max_task_retries=0,
        )
        .remote(
            name,
            namespace,
            info["config"],
            info["max_dp"],
            info["cpus_per_rank"],
            info["gpus_per_rank"],
            placement,
            info["on_rank_failure"],
            standby,
            health_deadline_s,
            ingress,
        )
    )


def ready(ingress: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Where an ingress listens, once it does; the error its start ended with otherwise (a port
    that is taken: PreconditionError)."""
    answer = call(ingress.ready.remote(), timeout=timeout_s)
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        raise error_from_record(answer["error"])
    return answer


INGRESS_PLACE_TRIES = 5  # an ingress Ray started on another node than asked is made again, this often


def create_ingresses(
    name: str, namespace: str, count: int, api_key_sha256: str = "", *, host: str = "0.0.0.0", port: int = 0
) -> list[Any]:
    """``count`` ingress actors (engine_ext.ray.ingress), restarted by Ray when they die, listening
    on ``host`` (ingress i at ``port`` + i; any free port with ``port`` 0); spread
    over the alive nodes, the head node first (placement.control_nodes): held to the head (its loss
    is the cluster's), soft elsewhere (a restart after that node died lands on a live one). Ray's
    soft affinity may start a zero-CPU actor elsewhere (seen on the two-node test cluster): one
    that did is made again, up to four times, after 0.5, 1, 2 and 4 s (on a busy head the other
    node's state reaches the scheduler late: four tries half a second apart still missed it once
    in three runs of the suite), so the spread holds."""
    from engine_ext.ray.placement import control_nodes

    nodes = control_nodes()
    handles = []
    for i in range(count):
        want, soft = nodes[i % len(nodes)], i % len(nodes) > 0
        for attempt in range(INGRESS_PLACE_TRIES):
            handle = _ingress(name, namespace, i, api_key_sha256, want, soft, host, port + i if port else 0)
            last = attempt == INGRESS_PLACE_TRIES - 1
            if not soft or last or ready(handle)["node_id"] == want.node_id:
                break
            _remove_named(handle, ingress_name(name, i), namespace)
            time.sleep(0.5 * 2**attempt)
        handles.append(handle)
    return handles


def _ingress(
    name: str, namespace: str, index: int, api_key_sha256: str, node: Any, soft: bool, host: str, port: int
) -> Any:
    import ray
    from engine_ext.ray.ingress import Ingress
    from engine_ext.ray.placement import on_node

    return (
        ray.remote(Ingress)
        .options(
            name=ingress_name(name, index),
            namespace=namespace,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=-1,
            max_task_retries=0,
            scheduling_strategy=on_node(node, soft=soft),
        )
        .remote(name, namespace, index, api_key_sha256, port, host)
    )


def _remove_named(handle: Any, actor_name: str, namespace: str, wait_s: float = 10.0) -> None:
    """Kill an actor for good and wait until its name is free again."""
    import ray

    ray.kill(handle, no_restart=True)
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            ray.get_actor(actor_name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)


def ingress_names(name: str, namespace: str) -> list[str]:
    """The ingress actors of deployment ``name`` that Ray lists."""
    from ray.util import list_named_actors

    prefix = ingress_name(name, 0)[:-1]
    return sorted(
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a.get("namespace") == namespace and a["name"].startswith(prefix) and a["name"][len(prefix) :].isdigit()
    )


def destroy_deployment(name: str, namespace: str, handles: DeploymentHandles, wait_s: float = 30.0) -> list[str]:
    """Stop the controller (which stops its ranks), then remove everything of the deployment that
    Ray still lists, found by what the deployment owns (engine_ext.ray.leftovers), not by what a
    controller remembers: rank and standby actors, their placement groups, the vLLM controller,
    the registry and the controller, the durable state and the registry's endpoint. Works with no
    controller at all, and a second run finds nothing. Waits until the names are gone, so that
    returning means stopped. Returns what had to be removed by name (no controller held it)."""
    from ray.util import list_named_actors

    import ray
    from engine_ext.ray import leftovers

    if handles.controller is not None:
        try:
            call(handles.controller.stop.remote(), timeout=60)
        except EepError:
            pass
    removed = leftovers.remove_unheld(namespace, name, keep=())
    ingresses = ingress_names(name, namespace)
    for n in ingresses:  # after the controller's stop: what they held has failed ("stopping")
        if (h := actor(n, namespace)) is not None:
            ray.kill(h, no_restart=True)
    vllm_controller = actor(vllm_controller_name(name), namespace)
    for h in (vllm_controller, handles.controller, handles.registry):
        if h is not None:
            ray.kill(h, no_restart=True)
    if vllm_controller is not None:
        removed.append(f"actor {vllm_controller_name(name)}")
    _forget_stores(name, namespace)
    # ray.kill only queues the request: wait until the names are really gone.
    names = {registry_name(name), controller_name(name), vllm_controller_name(name), *ingresses}
    deadline = time.time() + wait_s
    while True:
        alive = {
            a["name"]
            for a in list_named_actors(all_namespaces=True)
            if a.get("namespace") == namespace and a["name"] in names
        }
        alive |= set(leftovers.still_held(namespace, name, removed))
        if not alive:
            return removed
        if time.time() > deadline:
            raise TransitionTimeout(
                f"deployment {name!r} did not stop within {wait_s:.0f}s (still alive: {sorted(alive)})"
            )
        time.sleep(0.2)


def _forget_stores(name: str, namespace: str) -> None:
    """The deployment's entries in the GCS key-value store: the controller's durable state and
    the registry's read-path endpoint."""
    from engine_ext.ray import ray_private
    from engine_ext.ray.durable import DurableState
    from engine_ext.ray.ingress_listen import port_key_prefix
    from engine_ext.ray.registry import KV_NAMESPACE, endpoint_key

    DurableState(namespace, name).delete()
    ray_private.kv_del(endpoint_key(namespace, name), KV_NAMESPACE)
    ray_private.kv_del(port_key_prefix(namespace, name), KV_NAMESPACE, by_prefix=True)


def has_leftovers(name: str, namespace: str) -> bool:
    """Whether anything of deployment ``name`` is left with its registry and controller gone (so
    that `down` still removes it)."""
    from engine_ext.ray import leftovers, ray_private
    from engine_ext.ray.durable import DurableState
    from engine_ext.ray.registry import KV_NAMESPACE, endpoint_key

    if (
        leftovers.owned(namespace, name).names()
        or actor(vllm_controller_name(name), namespace) is not None
        or ingress_names(name, namespace)
    ):
        return True
    return DurableState(namespace, name).load() is not None or bool(
        ray_private.kv_get(endpoint_key(namespace, name), KV_NAMESPACE)
    )
