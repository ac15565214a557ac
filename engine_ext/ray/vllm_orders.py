"""Scale orders from a vLLM deployment's controller to the plugin in its API server.

An autoscaler decision in ``--mode on`` becomes an operation of the vLLM controller (admitted,
recorded and followed like an ``eepctl scale``: one scale at a time) but is carried out inside
vLLM's API server, where the plugin (engine_ext.vllm.scale_orders) holds the engine client and
calls its ``scale_elastic_ep``: no HTTP request, so no API key travels or is kept. The plugin
asks for work with a long poll (``take``, one actor call per ORDER_POLL_S when idle) and answers
with what vLLM's ``/scale_elastic_ep`` route would have answered (``answer``); the controller's
scale thread waits for that answer (``carried_out``) as it waits for the HTTP reply of an
``eepctl scale``. Orders live in the controller's memory only: one whose controller died is
ended by the restarted controller's orphan watch with the size vLLM reports.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from engine_ext.protocol import TransitionFailed, TransitionTimeout

ORDER_POLL_S = 20.0  # the plugin's long poll: an idle API server asks once per this
ORDER_TAKE_S = 45.0  # an order no API server took by then fails (no plugin taking orders)


class ScaleOrders:
    """The one pending order and the answers, between the controller's threads and the plugin's poll."""

    def __init__(self, take_within_s: float = ORDER_TAKE_S) -> None:
        self.take_within_s = take_within_s
        self._changed = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._taken: set[str] = set()
        self._answers: dict[str, dict[str, Any]] = {}

    def take(self, wait_s: float = ORDER_POLL_S) -> dict[str, Any] | None:
        """The plugin's long poll: the pending order (handed once), or None after ``wait_s``."""
        with self._changed:
            self._changed.wait_for(lambda: self._pending is not None, timeout=max(0.0, wait_s))
            order, self._pending = self._pending, None
            if order is not None:
                self._taken.add(order["op_id"])
                self._changed.notify_all()
            return order

    def answer(self, op_id: str, reply: dict[str, Any]) -> bool:
        """The plugin's answer to order ``op_id`` (``{"code", "body"}``); False for an unknown order."""
        with self._changed:
            if op_id not in self._taken:
                return False
            self._answers[op_id] = dict(reply)
            self._changed.notify_all()
            return True

    def carried_out(self, order: dict[str, Any]) -> tuple[int, Any]:
        """Hand ``order`` over and wait for the plugin's answer until the order's deadline: (HTTP
        status, body) as vLLM's route answers. TransitionFailed when no API server takes it within
        ``take_within_s``, TransitionTimeout when its answer does not come by the deadline."""
        op_id = order["op_id"]
        with self._changed:
            self._pending = dict(order)
            self._changed.notify_all()
            took = self._changed.wait_for(lambda: op_id in self._taken, timeout=self.take_within_s)
            if not took:
                self._pending = None
                raise TransitionFailed(
                    f"{op_id}: no vLLM API server took the autoscaler's scale within "
                    f"{self.take_within_s:.0f}s (is the engine_ext plugin loaded in it?)"
                )
            left = float(order["deadline"]) - time.time()
            answered = self._changed.wait_for(lambda: op_id in self._answers, timeout=max(0.0, left))
            self._taken.discard(op_id)  # a late answer is refused, not kept
            if not answered:
                raise TransitionTimeout(f"{op_id}: vLLM's API server did not finish the scale within the deadline")
            reply = self._answers.pop(op_id)
        return int(reply.get("code") or 0), reply.get("body")
