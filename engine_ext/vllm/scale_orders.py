"""In vLLM's API server: carry out the scales the deployment's autoscaler decides.

The vLLM controller (engine_ext.ray.vllm_controller) admits and records an autoscaler decision in
``--mode on`` as an operation, like an ``eepctl scale``; this thread takes it (a long poll of the
controller's ``take_order``, engine_ext.ray.vllm_orders) and calls the engine client's own
``scale_elastic_ep`` on the server's event loop, the call vLLM's ``/scale_elastic_ep`` route
makes, so no HTTP request and no API key are involved. The answer goes back in the route's terms
(200; 408 for a drain timeout; 400 with vLLM's message for a ValueError; 500 otherwise). vLLM's own
``_elastic_ep_lock`` still serialises it with any scale posted to the server directly.

Started by the plugin (engine_ext.vllm.plugin) once the server serves; it waits for the
reporter thread's Ray connection and never raises into vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

log = logging.getLogger("vllm.engine_ext")

RETRY_S = 5.0  # after the controller could not be reached
PARAMS = ("new_data_parallel_size", "drain_timeout")  # AsyncLLM.scale_elastic_ep's, past self (0.32, 0.33)


def usable(engine_client: Any) -> str:
    """ "active" when the engine client's ``scale_elastic_ep`` is the coroutine this module calls,
    else "unavailable: <why>" (then ``--mode on`` is refused for the deployment)."""
    import inspect

    method = getattr(engine_client, "scale_elastic_ep", None)
    if method is None or not inspect.iscoroutinefunction(method):
        return "unavailable: the engine client has no coroutine scale_elastic_ep"
    params = tuple(inspect.signature(method).parameters)
    if params[:2] != PARAMS:
        return f"unavailable: scale_elastic_ep takes ({', '.join(params)})"
    return "active"


class OrderTaker(threading.Thread):
    """Takes the controller's scale orders and runs each through ``engine_client`` on ``loop``."""

    def __init__(self, settings: Any, engine_client: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name="eepctl-vllm-scale-orders", daemon=True)
        self.settings = settings
        self.engine_client = engine_client
        self.loop = loop
        self.carried_out = 0

    def run(self) -> None:
        from engine_ext.ray.vllm_orders import ORDER_POLL_S

        warned = False
        while not self.loop.is_closed():
            try:
                controller = self._controller()
                if controller is None:
                    time.sleep(1.0)  # the reporter thread connects to Ray and starts the controller
                    continue
                import ray

                order = ray.get(controller.take_order.remote(ORDER_POLL_S), timeout=ORDER_POLL_S + 30)
                warned = False
                if order:
                    controller.order_done.remote(order["op_id"], self.carry_out(order))
            except Exception as e:  # noqa: BLE001 - a restarting controller; serving never depends on it
                if not warned:
                    log.warning(
                        "engine_ext: scale orders not taken now (%s: %s); retrying",
                        type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "",
                    )
                    warned = True
                time.sleep(RETRY_S)

    def _controller(self) -> Any:
        import ray

        if not ray.is_initialized():
            return None
        from engine_ext.ray.names import vllm_controller_name

        try:
            return ray.get_actor(vllm_controller_name(self.settings.deployment), namespace=self.settings.namespace)
        except ValueError:
            return None

    def carry_out(self, order: dict[str, Any]) -> dict[str, Any]:
        """vLLM's scale to ``order["to_size"]`` through the engine client; ``{"code", "body"}`` as
        vLLM's route answers. No answer by the order's deadline: the controller times it out."""
        to, drain = int(order["to_size"]), max(1, int(order.get("drain_timeout_s") or 1))
        log.info("engine_ext: autoscaler's %s: scaling to DP %d through the engine client", order["op_id"], to)
        future = asyncio.run_coroutine_threadsafe(self.engine_client.scale_elastic_ep(to, drain), self.loop)
        done, _ = concurrent.futures.wait([future], timeout=max(1.0, float(order["deadline"]) - time.time()))
        if not done:
            return {"code": 0, "body": "no answer by the deadline"}
        self.carried_out += 1
        error = future.exception()
        if error is None:
            return {"code": 200, "body": {"message": f"Scaled to {to} data parallel engines"}}
        if isinstance(error, TimeoutError):
            return {"code": 408, "body": {"detail": f"Scale failed due to request drain timeout after {drain} seconds"}}
        if isinstance(error, ValueError):
            return {"code": 400, "body": {"detail": str(error)}}
        return {"code": 500, "body": {"detail": f"Scale failed: {type(error).__name__}: {error}"[:300]}}
