"""The vLLM controller's loop: between operations, what vLLM reports is reconciled and the
autoscaler's decision core runs on vLLM's own figures.

Every TICK_S (an Event wait: no tick of its own making in between) the loop reads the registry
once, watches vLLM's scaling flag as the plugin publishes it (the endpoint only when that is
stale), ends an operation whose controller died mid-scale once vLLM has stopped scaling, forgets the
ranks a scale-down removed, reads vLLM's
fault-tolerance status at most every FT_EVERY_S on a server that has it, and runs one decision of
the shared core (engine_ext.ray.autoscale_host), which learns what a scale costs from the
controller's finished scales; a decision that acts (``--mode on``) is handed
to the controller (``LoopHost.act_on``), which runs it as an operation carried out by the plugin in
vLLM's API server, under the same single flight as ``eepctl scale``. What status shows goes into the
registry's info only when it differs from what is there; the policy and the decisions persist in
the GCS KV under the key `eepctl down` deletes, with the controller's operations and request ids
(``save_parts``). Owned by
``engine_ext.ray.vllm_controller.VllmController``, which it reaches only through ``LoopHost``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from engine_ext.control.vllm_api import VllmApi, fault_tolerance_health
from engine_ext.control.vllm_deployment import api_for, current_size
from engine_ext.control.vllm_reconcile import (
    FLAG_STUCK_S,
    INFO_FRESH_S,
    FlagWatch,
    OrphanWatch,
    current_world,
    engines_finding,
    left_ranks,
    prepared_dp,
    published_flag,
    scale_running,
    server_down_finding,
)
from engine_ext.protocol import EepError, PreconditionError, error_record
from engine_ext.ray.autoscale_host import AutoscaleHost
from engine_ext.ray.durable import DurableState

TICK_S = 2.0  # the loop's period: the plugin refreshes the API server's info every 2 s, rank records every 1 s
FT_EVERY_S = 10.0  # vLLM's fault-tolerance status is read at most this often (an HTTP call to the server)
MODE_ON_NEEDS = (
    "--mode on needs the engine_ext plugin in vLLM's API server to carry out the scales (it holds "
    "the engine client: no API key is used); this server's plugin reports scale_orders: {why}; "
    "use --mode advisory and act with `eepctl scale`"
)


class LoopHost(Protocol):
    """What the loop needs of the controller that owns it."""

    deployment: str

    def call(self, method: str, *args: Any) -> Any:
        """A method of the deployment's registry, answered (EepError when the registry is gone)."""
        ...

    def record(self, op: dict[str, Any]) -> None:
        """Record ``op`` (an orphaned scale the loop ended) as the controller records its own."""
        ...

    def running_op(self) -> str | None:
        """The id of the scale the controller runs now, if any."""
        ...

    def owns_op(self, op_id: str) -> bool:
        """Whether the controller started (or ended) operation ``op_id`` itself."""
        ...

    def act_on(self, decision: Any, scaling: bool) -> str | None:
        """Start the scale an acting decision asks for (one scale at a time; ``scaling``: vLLM's
        flag): None once it runs, else why it was not started."""
        ...

    def finished_ops(self) -> list[dict[str, Any]]:
        """The last scales the controller ran to their end (what they cost teaches the autoscaler)."""
        ...


