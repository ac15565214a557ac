"""The one interface a client drives a deployment through, whatever engine serves it.

Modelled on kubectl's ``scale.Scaler``: one interface, one implementation per engine kind
(``drivers.reference``, ``drivers.vllm``), chosen once by ``drivers.open_deployment``; the client
never asks which kind it holds. Options are validated by the client before a driver is called;
a driver raises the exit-code table's errors (engine_ext.protocol) for what only it can refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

EventSink = Callable[[dict[str, Any]], None]
"""Receives each rank event of a running operation, for a live display."""


class Pending(Protocol):
    """One request in flight."""

    def wait(self, timeout_s: float) -> dict[str, Any]: ...


Submit = Callable[[list[int]], Pending]
"""Sends one prompt (token ids); its answer has ``output``, ``latency_s``, ``error``, ``moved_from``."""


class Driver(Protocol):
    """What a client can ask of one deployment."""

    name: str
    kind: str

    def plan(self, dp: int, retire: list[int] | None = None) -> dict[str, Any]:
        """What a scale to ``dp`` would do (a scale-down removes the ``retire`` ranks, else the
        emptiest); changes nothing."""
        ...

    def scale(
        self,
        dp: int,
        *,
        drain_timeout_s: float,
        timeout_s: float,
        wait: bool,
        on_event: EventSink,
        on_op: EventSink,
        request_id: str | None = None,
        retire: list[int] | None = None,
    ) -> dict[str, Any]:
        """Scale to ``dp``: the finished operation (``wait``) or the accepted one. ``on_op`` gets the
        operation as it runs where the engine reports it, ``on_event`` each rank event.
        ``request_id``: a retry with the same id is the same operation."""
        ...

    def standby(self, count: int, *, timeout_s: float) -> dict[str, Any]:
        """Keep ``count`` ranks launched ahead (0: none), for a scale-up to take instead of launching;
        the summary once they are ready: ``size``, ``ready`` (their numbers), ``taken`` (adopted so far)."""
        ...

    def release(self, *, timeout_s: float) -> dict[str, Any] | None:
        """What `down` gives back before it removes the deployment's actors, where the engine holds
        something they do not own (vLLM: engine cores prepared ahead); None when nothing is held."""
        ...

    def repair(self, *, timeout_s: float) -> dict[str, Any]:
        """Recover what self-healing could not; the record of what was done."""
        ...

    def set_autoscale(self, policy: dict[str, Any]) -> dict[str, Any]:
        """Change the autoscaling policy the deployment keeps (``policy`` over the current one);
        the policy set and the one before."""
        ...

    def autoscale_policy(self) -> dict[str, Any]:
        """The policy (None: never set) and the latest decision."""
        ...

    def autoscale_decisions(self, since: float = 0.0) -> dict[str, Any]:
        """The autoscaler's decisions after ``since`` (a time), oldest first."""
        ...

    def endpoints(self) -> list[str]:
        """The deployment's HTTP endpoints (OpenAI's completions API: engine_ext.drivers.completions
        sends requests there), asked of the cluster: the fallback when no snapshot names them."""
        ...
