"""The controller's durable state, kept in Ray's GCS key-value store.

Why the GCS KV and not the registry: the registry is an actor and can die with the controller
(both are killed together in a test, and on the head node both go together); the GCS outlives
every actor of the deployment, so a restarted controller — or a restarted registry — finds the
desired spec, the members and their epoch, the layout, the operation log and the running
operation's last recorded phase there. Written at each phase and whenever the world changes
(only when the content changed), deleted by ``eepctl down``.
"""

from __future__ import annotations

import json
from typing import Any

from engine_ext.ray import ray_private

_KV_NAMESPACE = "eepctl"


def state_key(namespace: str, deployment: str) -> bytes:
    return f"controller/{namespace}/{deployment}".encode()


class DurableState:
    """One deployment's controller state in the GCS KV (JSON)."""

    def __init__(self, namespace: str, deployment: str) -> None:
        self.key = state_key(namespace, deployment)
        self._last: bytes | None = None
        self.writes = 0  # puts to the GCS KV by this process (an idle deployment makes none)

    def load(self) -> dict[str, Any] | None:
        raw = ray_private.kv_get(self.key, _KV_NAMESPACE)
        if not raw:
            return None
        self._last = raw
        return json.loads(raw)

    def save(self, state: dict[str, Any]) -> bool:
        """Write ``state`` when it differs from what was written last; whether it wrote."""
        raw = json.dumps(state, sort_keys=True, default=str).encode()
        if raw == self._last:
            return False
        ray_private.kv_put(self.key, raw, _KV_NAMESPACE)
        self._last = raw
        self.writes += 1
        return True

    def delete(self) -> None:
        ray_private.kv_del(self.key, _KV_NAMESPACE)
        self._last = None