class VllmLoop:
    """The loop's state and its autoscaler (``set_autoscale`` checks a policy against vLLM's bounds)."""

    def __init__(
        self, host: LoopHost, namespace: str, flag_bound_s: float = FLAG_STUCK_S, tick_s: float = TICK_S
    ) -> None:
        self.host = host
        self.deployment = host.deployment
        self.tick_s = tick_s
        self.flag_watch = FlagWatch(bound_s=flag_bound_s)
        self.orphans = OrphanWatch()
        self.findings: dict[str, Any] = {}
        self.last_error: dict[str, Any] | None = None
        self.ticks = 0
        self._key: str | None = None  # the last API key a client passed: memory only, for the loop's reads
        self._ft: tuple[float, dict[str, Any] | None] = (0.0, None)  # (read at, finding)
        self._ends: tuple[float, dict[int, dict[str, Any]]] = (0.0, {})  # (read at, pid -> how its actor ended)
        self.durable = DurableState(namespace, self.deployment)
        try:
            saved = self.durable.load() or {}
        except Exception:  # noqa: BLE001 - no GCS KV reachable: start without a policy
            saved = {}
        self.saved: dict[str, Any] = dict(saved)  # what a restarted controller restores (operations, request ids)
        self._saving = threading.Lock()  # the loop's thread and the controller's scale threads save parts
        self.autoscale_host = AutoscaleHost(
            self.deployment, max_dp=1 << 16, persist=self._persist, saved=saved.get("autoscale")
        )
        self._stop = threading.Event()
        self._ticking = threading.Lock()  # the loop's tick and a tick asked by set_autoscale
        self._thread: threading.Thread | None = None  # not started: its owner ticks it (a test)

    def start(self) -> None:
        """Tick every ``tick_s`` on a thread of its own until ``stop``."""
        self._thread = threading.Thread(target=self._loop, name="eep-vllm-reconcile", daemon=True)
        self._thread.start()

    def _persist(self, state: dict[str, Any]) -> None:
        """The autoscaler's durable state (policy, last decisions), written only when it changed."""
        self.save_parts({"autoscale": state})

    def save_parts(self, parts: dict[str, Any]) -> None:
        """Parts of the durable state (``autoscale``, the controller's ``operations`` and
        ``request_ids``) replaced; the whole is written when it changed (DurableState)."""
        with self._saving:
            self.saved.update(parts)
            self.durable.save(dict(self.saved, kind="vllm"))

    def remember_key(self, api_key: str | None) -> None:
        if api_key:
            self._key = api_key

    def stop(self) -> None:
        self._stop.set()

    # ---- autoscale (the reference controller's decision core) -----------------------------------
    def set_autoscale(self, changes: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
        """The policy over the one kept: ``--mode on`` only where the plugin in the API server takes
        scale orders (MODE_ON_NEEDS), bounds checked against what vLLM allows (its max DP, the
        fewest ranks that hold every expert)."""
        self.remember_key(api_key)
        try:
            autoscale = self.autoscale_host
            mode = str(changes.get("mode", autoscale.policy.mode if autoscale.policy else "advisory"))
            info = self.host.call("snapshot").get("info") or {}
            orders = str((info.get("api_patches") or {}).get("scale_orders") or "not reported")
            if mode == "on" and orders != "active":
                raise PreconditionError(MODE_ON_NEEDS.format(why=orders))
            autoscale.max_dp = int(info.get("max_dp") or info.get("dp") or autoscale.max_dp)
            hi = changes.get("max_dp", autoscale.policy.max_dp if autoscale.policy else 8)
            if isinstance(hi, int) and hi > autoscale.max_dp:
                raise PreconditionError(
                    f"--max-dp {hi} is over {self.deployment!r}'s max DP {autoscale.max_dp} "
                    "(vLLM's --elastic-ep-max-dp-size)"
                )
            lo = changes.get("min_dp", autoscale.policy.min_dp if autoscale.policy else 1)
            if info.get("min_dp") and isinstance(lo, int) and lo < int(info["min_dp"]):
                raise PreconditionError(
                    f"--min-dp {lo} is under DP {info['min_dp']}, the fewest ranks of "
                    f"{self.deployment!r} that hold its {info.get('num_experts')} experts"
                )
        except EepError as e:
            return error_record(e)
        res = autoscale.set_autoscale(changes)
        self._wake()
        return res

    # ---- the loop ----------------------------------------------------------------------------
    def _wake(self) -> None:
        """Publish the new policy at once instead of at the next tick (a loop not started is
        ticked by its owner)."""
        if self._thread is None:
            return
        threading.Thread(target=self._tick_safely, name="eep-vllm-reconcile-now", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._tick_safely()

    def _tick_safely(self) -> None:
        """One tick; an exception is recorded (status shows it with its time) and the loop goes on."""
        try:
            with self._ticking:
                self.tick()
        except Exception as e:  # noqa: BLE001 - the loop never dies of an action
            self.last_error = {"at": time.time(), "action": "vllm reconcile", "error": f"{type(e).__name__}: {e}"[:300]}
            try:  # shown by status; the registry itself may be what failed
                self.host.call("set_info", {"control": {"vllm": self.findings, "last_error": self.last_error}})
            except Exception:  # noqa: BLE001
                pass

    def tick(self, now: float | None = None) -> dict[str, Any]:
        """Observe (one registry read; vLLM's flag as the plugin published it, else the endpoint),
        find, decide, and publish what changed. Returns the findings."""
        now = time.time() if now is None else now
        snap = self.host.call("snapshot")
        info = snap.get("info") or {}
        flag = published_flag(snap, now)
        if flag is None and info.get("api_url"):
            flag = read_flag(api_for(snap, self._key, timeout_s=3.0))
        op = snap.get("operation")
        running = self.host.running_op()
        ours = bool(op) and self.host.owns_op(op["op_id"])
        scaling = scale_running(snap, now)  # a prepare in flight is vLLM scaling too, with its flag down
        ended = self.orphans.observe(now, op, ours, flag if scaling is None else scaling, current_size(snap))
        if ended is not None:  # a scale whose controller died: ended with the size vLLM reports
            self.host.record(ended)
        findings: dict[str, Any] = {}
        stuck = self.flag_watch.observe(now, flag, running)
        if stuck:
            findings["flag_stuck"] = stuck
        engines = self._engines(snap, now, flag)
        if engines:
            findings["engines"] = engines
        for rank in left_ranks(snap, now):  # a rank a scale-down removed: gone, not stale
            self.host.call("forget_rank", rank)
        down = server_down_finding(snap, now, self._rank_ends(snap, now), flag)
        if down:
            findings["server_down"] = down
        self.findings = findings
        self.ticks += 1
        shown = self._autoscale(snap, now, flag, running)
        self.last_error = None  # this tick got this far: what status shows is current
        self._publish(info, findings, shown)
        return findings

    def _engines(self, snap: dict[str, Any], now: float, flag: bool | None) -> dict[str, Any] | None:
        """vLLM's fault-tolerance status (a server with --enable-fault-tolerance), at most every
        FT_EVERY_S; not while the flag is up (vLLM answers 503 to it then)."""
        if not (snap.get("info") or {}).get("fault_tolerance") or flag:
            return None
        if now - self._ft[0] >= FT_EVERY_S:
            self._ft = (now, engines_finding(fault_tolerance_health(api_for(snap, self._key, timeout_s=5.0))))
        return self._ft[1]

    def _rank_ends(self, snap: dict[str, Any], now: float) -> dict[int, dict[str, Any]]:
        """Ray's record of the ranks' engine-core actors that ended, read only while the API
        server's info is stale (at most every FT_EVERY_S / 2) and kept once read."""
        info = snap.get("info") or {}
        if now - float(info.get("api_heartbeat") or now) <= INFO_FRESH_S:
            self._ends = (0.0, {})
            return {}
        if now - self._ends[0] >= FT_EVERY_S / 2:
            pids = {int(r["pid"]) for r in snap.get("ranks", []) if isinstance(r, dict) and r.get("pid")}
            self._ends = (now, {**self._ends[1], **actor_ends(pids)})
        return self._ends[1]

    def _autoscale(
        self, snap: dict[str, Any], now: float, flag: bool | None, running: str | None
    ) -> dict[str, Any] | None:
        """One decision of the shared core on vLLM's figures; one that acts goes to the controller.
        A scale-down's record says which ranks vLLM retires: always its highest, not the emptiest."""
        autoscale = self.autoscale_host
        if autoscale.policy is None or str(autoscale.policy.mode) == "off":
            autoscale.learn_costs(self.host.finished_ops())  # the scales operators ran teach the cost too
        if autoscale.policy is None:
            return None
        if str(autoscale.policy.mode) != "off":
            members, statuses = current_world(snap)
            finished = self.host.finished_ops()
            busy = (
                running
                or ("vLLM's own scale (its scaling flag is set)" if flag else None)
                or _size_unreported(snap, finished)
            )
            decision = autoscale.tick(
                statuses,
                members,
                now=now,
                busy=busy,
                prepared_dp=prepared_dp(snap, now),
                ops=finished,  # each finished scale's wall time, learned once
            )
            if decision is not None and decision.recommendation < decision.current_dp:
                leaving = ", ".join(map(str, range(decision.recommendation, decision.current_dp)))
                decision.rule += f"; vLLM retires its highest rank(s): {leaving} (not the emptiest)"
            if decision is not None and decision.act:
                why = (
                    "vLLM's scaling flag is unknown (the API server's info is stale)"
                    if flag is None
                    else self.host.act_on(decision, flag)
                )
                if why:  # another scale got there first, or vLLM cannot be asked now: next tick decides again
                    autoscale.record_skip(decision.id, why)
        return autoscale.shown(now)

    def record_outcome(self, op: dict[str, Any]) -> None:
        """How the scale of an acting decision (``op["plan"]["decision"]``) ended, into that decision."""
        ok = op["state"] == "succeeded"
        with self._ticking:
            self.autoscale_host.record_outcome(
                op["plan"]["decision"],
                ok,
                f"{op['op_id']} DP {op['from_size']} -> {op['to_size']}"
                if ok
                else f"{op['op_id']} {op['state']}: {op.get('error', '')}"[:300],
            )

    def _publish(self, info: dict[str, Any], findings: dict[str, Any], shown: dict[str, Any] | None) -> None:
        """What status shows, into the registry's info, only when it differs from what is there
        (so a registry recreated meanwhile gets it back, and an idle tick writes nothing)."""
        control: dict[str, Any] = {"vllm": findings}
        if self.last_error:
            control["last_error"] = self.last_error
        want: dict[str, Any] = {"control": control}
        if shown is not None:
            want["autoscale"] = shown
        if any(info.get(k) != v for k, v in want.items()):
            self.host.call("set_info", want)


def _size_unreported(snap: dict[str, Any], finished: list[dict[str, Any]]) -> str | None:
    """Why not to decide yet: the API server's info (written every 2 s) predates the end of the last
    scale, so its DP size may still be the old one (a decision on it scaled 2 -> 3 again at once)."""
    last = max(finished, key=lambda op: float(op.get("finished") or 0.0), default=None)
    heartbeat = float((snap.get("info") or {}).get("api_heartbeat") or 0.0)
    if last is None or heartbeat >= float(last.get("finished") or 0.0):
        return None
    return f"vLLM's size after {last['op_id']} not reported yet"


def actor_ends(pids: set[int]) -> dict[int, dict[str, Any]]:
    """How the dead actors with these pids ended, from Ray's actor table: pid -> reason (Ray's
    ``ActorDiedErrorContext.Reason``: RAY_KILL when vLLM killed it, WORKER_DIED for a SIGKILL),
    message and end time."""
    from ray.core.generated import common_pb2

    from engine_ext.ray import ray_private

    reasons = common_pb2.ActorDiedErrorContext.Reason
    out: dict[int, dict[str, Any]] = {}
    for a in ray_private.dead_actors():
        ctx = a["DeathCause"].actor_died_error_context
        pid = int(a.get("Pid") or ctx.pid or 0)
        if pid in pids:
            out[pid] = {
                "reason": reasons.Name(ctx.reason),
                "message": ctx.error_message,
                "end": float(a.get("EndTime") or 0) / 1000.0 or None,
                "class": a.get("ActorClassName"),
            }
    return out


def read_flag(api: VllmApi) -> bool | None:
    """vLLM's flag from its endpoint, or None when it cannot be read now."""
    try:
        return api.is_scaling()
    except EepError:
        return None
