"""The vLLM deployment's controller: a named, detached actor per vLLM deployment that runs its scales.

vLLM runs a DP transition itself; what it lacks is an owner of the operation. Here the scale is
admitted, posted to ``/scale_elastic_ep``, followed (vLLM's ``/is_scaling_elastic_ep`` and the
plugin's rank events in the registry: engine_ext.ray.vllm_run) and recorded in the cluster, so an
eepctl killed after asking leaves a running operation that still ends, and its deadline is
enforced here, not by the waiting client. What vLLM reports at the end is reconciled into the
record: a scaling flag still set (the wedge of vLLM #53947) and each engine's fault-tolerance
health where the server has it. Clients reach it through ``engine_ext.drivers.vllm_scale``; the
API key rides in each call, never in a record.
Between operations its loop (engine_ext.ray.vllm_loop, a collaborator it owns and serves as
``LoopHost``) reconciles what vLLM reports and runs the shared autoscaler; a decision that acts
becomes an operation here, carried out by the plugin inside the API server (``act_on``, no key).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
from engine_ext.control.vllm_api import VllmApi, error_for, message_of
from engine_ext.control.vllm_deployment import abandoned, admission_problem, api_for, last_seq, new_operation
from engine_ext.control.vllm_reconcile import FLAG_STUCK_S, published_flag
from engine_ext.protocol import EepError, OpState, PreconditionError, UnreachableError, error_record
from engine_ext.ray.names import registry_name, vllm_controller_name
from engine_ext.ray.vllm_loop import TICK_S, VllmLoop
from engine_ext.ray.vllm_orders import ScaleOrders
from engine_ext.ray.vllm_run import run_scale

FLAG_SETTLE_S = 10.0  # how long vLLM may take to lower its scaling flag after it answered
DURABLE_OPS = 100  # operations and request ids kept in the GCS KV, as the reference controller keeps them
FLAG_BOUND_ENV = "EEPCTL_VLLM_FLAG_STUCK_S"
FLAG_SETTLE_ENV = "EEPCTL_VLLM_FLAG_SETTLE_S"  # FLAG_SETTLE_S of the creating process (tests shorten it)
ORPHAN_SETTLE_ENV = "EEPCTL_VLLM_ORPHAN_SETTLE_S"  # the loop's OrphanWatch.settle_s, likewise
AUTOSCALE_DRAIN_S, AUTOSCALE_TIMEOUT_S = 30, 600.0  # an autoscaler's scale: `eepctl scale`'s drain, a long deadline


class VllmController:
    """One per vLLM deployment; holds the operations it runs, the registry holds the history.
    Its loop (``VllmLoop``) reaches it through ``call``, ``record``, ``running_op``, ``owns_op`` and
    ``finished_ops``."""

    def __init__(
        self,
        deployment: str,
        namespace: str,
        flag_bound_s: float = FLAG_STUCK_S,
        tick_s: float = TICK_S,
        flag_settle_s: float = FLAG_SETTLE_S,
        orphan_settle_s: float | None = None,
    ) -> None:
        self.deployment = deployment
        self.namespace = namespace
        self.started_at = time.time()
        self.flag_settle_s = flag_settle_s
        self._changed = threading.Condition()  # guards _ops, _by_request, _running
        self._ops: dict[str, dict[str, Any]] = {}
        self._by_request: dict[str, str] = {}
        self._running: str | None = None
        self.orders = ScaleOrders()  # the autoscaler's scales, carried out by the plugin in vLLM's API server
        self.loop = VllmLoop(self, namespace, flag_bound_s, tick_s)
        if orphan_settle_s is not None:
            self.loop.orphans.settle_s = orphan_settle_s
        # A restarted controller's memory of its predecessors (the GCS KV): ended or orphaned
        # operations (never "ours": the loop's OrphanWatch ends a running one) and request ids.
        self._restored: dict[str, dict[str, Any]] = {op["op_id"]: op for op in self.loop.saved.get("operations", [])}
        self._by_request.update(self.loop.saved.get("request_ids", {}))
        self.loop.start()

    def _registry(self) -> Any:
        """Looked up by name at each use: the registry may have been recreated."""
        try:
            return ray.get_actor(registry_name(self.deployment), namespace=self.namespace)
        except ValueError:
            raise UnreachableError(f"the registry of vLLM deployment {self.deployment!r} is gone") from None

    # ---- what its loop calls (LoopHost) ------------------------------------------------------
    def call(self, method: str, *args: Any) -> Any:
        """A registry method, answered within 10 s."""
        from engine_ext.ray.deployment import call

        return call(getattr(self._registry(), method).remote(*args), timeout=10)

    def record(self, op: dict[str, Any]) -> None:
        """Keep ``op`` as this controller's, in the GCS KV with the request ids (the last
        DURABLE_OPS of each), and send it to the registry (best effort)."""
        with self._changed:
            self._ops[op["op_id"]] = dict(op)
            if op["state"] != OpState.RUNNING.value and self._running == op["op_id"]:
                self._running = None
            self._changed.notify_all()
            kept = list({**self._restored, **self._ops}.values())[-DURABLE_OPS:]
            ids = dict(list(self._by_request.items())[-DURABLE_OPS:])
        try:
            self.loop.save_parts({"operations": kept, "request_ids": ids})
        except Exception:  # noqa: BLE001 - no GCS KV now: the registry still gets the record
            pass
        try:
            self.call("record_operation", dict(op))
        except EepError:
            pass  # the registry is being recreated; the final record is written again at the end

    def running_op(self) -> str | None:
        with self._changed:
            return self._running

    def owns_op(self, op_id: str) -> bool:
        with self._changed:
            return op_id in self._ops

    def finished_ops(self) -> list[dict[str, Any]]:
        """The last scales this controller ran to their end. Not one the loop ended for a dead
        controller: its record says why in ``error``, and its wall time is not the scale's."""
        with self._changed:
            ended = [op for op in self._ops.values() if op["state"] != OpState.RUNNING.value and not op.get("error")]
        return [dict(op) for op in ended[-5:]]

    # ---- autoscaling: the loop's AutoscaleHost answers ------------------------------------------
    def set_autoscale(self, changes: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
        return self.loop.set_autoscale(changes, api_key)

    def autoscale_show(self) -> dict[str, Any]:
        return self.loop.autoscale_host.autoscale_show()

    def autoscale_decisions(self, since: float = 0.0, limit: int = 200) -> dict[str, Any]:
        return self.loop.autoscale_host.autoscale_decisions(since, limit)

    def stop(self) -> None:
        self.loop.stop()

    # ---- the autoscaler's scales, carried out inside vLLM's API server (engine_ext.ray.vllm_orders) --
    def take_order(self, wait_s: float) -> dict[str, Any] | None:
        """The plugin's long poll for the next scale to carry out through its engine client."""
        return self.orders.take(wait_s)

    def order_done(self, op_id: str, reply: dict[str, Any]) -> bool:
        return self.orders.answer(op_id, reply)

    def act_on(self, decision: Any, scaling: bool) -> str | None:
        """Start the scale an acting decision asks for, admitted as `eepctl scale`'s are (one at a
        time; ``scaling``: vLLM's published flag) and carried out by the plugin in the API server:
        None once it runs, else why not. Its outcome goes into the decision at the end (``_finish``)."""
        target = int(decision.recommendation)
        try:
            with self._changed:
                snap = self.call("snapshot")
                api = api_for(snap, None)  # its URL for the record; never called with a key here
                self._admit(snap, api, target, scaling=scaling)
                op = new_operation(
                    snap, api.base_url, target, AUTOSCALE_TIMEOUT_S, None, vllm_controller_name(self.deployment)
                )
                op["plan"].update(
                    by="autoscaler",
                    decision=decision.id,
                    retiring=list(range(target, op["from_size"])),
                    carried_out_by="the engine_ext plugin in vLLM's API server (no API key)",
                )
                seq, self._running = last_seq(self.call), op["op_id"]
        except EepError as e:
            return e.message
        self.record(op)
        order = {
            "op_id": op["op_id"],
            "to_size": target,
            "drain_timeout_s": AUTOSCALE_DRAIN_S,
            "deadline": op["deadline"],
        }
        threading.Thread(
            target=self._run,
            args=(
                op,
                api,
                AUTOSCALE_DRAIN_S,
                AUTOSCALE_TIMEOUT_S,
                seq,
                snap.get("info") or {},
                lambda: self.orders.carried_out(order),
                self._published_flag,
            ),
            name=f"eep-vllm-autoscale-{op['op_id']}",
            daemon=True,
        ).start()
        return None

    def _published_flag(self) -> bool | None:
        """vLLM's flag as the plugin publishes it: the autoscaler's scales read no endpoint (no key)."""
        try:
            return published_flag(self.call("snapshot"))
        except EepError:
            return None

    # ---- what clients call -------------------------------------------------------------------
    def scale(
        self,
        target: int,
        drain_timeout_s: float,
        timeout_s: float,
        request_id: str | None = None,
        api_key: str | None = None,
    ) -> dict[str, Any]:
        """Admit a scale to ``target`` and start it; the accepted operation (or, for a retry of
        ``request_id``, that request's operation), or an error record."""
        self.loop.remember_key(api_key)
        try:
            with self._changed:
                same = self._same_request(request_id, target)
                if same is not None:
                    return same
                snap = self.call("snapshot")
                api = api_for(snap, api_key, timeout_s=10.0)
                self._admit(snap, api, target)
                op = new_operation(
                    snap, api.base_url, target, timeout_s, request_id, vllm_controller_name(self.deployment)
                )
                if op["to_size"] == op["from_size"]:  # vLLM answers at once and does nothing
                    return self._noop(op, api, max(1, round(drain_timeout_s)), timeout_s, snap)
                seq = last_seq(self.call)
                self._running = op["op_id"]
                if request_id:
                    self._by_request[request_id] = op["op_id"]
            self.record(op)
            threading.Thread(
                target=self._run,
                args=(op, api, max(1, round(drain_timeout_s)), timeout_s, seq, snap.get("info") or {}),
                name=f"eep-vllm-scale-{op['op_id']}",
                daemon=True,
            ).start()
            return dict(op)
        except EepError as e:
            return error_record(e)

    def wait_op(self, op_id: str, timeout_s: float) -> dict[str, Any]:
        """The operation once it has ended, or as it stands after ``timeout_s``."""
        deadline = time.time() + timeout_s
        if not self.owns_op(op_id):  # a predecessor's (a retried request id after a restart)
            return self._predecessors_op(op_id, deadline)
        with self._changed:
            while op_id in self._ops and self._ops[op_id]["state"] == OpState.RUNNING.value:
                left = deadline - time.time()
                if left <= 0:
                    break
                self._changed.wait(left)
            if op_id not in self._ops:
                return error_record(UnreachableError(f"no operation {op_id} in the controller of {self.deployment!r}"))
            return dict(self._ops[op_id])

    def _predecessors_op(self, op_id: str, deadline: float) -> dict[str, Any]:
        """An operation a controller before this one started, followed in the registry (where the
        loop ends it if it was running when that controller died) until it ends or ``deadline``."""
        while True:
            op = self._known_op(op_id)
            if op is None:
                return error_record(UnreachableError(f"no operation {op_id} in the controller of {self.deployment!r}"))
            if op["state"] != OpState.RUNNING.value or time.time() >= deadline:
                return op
            time.sleep(min(0.5, max(0.0, deadline - time.time())))

    def _known_op(self, op_id: str) -> dict[str, Any] | None:
        """This controller's record of ``op_id``, else the registry's (current: the loop ends an
        orphan there), else the one a predecessor left in the GCS KV."""
        with self._changed:
            if op_id in self._ops:
                return dict(self._ops[op_id])
        try:
            found = self.call("events", op_id, 1 << 62)["operations"]  # the record, no events
        except EepError:
            found = []
        if found:
            return dict(found[-1])
        return dict(self._restored[op_id]) if op_id in self._restored else None

    def pid(self) -> int:
        """This actor's process id (a test SIGKILLs it by pid, as an operator's fault would)."""
        return os.getpid()

    def info(self) -> dict[str, Any]:
        with self._changed:
            return {
                "deployment": self.deployment,
                "started_at": self.started_at,
                "running": self._running,
                "operations": len(self._ops),
                "ticks": self.loop.ticks,
                "findings": dict(self.loop.findings),
                "flag_bound_s": self.loop.flag_watch.bound_s,
                "last_error": self.loop.last_error,
            }

    # ---- admission ---------------------------------------------------------------------------
    def _same_request(self, request_id: str | None, target: int) -> dict[str, Any] | None:
        """A retry: the operation this request id already started (a different target is refused)."""
        if not request_id or request_id not in self._by_request:
            return None
        op = self._known_op(self._by_request[request_id])
        if op is None:  # its record is gone everywhere (past DURABLE_OPS): a new operation
            return None
        if op["to_size"] != target:
            raise PreconditionError(
                f"request id {request_id!r} already asked for DP {op['to_size']} "
                f"({op['op_id']}, {op['state']}); use a new id for another target"
            )
        return dict(op)

    def _admit(self, snap: dict[str, Any], api: VllmApi, target: int, scaling: bool | None = None) -> None:
        """Refuse what is visible before asking vLLM: another operation, vLLM already scaling
        (``scaling``, else its endpoint) or wedged, a target out of bounds. A running record nobody
        runs past its deadline is closed."""
        running = snap.get("operation")
        mine = self._ops.get(running["op_id"]) if running else None
        if mine is not None and mine["state"] != OpState.RUNNING.value:
            running = None  # ended here; the registry has not taken the final record yet
        if running and mine is None and abandoned(running):
            self.record(
                dict(
                    running,
                    state=OpState.FAILED.value,
                    finished=time.time(),
                    error_code=5,
                    error="abandoned: the client that started it stopped before vLLM answered",
                )
            )
            running = None
        busy = (self._ops.get(self._running or "") or running) if running or self._running else None
        flag = False if busy else (api.is_scaling() if scaling is None else scaling)
        problem = admission_problem(self.deployment, snap, target, busy, flag, self.loop.findings.get("flag_stuck"))
        if problem:
            raise PreconditionError(problem)

    def _noop(
        self, op: dict[str, Any], api: VllmApi, drain: int, timeout_s: float, snap: dict[str, Any]
    ) -> dict[str, Any]:
        """A scale to the current size: vLLM answers 200 and does nothing; nothing is recorded."""
        code, body = api.scale(op["to_size"], drain, timeout_s)
        if code != 200:
            raise error_for(code, body, op["to_size"], snap.get("info") or {})
        return dict(op, op_id="-", state=OpState.SUCCEEDED.value, finished=time.time(), message=message_of(body))

    # ---- the run -----------------------------------------------------------------------------
    def _run(self, op: dict[str, Any], *args: Any) -> None:
        """Follow ``op`` to its end and record it (engine_ext.ray.vllm_run.run_scale, with its
        arguments); an autoscaler's scale also gives its decision the outcome."""
        run_scale(self, op, *args)
        if op["plan"].get("by") == "autoscaler":  # the decision's outcome: "scaled: ..." or "failed: ..."
            self.loop.record_outcome(op)


def controller_for(deployment: str, namespace: str | None = None) -> Any:
    """The deployment's vLLM controller, created (named, detached, next to the caller like the
    reference controller) by the first client that needs it (the plugin's API server, else eepctl);
    the namespace is the caller's. Ray restarts it (its loop and autoscaling policy come back from
    the GCS KV); the flag bound is EEPCTL_VLLM_FLAG_STUCK_S of the creating process (default 60 s), the
    settle times EEPCTL_VLLM_FLAG_SETTLE_S (10 s) and EEPCTL_VLLM_ORPHAN_SETTLE_S (6 s)."""
    from engine_ext.ray.placement import on_this_node

    namespace = namespace or ray.get_runtime_context().namespace
    bound = float(os.environ.get(FLAG_BOUND_ENV) or FLAG_STUCK_S)
    settle = float(os.environ.get(FLAG_SETTLE_ENV) or FLAG_SETTLE_S)
    orphan = float(os.environ[ORPHAN_SETTLE_ENV]) if os.environ.get(ORPHAN_SETTLE_ENV) else None
    return (
        ray.remote(VllmController)
        .options(
            name=vllm_controller_name(deployment),
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=32,
            scheduling_strategy=on_this_node(),
            max_restarts=-1,
            max_task_retries=0,
        )
        .remote(deployment, namespace, bound, TICK_S, settle, orphan)
    )


def existing_controller(deployment: str) -> Any:
    """The deployment's vLLM controller if one runs (reads do not create one), else None."""
    try:
        return ray.get_actor(vllm_controller_name(deployment), namespace=ray.get_runtime_context().namespace)
    except ValueError:
        return None
