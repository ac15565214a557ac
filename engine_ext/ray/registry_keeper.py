"""The controller's hold on its deployment's registry: the handle, re-resolved by name (the
registry may be recreated), and the watchdog that recreates it when it is gone, giving the new
one back what the controller knows (the deployment info, the operation history, the
controller's own events; the ranks re-send theirs when they see a new registry)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray
from engine_ext.ray.names import registry_name


class RegistryKeeper:
    """One deployment's registry, as its controller reaches it and keeps it alive."""

    def __init__(
        self,
        deployment: str,
        namespace: str,
        *,
        expected_ranks: Callable[[], int],
        restore: Callable[[], tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]],
    ) -> None:
        self.deployment = deployment
        self.namespace = namespace
        self.expected_ranks = expected_ranks
        self.restore = restore  # -> (info, operations, events) a new registry is given
        self.registry: Any = None  # None while it is gone (a restarted controller may find it so)
        self._resolved_at = 0.0
        self.handle()
        self._watchdog: asyncio.Task | None = None
        self.recreated = 0

    def handle(self) -> Any:
        """The registry handle, re-resolved by name at most every 2 s (it may be recreated)."""
        now = time.time()
        if self.registry is None or now - self._resolved_at > 2.0:
            self._resolved_at = now
            try:
                self.registry = ray.get_actor(registry_name(self.deployment), namespace=self.namespace)
            except ValueError:
                pass
        return self.registry

    def start(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        """`down` kills the registry next: do not bring it back."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def _watch(self, interval_s: float = 1.0) -> None:
        """Recreate the registry (same name, namespace, detached) when it is gone, telling it how
        many ranks to expect (it says it is rebuilding until they report)."""
        from engine_ext.ray.placement import on_this_node
        from engine_ext.ray.registry import Registry

        name = registry_name(self.deployment)
        while True:
            await asyncio.sleep(interval_s)
            try:
                ray.get_actor(name, namespace=self.namespace)
                continue
            except ValueError:
                pass
            try:
                reg = (
                    ray.remote(Registry)
                    .options(
                        name=name,
                        namespace=self.namespace,
                        lifetime="detached",
                        num_cpus=0,
                        scheduling_strategy=on_this_node(),
                    )
                    .remote(self.deployment, expected_ranks=self.expected_ranks())
                )
            except ValueError:  # the old name is not released yet, or someone else recreated it
                continue
            # What the controller knows now, submitted before anything else can reach the new
            # registry (a caller's calls to an actor run in the order sent): a record made while
            # the new registry starts (a recovery ending meanwhile) follows the snapshot instead of
            # going to the dead handle and being lost.
            info, ops, events = self.restore()
            refs = [reg.set_info.remote(info)] if info else []
            refs += [reg.record_operation.remote(op) for op in ops]
            if events:
                refs.append(reg.report_events.remote(events))
            self.registry = reg
            self._resolved_at = time.time()
            try:
                await asyncio.gather(*refs)
            except Exception:  # noqa: BLE001 - the next round retries with whatever exists then
                continue
            self.recreated += 1
