"""Every use of Ray's private API, in one module: what Ray 2.60 offers no public way to do.

Public Ray is used everywhere else (``ray.get_actor`` and ``ray.util.list_named_actors`` for
actors by name, ``ray.util.get_placement_group`` / ``placement_group_table`` /
``remove_placement_group`` for placement groups). What is left, and why it is here:

* an actor handle's id (``ActorHandle._actor_id``): the ingresses tell one incarnation of a rank
  actor from the next by it, and nothing public reads it from a handle;
* an actor's process id and node (``ray._private.state.state.actor_table``): a rank process is
  SIGKILLed by pid when it is stopped (``ray.util.state`` needs the dashboard, which `eepctl up`
  does not start), and how dead actors ended (the vLLM loop names a killed engine core);
* each node's free resources (``ray._private.state.available_resources_per_node``): placement;
* the GCS key-value store (``ray.experimental.internal_kv._internal_kv_*``): the controller's
  durable state, the registry's endpoint, the ingresses' ports;
* the client's token check (``ray._private.authentication``): eepctl reports a refused token at
  once instead of after ray.init's retries.

``CATALOGUE`` names each private callable with the parameters this module passes it;
tests/test_ray_private.py fails when the installed Ray no longer has one of them so, and when any
other module reaches into Ray's private names. Ray is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

# (module, attribute path, the parameters this module passes by name or position)
CATALOGUE: list[tuple[str, str, tuple[str, ...]]] = [
    ("ray.actor", "ActorHandle._actor_id", ()),
    ("ray._private.state", "state.actor_table", ("actor_id", "actor_state_name")),
    ("ray._private.state", "available_resources_per_node", ()),
    ("ray.experimental.internal_kv", "_internal_kv_get", ("key", "namespace")),
    ("ray.experimental.internal_kv", "_internal_kv_put", ("key", "value", "overwrite", "namespace")),
    ("ray.experimental.internal_kv", "_internal_kv_del", ("key", "del_by_prefix", "namespace")),
    ("ray._private.authentication.grpc_authentication_client_interceptor", "_get_authentication_metadata_tuple", ()),
    (
        "ray._private.authentication.authentication_token_setup",
        "maybe_enable_token_auth_if_token_available",
        ("warn_if_disabled",),
    ),
]


def actor_id(handle: Any) -> str:
    """The id (hex) of the actor ``handle`` names: a restarted actor keeps it, a new one has another."""
    return str(handle._actor_id.hex())


def actor_process(actor_id_hex: str) -> tuple[int, str]:
    """(pid, node id) of the actor's current process, (0, "") when Ray does not know them."""
    from ray._private.state import state

    info = state.actor_table(actor_id_hex) or {}
    return int(info.get("Pid") or 0), str((info.get("Address") or {}).get("NodeID") or "")


def dead_actors() -> list[dict[str, Any]]:
    """Ray's records of the cluster's dead actors (``DeathCause`` among their fields)."""
    from ray._private.state import state

    return list((state.actor_table(None, actor_state_name="DEAD") or {}).values())


def alive_actors() -> list[dict[str, Any]]:
    """Ray's records of the cluster's live actors (``Pid`` among their fields); needs no dashboard."""
    from ray._private.state import state

    return list((state.actor_table(None, actor_state_name="ALIVE") or {}).values())


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Node id -> its resources free now."""
    from ray._private.state import available_resources_per_node as per_node

    return dict(per_node())


def kv_get(key: str | bytes, namespace: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_put(key: str | bytes, value: str | bytes, namespace: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_del(key: str | bytes, namespace: str, by_prefix: bool = False) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, del_by_prefix=by_prefix, namespace=namespace)


def auth_metadata() -> tuple[tuple[str, str], ...]:
    """The gRPC metadata carrying this process's Ray token (empty without one); ImportError on a
    Ray without token authentication."""
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        _get_authentication_metadata_tuple,
    )

    return tuple(_get_authentication_metadata_tuple())


def adopt_saved_token() -> bool:
    """Turn token authentication on when a token is saved and RAY_AUTH_MODE is unset (Ray's own
    rule for a local cluster); whether it did."""
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))
