"""The vLLM controller's loop: between operations, what vLLM reports is reconciled and the
autoscaler's decision core runs on vLLM's own figures.

Every TICK_S (an Event wait: no tick of its own making in between) the loop reads the registry
once, watches vLLM's scaling flag as the plugin publishes it (the endpoint only when that is
stale), ends an operation whose controller died mid-scale once vLLM's flag is down, reads vLLM's fault-tolerance status at most every FT_EVERY_S on a server that has it, and
runs one decision of the shared core (engine_ext.ray.autoscale_host) in advisory mode. What status
shows goes into the registry's info only when it differs from what is there; the policy and the
decisions persist in the GCS KV under the key `eepctl down` deletes. Mounted by
``engine_ext.ray.vllm_controller.VllmController``, which provides ``_call``, ``_changed`` and
``_running``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from engine_ext.control.vllm_api import VllmApi, message_of
from engine_ext.control.vllm_deployment import api_for, current_size
from engine_ext.control.vllm_reconcile import (
    FLAG_STUCK_S,
    FlagWatch,
    OrphanWatch,
    current_world,
    engines_finding,
    published_flag,
)
from engine_ext.protocol import EepError, PreconditionError
from engine_ext.ray.autoscale_host import AutoscaleHost, AutoscaleMethods
from engine_ext.ray.durable import DurableState

TICK_S = 2.0  # the loop's period: the plugin refreshes the API server's info every 2 s, rank records every 1 s
FT_EVERY_S = 10.0  # vLLM's fault-tolerance status is read at most this often (an HTTP call to the server)
MODE_ON_REFUSED = ("--mode on is not available for a vLLM deployment: vLLM's scale-down always retires its "
                   "highest ranks (not the emptiest) and the loop would need the API key kept past a controller "
                   "restart; use --mode advisory and act with `eepctl scale`")


def _error(e: EepError) -> dict[str, Any]:
    return {"error": {"code": int(e.exit_code), "message": e.message, "detail": e.detail}}


class VllmLoop(AutoscaleMethods):
    """The loop's state and the autoscale actor methods of a vLLM controller."""

    deployment: str
    _changed: threading.Condition
    _running: str | None

    _ops: dict[str, dict[str, Any]]

    def _call(self, method: str, *args: Any) -> Any: ...

    def _record(self, op: dict[str, Any]) -> None: ...

    def _start_loop(self, namespace: str, flag_bound_s: float = FLAG_STUCK_S, tick_s: float = TICK_S) -> None:
        self.tick_s = tick_s
        self.flag_watch = FlagWatch(bound_s=flag_bound_s)
        self.orphans = OrphanWatch()
        self.findings: dict[str, Any] = {}
        self.last_error: dict[str, Any] | None = None
        self.ticks = 0
        self._key: str | None = None  # the last API key a client passed: memory only, for the loop's reads
        self._ft: tuple[float, dict[str, Any] | None] = (0.0, None)  # (read at, finding)
        self.durable = DurableState(namespace, self.deployment)
        try:
            saved = self.durable.load() or {}
        except Exception:  # noqa: BLE001 - no GCS KV reachable: start without a policy
            saved = {}
        self.autoscale_host = AutoscaleHost(self.deployment, max_dp=1 << 16, persist=self._persist,
                                            saved=saved.get("autoscale"))
        self._stop = threading.Event()
        self._ticking = threading.Lock()  # the loop's tick and a tick asked by set_autoscale
        threading.Thread(target=self._loop, name="eep-vllm-reconcile", daemon=True).start()

    def _persist(self, state: dict[str, Any]) -> None:
        """The autoscaler's durable state (policy, last decisions), written only when it changed."""
        self.durable.save({"kind": "vllm", "autoscale": state})

    def remember_key(self, api_key: str | None) -> None:
        if api_key:
            self._key = api_key

    def stop(self) -> None:
        self._stop.set()

    # ---- autoscale (the reference controller's decision core, advisory only) ------------------
    def set_autoscale(self, changes: dict[str, Any], api_key: str | None = None) -> dict[str, Any]:
        """The policy over the one kept: ``--mode on`` is refused (MODE_ON_REFUSED), bounds are
        checked against what vLLM allows (its max DP, the fewest ranks that hold every expert)."""
        self.remember_key(api_key)
        try:
            host = self.autoscale_host
            mode = str(changes.get("mode", host.policy.mode if host.policy else "advisory"))
            if mode == "on":
                raise PreconditionError(MODE_ON_REFUSED)
            info = self._call("snapshot").get("info") or {}
            host.max_dp = int(info.get("max_dp") or info.get("dp") or host.max_dp)
            hi = changes.get("max_dp", host.policy.max_dp if host.policy else 8)
            if isinstance(hi, int) and hi > host.max_dp:
                raise PreconditionError(f"--max-dp {hi} is over {self.deployment!r}'s max DP {host.max_dp} "
                                        "(vLLM's --elastic-ep-max-dp-size)")
            lo = changes.get("min_dp", host.policy.min_dp if host.policy else 1)
            if info.get("min_dp") and isinstance(lo, int) and lo < int(info["min_dp"]):
                raise PreconditionError(f"--min-dp {lo} is under DP {info['min_dp']}, the fewest ranks of "
                                        f"{self.deployment!r} that hold its {info.get('num_experts')} experts")
        except EepError as e:
            return _error(e)
        res = host.set_autoscale(changes)
        self._wake()
        return res

    # ---- the loop ----------------------------------------------------------------------------
    def _wake(self) -> None:
        """Publish the new policy at once instead of at the next tick."""
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
                self._call("set_info", {"control": {"vllm": self.findings, "last_error": self.last_error}})
            except Exception:  # noqa: BLE001
                pass

    def tick(self, now: float | None = None) -> dict[str, Any]:
        """Observe (one registry read; vLLM's flag as the plugin published it, else the endpoint),
        find, decide, and publish what changed. Returns the findings."""
        now = time.time() if now is None else now
        snap = self._call("snapshot")
        info = snap.get("info") or {}
        flag = published_flag(snap, now)
        if flag is None and info.get("api_url"):
            flag = read_flag(api_for(snap, self._key, timeout_s=3.0))
        op = snap.get("operation")
        with self._changed:
            running = self._running
            ours = bool(op) and op.get("op_id") in self._ops
        ended = self.orphans.observe(now, op, ours, flag, current_size(snap))
        if ended is not None:  # a scale whose controller died: ended with the size vLLM reports
            self._record(ended)
        findings: dict[str, Any] = {}
        stuck = self.flag_watch.observe(now, flag, running)
        if stuck:
            findings["flag_stuck"] = stuck
        engines = self._engines(snap, now, flag)
        if engines:
            findings["engines"] = engines
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
            self._ft = (now, engines_finding(_ft_status(snap, self._key)))
        return self._ft[1]

    def _autoscale(self, snap: dict[str, Any], now: float, flag: bool | None,
                   running: str | None) -> dict[str, Any] | None:
        """One decision of the shared core on vLLM's figures (advisory: recorded, never acted on)."""
        host = self.autoscale_host
        if host.policy is None:
            return None
        if str(host.policy.mode) != "off":
            members, statuses = current_world(snap)
            busy = running or ("vLLM's own scale (its scaling flag is set)" if flag else None)
            host.tick(statuses, members, now=now, busy=busy)
        return host.shown(now)

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
            self._call("set_info", want)


def read_flag(api: VllmApi) -> bool | None:
    """vLLM's flag from its endpoint, or None when it cannot be read now."""
    try:
        return api.is_scaling()
    except EepError:
        return None


def _ft_status(snap: dict[str, Any], api_key: str | None) -> dict[str, Any]:
    """vLLM's ``GET /fault_tolerance/status`` body, or ``{"error": why}``."""
    try:
        code, body = api_for(snap, api_key, timeout_s=5.0).get("/fault_tolerance/status")
    except EepError as e:
        return {"error": e.message}
    if code != 200 or not isinstance(body, dict):
        return {"error": f"HTTP {code}: {message_of(body)}"}
    return body
