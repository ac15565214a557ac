"""The vLLM deployment's controller: a named, detached actor per vLLM deployment that runs its scales.

vLLM runs a DP transition itself; what it lacks is an owner of the operation. Here the scale is
admitted, posted to ``/scale_elastic_ep``, followed (vLLM's ``/is_scaling_elastic_ep`` and the
plugin's rank events in the registry) and recorded in the cluster, so an eepctl killed after asking
leaves a running operation that still ends, and its deadline is enforced here, not by the waiting
client. What vLLM reports at the end is reconciled into the record: a scaling flag still set (the
wedge of vLLM #53947) and each engine's fault-tolerance health where the server has it. Clients
reach it through ``engine_ext.drivers.vllm_scale``; the API key rides in each call, never in a record.
Between operations its loop (engine_ext.ray.vllm_loop, a collaborator it owns and serves as
``LoopHost``) reconciles what vLLM reports and runs the shared autoscaler in advisory mode.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray

from engine_ext.control.vllm_api import VllmApi, engine_health, error_for, fault_tolerance_health, message_of
from engine_ext.control.vllm_reconcile import FLAG_STUCK_S
from engine_ext.control.vllm_deployment import (
    abandoned,
    api_for,
    bounds_problem,
    current_size,
    wedged_message,
)
from engine_ext.elastic.transition_plan import new_op_id
from engine_ext.protocol import (
    EepError,
    OpState,
    PreconditionError,
    TransitionFailed,
    TransitionTimeout,
    UnreachableError,
    error_record,
)
from engine_ext.ray.names import registry_name, vllm_controller_name
from engine_ext.ray.vllm_loop import TICK_S, VllmLoop, read_flag

FLAG_SETTLE_S = 10.0  # how long vLLM may take to lower its scaling flag after it answered
DURABLE_OPS = 100  # operations and request ids kept in the GCS KV, as the reference controller keeps them
FLAG_BOUND_ENV = "EEPCTL_VLLM_FLAG_STUCK_S"
FLAG_SETTLE_ENV = "EEPCTL_VLLM_FLAG_SETTLE_S"  # FLAG_SETTLE_S of the creating process (tests shorten it)
ORPHAN_SETTLE_ENV = "EEPCTL_VLLM_ORPHAN_SETTLE_S"  # the loop's OrphanWatch.settle_s, likewise


class VllmController:
    """One per vLLM deployment; holds the operations it runs, the registry holds the history.
    Its loop (``VllmLoop``) reaches it through ``call``, ``record``, ``running_op`` and ``owns_op``."""

    def __init__(self, deployment: str, namespace: str, flag_bound_s: float = FLAG_STUCK_S,
                 tick_s: float = TICK_S, flag_settle_s: float = FLAG_SETTLE_S,
                 orphan_settle_s: float | None = None) -> None:
        self.deployment = deployment
        self.namespace = namespace
        self.started_at = time.time()
        self.flag_settle_s = flag_settle_s
        self._changed = threading.Condition()  # guards _ops, _by_request, _running
        self._ops: dict[str, dict[str, Any]] = {}
        self._by_request: dict[str, str] = {}
        self._running: str | None = None
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

    # ---- autoscaling: the loop's AutoscaleHost answers ------------------------------------------
    def set_autoscale(self, changes: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
        return self.loop.set_autoscale(changes, api_key)

    def autoscale_show(self) -> dict[str, Any]:
        return self.loop.autoscale_host.autoscale_show()

    def autoscale_decisions(self, since: float = 0.0, limit: int = 200) -> dict[str, Any]:
        return self.loop.autoscale_host.autoscale_decisions(since, limit)

    def stop(self) -> None:
        self.loop.stop()

    # ---- what clients call -------------------------------------------------------------------
    def scale(self, target: int, drain_timeout_s: float, timeout_s: float, request_id: str | None = None,
              api_key: str | None = None) -> dict[str, Any]:
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
                op = self._new_op(snap, api, target, timeout_s, request_id)
                if op["to_size"] == op["from_size"]:  # vLLM answers at once and does nothing
                    return self._noop(op, api, max(1, round(drain_timeout_s)), timeout_s, snap)
                seq = self._last_seq()
                self._running = op["op_id"]
                if request_id:
                    self._by_request[request_id] = op["op_id"]
            self.record(op)
            threading.Thread(target=self._run, args=(op, api, max(1, round(drain_timeout_s)), timeout_s, seq,
                                                      snap.get("info") or {}),
                             name=f"eep-vllm-scale-{op['op_id']}", daemon=True).start()
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
                return error_record(UnreachableError(f"no operation {op_id} in the controller of "
                                                     f"{self.deployment!r}"))
            return dict(self._ops[op_id])

    def _predecessors_op(self, op_id: str, deadline: float) -> dict[str, Any]:
        """An operation a controller before this one started, followed in the registry (where the
        loop ends it if it was running when that controller died) until it ends or ``deadline``."""
        while True:
            op = self._known_op(op_id)
            if op is None:
                return error_record(UnreachableError(f"no operation {op_id} in the controller of "
                                                     f"{self.deployment!r}"))
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
            return {"deployment": self.deployment, "started_at": self.started_at, "running": self._running,
                    "operations": len(self._ops), "ticks": self.loop.ticks, "findings": dict(self.loop.findings),
                    "flag_bound_s": self.loop.flag_watch.bound_s, "last_error": self.loop.last_error}

    # ---- admission ---------------------------------------------------------------------------
    def _same_request(self, request_id: str | None, target: int) -> dict[str, Any] | None:
        """A retry: the operation this request id already started (a different target is refused)."""
        if not request_id or request_id not in self._by_request:
            return None
        op = self._known_op(self._by_request[request_id])
        if op is None:  # its record is gone everywhere (past DURABLE_OPS): a new operation
            return None
        if op["to_size"] != target:
            raise PreconditionError(f"request id {request_id!r} already asked for DP {op['to_size']} "
                                    f"({op['op_id']}, {op['state']}); use a new id for another target")
        return dict(op)

    def _admit(self, snap: dict[str, Any], api: VllmApi, target: int) -> None:
        """Refuse what is visible before asking vLLM: another operation, vLLM already scaling or
        wedged, a target out of bounds. A running record nobody runs past its deadline is closed."""
        running = snap.get("operation")
        mine = self._ops.get(running["op_id"]) if running else None
        if mine is not None and mine["state"] != OpState.RUNNING.value:
            running = None  # ended here; the registry has not taken the final record yet
        if running and mine is None and abandoned(running):
            self.record(dict(running, state=OpState.FAILED.value, finished=time.time(), error_code=5,
                              error="abandoned: the client that started it stopped before vLLM answered"))
            running = None
        if running or self._running:
            op = self._ops.get(self._running or "") or running
            raise PreconditionError(f"{op['op_id']} is running on {self.deployment!r} (DP {op['from_size']} -> "
                                    f"{op['to_size']}); one scale at a time")
        if api.is_scaling():
            wedge = (snap.get("info") or {}).get("wedged")
            if wedge:
                raise PreconditionError(wedged_message(self.deployment, wedge))
            stuck = self.loop.findings.get("flag_stuck")
            if stuck:
                raise PreconditionError(f"vLLM deployment {self.deployment!r}: {stuck['reason']}; {stuck['repair']}")
            raise PreconditionError(f"vLLM reports a scale of {self.deployment!r} in progress; one scale at a time")
        problem = bounds_problem(snap, target)
        if problem:
            raise PreconditionError(problem)

    def _new_op(self, snap: dict[str, Any], api: VllmApi, target: int, timeout_s: float,
                request_id: str | None) -> dict[str, Any]:
        now = time.time()
        return {"op_id": new_op_id(), "deployment": self.deployment, "from_size": current_size(snap),
                "to_size": target, "state": OpState.RUNNING.value, "phase": "prepare", "started": now,
                "finished": None, "error": "", "error_code": 0, "phase_durations": {}, "serving_pause_s": 0.0,
                "captures_per_rank": {}, "workspace_before": _workspace(snap), "workspace_after": {},
                "rank_states": {}, "deadline": now + timeout_s,
                "plan": {"kind": "vllm", "api_url": api.base_url, "request_id": request_id or "",
                         "controller": vllm_controller_name(self.deployment)}}

    def _noop(self, op: dict[str, Any], api: VllmApi, drain: int, timeout_s: float,
              snap: dict[str, Any]) -> dict[str, Any]:
        """A scale to the current size: vLLM answers 200 and does nothing; nothing is recorded."""
        code, body = api.scale(op["to_size"], drain, timeout_s)
        if code != 200:
            raise error_for(code, body, op["to_size"], snap.get("info") or {})
        return dict(op, op_id="-", state=OpState.SUCCEEDED.value, finished=time.time(), message=message_of(body))

    # ---- the run -----------------------------------------------------------------------------
    def _run(self, op: dict[str, Any], api: VllmApi, drain: int, timeout_s: float, seq: int,
             info: dict[str, Any]) -> None:
        """Post the scale on a thread (vLLM answers when the transition has ended), follow vLLM's
        flag and the ranks' events until then or the deadline, then reconcile and record."""
        answer: dict[str, Any] = {}

        def post() -> None:
            try:
                answer["reply"] = api.scale(op["to_size"], drain, timeout_s)
            except EepError as e:
                answer["error"] = e

        poster = threading.Thread(target=post, name="eep-vllm-post", daemon=True)
        poster.start()
        events: list[dict[str, Any]] = []
        while poster.is_alive() and time.time() < op["deadline"]:
            poster.join(0.5)
            seq = self._follow(seq, events)
            if poster.is_alive() and op["phase"] != "commit" and read_flag(api):
                self.record(dict(op, phase="commit"))  # vLLM raises its flag once prepare is done
                op["phase"] = "commit"
        error: EepError | None
        if poster.is_alive():
            error = TransitionTimeout(f"{op['op_id']}: vLLM did not finish the scale to DP {op['to_size']} within "
                                      f"{timeout_s:.0f}s (the controller's deadline)")
        elif "error" in answer:
            error = answer["error"]
        else:
            code, body = answer["reply"]
            error = None if code == 200 else error_for(code, body, op["to_size"], info)
        error = self._reconcile_flag(op, api, error, answered=not poster.is_alive())
        time.sleep(0.3)  # the ranks' last reports
        self._follow(seq, events)
        self._finish(op, api, events, error)

    def _reconcile_flag(self, op: dict[str, Any], api: VllmApi, error: EepError | None,
                        answered: bool) -> EepError | None:
        """vLLM's scaling flag at the end. Still set once vLLM has answered and had time to lower
        it: the deployment is wedged (503 to everything), whatever vLLM answered. Still set at the
        deadline with no answer: said in the timeout's reason."""
        settle = time.time() + (self.flag_settle_s if answered else 0.0)
        while read_flag(api) is True:
            if time.time() >= settle:
                why = ("vLLM's scaling flag is still set at the controller's deadline: it answers 503 to every "
                       "request until its scale ends (or, wedged, until its API server restarts)" if not answered
                       else f"vLLM's scaling flag is still set {self.flag_settle_s:.0f}s after it answered, so it answers "
                       "503 to every request (wedged; restart the vLLM API server)")
                if error is None:
                    return TransitionFailed(f"{op['op_id']}: {why}")
                return type(error)(f"{error.message}; {why}")
            time.sleep(0.5)
        return error

    def _follow(self, seq: int, events: list[dict[str, Any]]) -> int:
        """New rank events since ``seq`` (vLLM's ranks name their own operation ids)."""
        try:
            data = self.call("events", None, seq)
        except EepError:
            return seq
        for ev in data["events"]:
            seq = max(seq, ev["seq"])
            if ev.get("rank", -1) >= 0:
                events.append(ev)
        return seq

    def _last_seq(self) -> int:
        try:
            return max((e["seq"] for e in self.call("events", None, 0)["events"]), default=0)
        except EepError:
            return 0

    def _finish(self, op: dict[str, Any], api: VllmApi, events: list[dict[str, Any]],
                error: EepError | None) -> None:
        phases: dict[str, float] = {}
        captures: dict[str, int] = {}
        for ev in events:
            phases[ev["phase"]] = max(phases.get(ev["phase"], 0.0), round(ev["end"] - ev["start"], 6))
            if ev["phase"] == "capture" and ev.get("outcome") == "ok":
                captures[str(ev["rank"])] = captures.get(str(ev["rank"]), 0) + 1
        try:
            snap = self.call("snapshot")
            op["workspace_after"] = _workspace(snap)
            op["rank_states"] = {str(r["rank"]): r["state"] for r in snap.get("ranks", [])}
            if (snap.get("info") or {}).get("fault_tolerance"):
                op["plan"] = dict(op["plan"], engines_after=engine_health(fault_tolerance_health(api)))
        except EepError:
            pass
        op.update(phase_durations=phases, captures_per_rank=captures, rank_ops=sorted({ev["op_id"] for ev in events}),
                  finished=time.time(), state=OpState.SUCCEEDED.value if error is None else
                  OpState.TIMED_OUT.value if isinstance(error, TransitionTimeout) else OpState.FAILED.value)
        if error is not None:
            op.update(error=error.message, error_code=int(error.exit_code))
        self.record(op)


def _workspace(snap: dict[str, Any]) -> dict[str, int]:
    return {str(r["rank"]): int(r.get("workspace_bytes", 0) or 0) for r in snap.get("ranks", [])}


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
    return ray.remote(VllmController).options(
        name=vllm_controller_name(deployment), namespace=namespace, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=32, scheduling_strategy=on_this_node(), max_restarts=-1, max_task_retries=0,
    ).remote(deployment, namespace, bound, TICK_S, settle, orphan)


def existing_controller(deployment: str) -> Any:
    """The deployment's vLLM controller if one runs (reads do not create one), else None."""
    try:
        return ray.get_actor(vllm_controller_name(deployment), namespace=ray.get_runtime_context().namespace)
    except ValueError:
        return None
