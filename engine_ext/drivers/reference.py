"""The reference engine's driver: its controller and registry actors on Ray.

The controller admits and runs scales and repairs and keeps the standby pool (requests never pass
it: they go to the ingresses' HTTP endpoints, engine_ext.drivers.completions); the registry holds
the ranks' events and adds their phase timings to a finished operation. Either handle may be None
(its actor is gone); each method says what is lost then.
"""

from __future__ import annotations

import time
from typing import Any

from engine_ext.drivers.base import EventSink
from engine_ext.protocol import (
    DeploymentKind,
    EepError,
    OpState,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    error_from_record,
)

KIND = DeploymentKind.REFERENCE.value


def _get(ref: Any, timeout: float | None = 30.0) -> Any:
    from engine_ext.ray.deployment import call

    return call(ref, timeout=timeout)


def raise_if_error(result: Any) -> Any:
    """``result``, unless it is the controller's record of a refusal: then that error."""
    if isinstance(result, dict) and isinstance(result.get("error"), dict):
        raise error_from_record(result["error"])
    return result


def check_outcome(op: dict[str, Any]) -> dict[str, Any]:
    """Map a finished operation to the exit-code table (raises for every failure)."""
    raise_if_error(op)
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


class ReferenceDriver:
    """A reference deployment through its controller and registry actor handles."""

    kind = KIND

    def __init__(self, name: str, registry: Any, controller: Any) -> None:
        self.name = name
        self.registry = registry
        self.controller = controller

    def _controller(self, consequence: str) -> Any:
        if self.controller is None:
            raise UnreachableError(f"the controller of {self.name!r} is gone; {consequence}")
        return self.controller

    def plan(self, dp: int, retire: list[int] | None = None) -> dict[str, Any]:
        controller = self._controller("there is nothing to plan with")
        extra = [retire] if retire else []  # an older controller takes no retire argument
        return raise_if_error(_get(controller.plan.remote(dp, *extra), timeout=30))

    def standby(self, count: int, *, timeout_s: float) -> dict[str, Any]:
        """The controller's standby pool of launched ranks, resized; its summary once filled."""
        controller = self._controller("there is no standby pool to resize")
        return raise_if_error(_get(controller.set_standby.remote(count), timeout=timeout_s))

    def release(self, *, timeout_s: float) -> dict[str, Any] | None:
        """Nothing: the standby pool's ranks are the deployment's actors, which `down` removes."""
        return None

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
        controller = self._controller("the deployment cannot scale")
        extra = [request_id, retire] if retire else [request_id] if request_id else []
        accepted = raise_if_error(
            _get(controller.scale.remote(dp, drain_timeout_s, timeout_s, False, *extra), timeout=60)
        )
        op_id = accepted["op_id"]
        if not wait:
            return accepted
        seq = 0
        deadline = time.time() + timeout_s + 30
        while True:
            result = self._wait_op(controller, op_id, deadline)
            on_op(result)  # its current phase, for the live display
            seq = self._follow(op_id, seq, on_event)
            if result.get("state") != "running":
                break
            if time.time() > deadline:
                raise TransitionTimeout(f"{op_id} still running after {timeout_s:.0f}s")
        return check_outcome(self._with_phase_durations(result))

    def _wait_op(self, controller: Any, op_id: str, deadline: float) -> dict[str, Any]:
        """The operation's state after a short wait. The controller may die while the scale runs:
        Ray restarts it, it takes the operation over from its durable state (rolled back before
        commit, recovered from commit on), and this follows it there, to its outcome."""
        while True:
            try:
                return _get(controller.wait_op.remote(op_id, 0.25), timeout=30)
            except (UnreachableError, TransitionTimeout):
                if time.time() > deadline:
                    raise UnreachableError(
                        f"the controller of {self.name!r} did not come back while {op_id} ran; "
                        f"`eepctl events --name {self.name} --op {op_id}` says how it ended"
                    ) from None
            time.sleep(0.5)  # Ray is restarting the controller: ask again

    def _follow(self, op_id: str, seq: int, on_event: EventSink) -> int:
        """Pass on the operation's rank events after ``seq``; the last seq seen."""
        if self.registry is None:
            return seq
        try:
            data = _get(self.registry.events.remote(op_id, seq), timeout=10)
        except EepError:
            return seq
        for ev in data["events"]:
            seq = max(seq, ev["seq"])
            on_event(ev)
        return seq

    def _with_phase_durations(self, result: dict[str, Any]) -> dict[str, Any]:
        """The finished operation with the ranks' phase timings, which the registry merges in."""
        if self.registry is None or "op_id" not in result:
            return result
        try:
            merged = _get(self.registry.events.remote(result["op_id"], 0), timeout=10)["operations"]
        except EepError:
            return result
        return dict(result, phase_durations=merged[-1]["phase_durations"]) if merged else result

    def repair(self, *, timeout_s: float) -> dict[str, Any]:
        controller = self._controller(
            f"recreate the deployment (`eepctl down --name {self.name}` then `eepctl up --name {self.name}`)"
        )
        return raise_if_error(_get(controller.repair.remote(), timeout=timeout_s))

    def set_autoscale(self, policy: dict[str, Any]) -> dict[str, Any]:
        controller = self._controller("no loop runs an autoscaler")
        return raise_if_error(_get(controller.set_autoscale.remote(policy), timeout=30))

    def autoscale_policy(self) -> dict[str, Any]:
        controller = self._controller("its autoscaling policy went with it")
        return raise_if_error(_get(controller.autoscale_show.remote(), timeout=30))

    def autoscale_decisions(self, since: float = 0.0) -> dict[str, Any]:
        controller = self._controller("its autoscaler's decisions went with it")
        return raise_if_error(_get(controller.autoscale_decisions.remote(since), timeout=30))

    def ingresses(self) -> list[Any]:
        """The deployment's ingress actors (requests enter there, whether a controller is up or not)."""
        import ray
        from engine_ext.ray.names import ingress_name

        found: list[Any] = []
        while ray.is_initialized():  # (not connected: nothing to find, and nothing to start here)
            try:
                found.append(ray.get_actor(ingress_name(self.name, len(found))))
            except ValueError:
                break
        if not found:
            raise UnreachableError(
                f"deployment {self.name!r} has no ingress: the deployment cannot serve requests "
                f"(`eepctl down --name {self.name}` then `eepctl up` again)"
            )
        return found

    def endpoints(self) -> list[str]:
        """Each ingress's HTTP URL, asked of the ingress actors themselves (when the registry that
        shows them is gone); an ingress Ray is restarting is waited for up to 30 s."""
        from engine_ext.ray.deployment import ready

        urls = []
        for ing in self.ingresses():
            try:
                urls.append(str(ready(ing, timeout_s=30)["url"]))
            except EepError:  # gone, restarting past the wait, or not listening (its pinned port taken)
                continue
        if not urls:
            raise UnreachableError(f"no ingress of {self.name!r} answers (`eepctl status --name {self.name}`)")
        return urls
