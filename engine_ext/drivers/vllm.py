"""The vLLM driver: a vLLM server's API and the registry its plugin created (kind "vllm").

It holds the registry snapshot read when the deployment was opened (the API URL, the DP bounds,
any operation in flight) and delegates to vllm_scale (dry run; a scale is asked of the deployment's
in-cluster controller, engine_ext.ray.vllm_controller) and vllm_fault_tolerance (repair, health).
Requests go to the API server through engine_ext.drivers.completions, as a reference
deployment's go to its ingresses. The API key goes only into request headers.
"""

from __future__ import annotations

import os
from typing import Any

from engine_ext.drivers.base import EventSink
from engine_ext.protocol import DeploymentKind, EepError, PreconditionError, UsageError

KIND = DeploymentKind.VLLM.value


def with_health(snap: dict[str, Any]) -> dict[str, Any]:
    """The snapshot with each engine's health from vLLM's fault tolerance, where the server has it.
    `status` takes no --api-key: the key comes from VLLM_API_KEY, the other commands' default."""
    from engine_ext.drivers.vllm_fault_tolerance import health

    snap["fault_tolerance"] = health(snap, api_key=os.environ.get("VLLM_API_KEY"))
    return snap


def refuse_retire(retire: list[int] | None) -> None:
    """vLLM's /scale_elastic_ep always removes the highest ranks: naming others is refused."""
    if retire:
        raise PreconditionError(
            "--retire is not available for a vLLM deployment: vLLM removes its highest ranks on a scale-down"
        )


class VllmDriver:
    """A vLLM deployment, through the API server its registry names."""

    kind = KIND

    def __init__(self, registry: Any, snap: dict[str, Any], api_key: str | None = None) -> None:
        self.name = str(snap["deployment"])
        self.registry = registry
        self.snap = snap
        self._api_key = api_key

    def plan(self, dp: int, retire: list[int] | None = None) -> dict[str, Any]:
        from engine_ext.drivers import vllm_scale

        refuse_retire(retire)
        return vllm_scale.plan(self.snap, dp, api_key=self._api_key)

    def scale(
        self,
        dp: int,
        *,
        drain_timeout_s: float,
        timeout_s: float,
        wait: bool,
        on_event: EventSink = lambda e: None,
        on_op: EventSink = lambda o: None,
        request_id: str | None = None,
        retire: list[int] | None = None,
    ) -> dict[str, Any]:
        """Asked of the deployment's in-cluster controller, which runs and records it; ``on_op``
        gets the record as it stands there, ``on_event`` each rank event. A retry with the same
        ``request_id`` gets the same operation."""
        from engine_ext.drivers import vllm_scale

        refuse_retire(retire)
        return vllm_scale.scale(
            self.registry,
            self.snap,
            dp,
            drain_timeout_s=drain_timeout_s,
            timeout_s=timeout_s,
            wait=wait,
            api_key=self._api_key,
            request_id=request_id,
            on_event=on_event,
            on_op=on_op,
        )

    def standby(self, count: int, *, timeout_s: float) -> dict[str, Any]:
        """vLLM's prepare for DP + ``count`` held open by the plugin in the API server (needs a server
        started with ``EEPCTL_VLLM_STANDBY``); asked through the registry (engine_ext.drivers.vllm_standby)."""
        from engine_ext.drivers import vllm_standby

        return vllm_standby.set_count(self.registry, self.snap, count, timeout_s=timeout_s)

    def release(self, *, timeout_s: float) -> dict[str, Any] | None:
        """The engine cores the API server holds prepared, dropped (count 0): the server outlives `down`
        and would keep them otherwise."""
        from engine_ext.drivers import vllm_standby

        return vllm_standby.release_for_down(self.registry, timeout_s=timeout_s)

    def repair(self, *, timeout_s: float) -> dict[str, Any]:
        """First the shared-memory segments killed vLLM processes left on the cluster's nodes
        (engine_ext.ray.shm_sweep), then vLLM's own recovery; what was removed is among the
        record's ``actions`` (or in the error's detail, ``shm_removed``)."""
        try:
            from engine_ext.drivers import vllm_fault_tolerance as fault_tolerance
        except ImportError:
            raise UsageError("repair of vLLM deployments is not available") from None
        from engine_ext.ray.shm_sweep import remove_orphan_segments_on_nodes

        removed = remove_orphan_segments_on_nodes()
        try:
            res = fault_tolerance.repair(self.snap, api_key=self._api_key, timeout_s=timeout_s)
        except EepError as e:
            e.detail["shm_removed"] = removed
            raise
        res["actions"] = removed + list(res.get("actions") or [])
        return res

    def set_autoscale(self, policy: dict[str, Any]) -> dict[str, Any]:
        """Kept by the deployment's vLLM controller, whose loop runs the shared decision core on
        vLLM's own figures; in ``--mode on`` its scales are carried out by the plugin inside the API
        server (no key; refused, exit 4, where that plugin takes no scale orders)."""
        from engine_ext.drivers.reference import raise_if_error
        from engine_ext.ray.deployment import call
        from engine_ext.ray.vllm_controller import controller_for

        controller = controller_for(self.name)
        return raise_if_error(call(controller.set_autoscale.remote(policy, self._api_key), timeout=60))

    def autoscale_policy(self) -> dict[str, Any]:
        return self._autoscale_read("autoscale_show", {"deployment": self.name, "policy": None, "last": None})

    def autoscale_decisions(self, since: float = 0.0) -> dict[str, Any]:
        return self._autoscale_read(
            "autoscale_decisions", {"deployment": self.name, "policy": None, "decisions": []}, since
        )

    def _autoscale_read(self, method: str, empty: dict[str, Any], *args: Any) -> dict[str, Any]:
        """A read: no controller running means no policy (reads create nothing)."""
        from engine_ext.drivers.reference import raise_if_error
        from engine_ext.ray.deployment import call
        from engine_ext.ray.vllm_controller import existing_controller

        controller = existing_controller(self.name)
        if controller is None:
            return empty
        return raise_if_error(call(getattr(controller, method).remote(*args), timeout=30))

    def endpoints(self) -> list[str]:
        """The API server the plugin registered."""
        from engine_ext.control.vllm_deployment import api_for

        return [api_for(self.snap, self._api_key).base_url]
