"""The controller's scale requests: ``eepctl scale`` and its plan, admitted and then run in a task
that outlives the call (``--no-wait``), a retry with the same request id answered with the same
operation, and a wait for an operation's outcome.

The controller owns one ``ScaleRequests`` (``scales``) and its actor methods ``plan``, ``scale``
and ``wait_op`` hand the call to it. ``ready`` is the controller's: set once it started, or once a
restarted controller took the deployment over; ``persist`` writes the controller's durable state
(which keeps ``requests``, the request ids)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_ext.control.request_ids import RequestIds
from engine_ext.faults import controller_holds
from engine_ext.protocol import EepError, PreconditionError, UnreachableError, error_record

if TYPE_CHECKING:
    from engine_ext.config import EngineConfig
    from engine_ext.control.orchestrator import Orchestrator
    from engine_ext.ray.spawner import RaySpawner


class ScaleRequests:
    def __init__(
        self,
        cfg: EngineConfig,
        orch: Orchestrator,
        spawner: RaySpawner,
        ready: asyncio.Event,
        persist: Callable[[], None],
    ) -> None:
        self.cfg, self.orch, self.spawner = cfg, orch, spawner
        self.ready = ready
        self.persist = persist
        self.requests = RequestIds()  # `scale --request-id`
        self.tasks: dict[str, asyncio.Task] = {}

    async def plan(self, target: int, retire: list[int] | None = None) -> dict[str, Any]:
        try:
            plan = (await self.orch.plan(target, retire=retire)).to_dict()
            plan["running_op"] = self.orch.busy()
            reason = self.orch.spawner.check_capacity(
                max(0, target - self.orch.size), [int(j["rank"]) for j in plan["joining"]]
            )
            plan["capacity_problem"] = reason
            plan["placement"] = {"policy": self.spawner.spec.policy, "nodes": self.spawner.predicted()}
            return plan
        except EepError as e:
            return error_record(e)

    async def scale(
        self,
        target: int,
        drain_timeout_s: float,
        timeout_s: float,
        wait: bool,
        request_id: str | None = None,
        retire: list[int] | None = None,
    ) -> dict[str, Any]:
        """Admit a scale (a recovery under way finishes first; a degraded deployment heals first;
        every rank must answer), then run it in a task that outlives this call (``--no-wait``).
        A scale-down removes ``retire``, else the ranks with the least work. The controller
        enforces ``timeout_s`` (before commit: roll back; from commit on: recover).
        ``request_id``: a retry with the same id gets the same operation, never a second one."""
        await self.ready.wait()
        try:
            await self.requests.first_settled(request_id, target)  # a retry during its admission: its answer
            if request_id and request_id in self.requests.ops:
                return await self._same_request(request_id, target, wait)
            hold_s = self.cfg.fault_delay_s if controller_holds(self.cfg.faults, "admit") else 0.0
            admitted = await self.requests.admit(
                request_id,
                target,
                lambda: self.orch.admit(target, settle=True, probe_ranks=True, retire=retire),
                hold_s,
            )
        except EepError as e:
            return error_record(e)
        op_id = admitted.op.op_id
        self.tasks[op_id] = asyncio.ensure_future(
            self.orch.run(admitted, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s)
        )
        self.requests.end(request_id, op_id=op_id)
        self.persist()
        if not wait:
            return {"op_id": op_id, "state": "running", "accepted": True}
        return await self.tasks[op_id]

    async def _same_request(self, request_id: str, target: int, wait: bool) -> dict[str, Any]:
        op_id = self.requests.ops[request_id]
        known = next((op for op in reversed(self.orch.history) if op["op_id"] == op_id), None)
        if known is not None and known.get("to_size") != target:
            return error_record(
                PreconditionError(
                    f"request id {request_id!r} was used for {op_id} "
                    f"(DP {known.get('from_size')}->{known.get('to_size')}), not DP {target}"
                )
            )
        if not wait or op_id not in self.tasks:
            return {
                **(known or {"op_id": op_id}),
                "op_id": op_id,
                "accepted": True,
                "repeated": True,
                **({} if known is None or known.get("finished") else {"state": "running"}),
            }
        return await self.wait_op(op_id, 1e9)

    async def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        try:  # a restarted controller answers once it took the operation over (its outcome is then known)
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            return {"op_id": op_id, "state": "running"}
        task = self.tasks.get(op_id)
        if task is None:
            for op in self.orch.history:
                if op["op_id"] == op_id:
                    return op
            return error_record(UnreachableError(f"no operation {op_id}"))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except asyncio.TimeoutError:
            op = self.orch.running_op()  # its current phase and sizes, for eepctl's live display
            where = (
                {"phase": op.phase, "from_size": op.from_size, "to_size": op.to_size}
                if op is not None and op.op_id == op_id
                else {}
            )
            return {"op_id": op_id, "state": "running", **where}
