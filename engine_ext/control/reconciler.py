"""The controller's reconcile loop: level-triggered, like Kubernetes controllers and Ray Serve's.

Every tick it compares what is desired (the DP size, the failure policy) with what is observed
(each member's answer to a probe, its reported state, the running operation, requests waiting)
and takes the next action, one at a time: fence an unhealthy member (the recovery runs without
it; when most members fall silent together it suspects itself first and fences only what a
second probe confirms, within a bound: engine_ext.control.suspicion), heal a world whose
members all degraded with no one dead, rebuild from the weight source when no healthy rank is
left, grow back to the desired size, fail requests that waited past the bound. Events (a death,
a fence) only wake it early. An action that raises is recorded with its time (``eepctl status``
shows it) and retried with backoff; the loop itself never dies. An action that fails the same
way ``ESCALATE_AFTER`` times in a row is escalated: status names it, the cause, the attempts and
what the operator can do, and the loop retries it at the longest backoff.
Torch-free and transport-free: the Ray controller and the process launcher both run it.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from engine_ext.config import RankFailurePolicy
from engine_ext.control.health import DEFAULT_DEADLINE_S, Health
from engine_ext.control.suspicion import Suspicion, TickLag, confirm_timeout_s, extended_deadline_s, host_load, judge
from engine_ext.control.world import short_error
from engine_ext.faults import backoff_max_s

if TYPE_CHECKING:
    from engine_ext.control.orchestrator import Orchestrator

TICK_S = 1.0
PARK_BOUND_S = 120.0  # a request waits this long for a world to serve it, then fails with why
BACKOFF_MAX_S = 30.0
SWEEP_EVERY = 5  # ticks between two looks for orphaned rank processes
ESCALATE_AFTER = 3  # the same action failing the same way this many times in a row is escalated
_VARYING = re.compile(r"op-[0-9a-z-]+|'[0-9a-f]{16,}'|\d+(\.\d+)?")  # ids and numbers: the same way either way


class Reconciler:
    """Drives one deployment's observed state towards its desired state."""

    def __init__(
        self,
        orch: Orchestrator,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        tick_s: float = TICK_S,
        park_bound_s: float = PARK_BOUND_S,
        on_tick: Callable[[], None] | None = None,
        sweep: Callable[[], Awaitable[list[str]]] | None = None,
        autoscale: Callable[[], Awaitable[list[str]]] | None = None,
    ) -> None:
        self.orch = orch
        self.on_tick = on_tick or (lambda: None)  # after each tick: persist, publish
        self.sweep = sweep  # ends rank processes no world knows (a joiner launched by a dead controller)
        self.autoscale = autoscale  # moves the desired size from the load (engine_ext.ray.autoscale_host)
        self.health = Health(orch.world, deadline_s)
        self.lag = TickLag(window_s=extended_deadline_s(deadline_s))  # the observer's own lag
        self.suspicion = Suspicion()
        self.tick_s = tick_s
        self.park_bound_s = park_bound_s
        self.working_on = ""  # the difference the loop is acting on, for `eepctl status`
        self.last_error: dict[str, Any] | None = None  # {at, action, error}
        self.errors = 0
        self.escalated: dict[str, Any] | None = None  # an action failing the same way again and again
        self._streak: tuple[str, str] = ("", "")  # (action, cause) of the failures in a row
        self._attempts: list[str] = []  # those failures, oldest first
        self.ticks = 0
        self.tick_seconds: deque[float] = deque(maxlen=600)  # each tick's own time, newest last
        self._backoff_until = 0.0
        self._backoff_s = 0.0
        self.backoff_max_s = backoff_max_s(BACKOFF_MAX_S)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def wake(self) -> None:
        """Something happened (a death, a message from a fenced rank): tick now."""
        self._wake.set()

    async def run(self) -> None:
        while not self.orch.world.stopping:
            t0 = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - recorded, retried with backoff; the loop lives
                self.failed(self.working_on or "reconcile", e)
            self.tick_seconds.append(time.monotonic() - t0)
            try:
                self.on_tick()
            except Exception as e:  # noqa: BLE001 - the loop lives
                self.failed("persist", e)
            self._wake.clear()
            began = time.monotonic()
            try:
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            except asyncio.TimeoutError:  # how late the timer fired: this process's own lag
                self.lag.observe(time.monotonic() - began - self.tick_s)

    def failed(self, action: str, error: BaseException | str) -> None:
        """An action failed: say so (with its time) and wait longer before the next try."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {short_error(error)}"
        now = time.time()
        self.last_error = {"at": now, "action": action, "error": text}
        self.errors += 1
        streak = (action, _VARYING.sub("#", text))
        if streak != self._streak:
            self._streak, self._attempts = streak, []
        self._attempts = (self._attempts + [f"{time.strftime('%H:%M:%S', time.gmtime(now))}Z {text[:300]}"])[-10:]
        self._backoff_s = min(self.backoff_max_s, max(1.0, self._backoff_s * 2))
        if len(self._attempts) >= ESCALATE_AFTER:
            self._backoff_s = self.backoff_max_s  # retrying blind at once would only fail again: keep it cheap
            self.escalated = {
                "action": action,
                "cause": text,
                "attempts": len(self._attempts),
                "tried": self._attempts[-ESCALATE_AFTER:],
                "operator": self._advice(action, text),
            }
        self._backoff_until = now + self._backoff_s

    def _advice(self, action: str, cause: str) -> str:
        """What the operator can do about an escalated action."""
        name = self.orch.name
        if "no capacity" in cause:
            return (
                f"add nodes or free resources so the placement policy can place the ranks, or lower the "
                f"desired size (`eepctl scale --dp N --name {name}`)"
            )
        return (
            f"`eepctl events --name {name}` shows each attempt; `eepctl repair --name {name}` retries at "
            f"once; if the cause persists, `eepctl down --name {name}` removes everything of the deployment "
            f"(what a dead controller left included) and `eepctl up --name {name}` starts it afresh"
        )

    def reset_backoff(self) -> None:
        """An operator asked (``eepctl repair``): act now."""
        self._backoff_s, self._backoff_until = 0.0, 0.0

    def _succeeded(self) -> None:
        self._backoff_s, self._backoff_until = 0.0, 0.0
        self._streak, self._attempts, self.escalated = ("", ""), [], None

    async def tick(self) -> list[str]:
        """One pass: observe, then take the first action due. Returns what it did."""
        o, w = self.orch, self.orch.world
        self.ticks += 1
        done: list[str] = []
        live = [r for r in w.members if r not in o.recovery.dead]
        await self.health.probe(live)
        done += await self._fence_unhealthy(live)
        await w.router.retry_parked()  # requests no rank took a moment ago, when nothing holds them
        expired = w.router.expire_parked(self.park_bound_s, w.router.unhealthy or "no rank could take it")
        if expired:
            done.append(f"failed {expired} request(s) that waited over {self.park_bound_s:.0f}s")
        if w.op_lock.locked() or o.recovery.running():
            self.working_on = ""  # ``view`` shows the running operation live: never a phase it left
            return done
        if time.time() < self._backoff_until:
            return done
        done += await self._converge()
        return done

    async def _fence_unhealthy(self, live: list[int]) -> list[str]:
        """Fence the members that reported failed and the silent ones, but when most members
        are silent together (or this loop lagged), only those a second probe confirms past the
        extended deadline (engine_ext.control.suspicion)."""
        h = self.health
        verdict = judge(h.failed(live), h.silent(live), len(live), h.deadline_s, self.lag.recent(), host_load())
        confirmed = await h.confirm(verdict.confirm, confirm_timeout_s(h.deadline_s)) if verdict.confirm else {}
        self.suspicion.update(verdict.suspicion, sorted(confirmed))
        done: list[str] = []
        for rank, reason in {**verdict.fence, **confirmed}.items():
            self.working_on = f"fence rank {rank}: {reason}"
            await self.orch.fence(rank, reason)
            h.forget(rank)
            done.append(f"fenced rank {rank} ({reason})")
        return done

    async def _converge(self) -> list[str]:
        """The first difference between desired and observed that an action can close."""
        o, w = self.orch, self.orch.world
        if o.desired <= 0:
            self.working_on = ""
            return []
        healthy = [r for r in w.members if r not in o.recovery.dead]
        if not healthy or o.recovery.failed_reason:
            why = o.recovery.failed_reason or "every member is dead"
            self.working_on = f"rebuild DP {o.desired} from the weight source: {why}"
            res = await o.rebuild(why)
            return self._outcome("rebuild", res)
        degraded = [r for r in healthy if self.health.reported.get(r, {}).get("state") == "degraded"]
        if degraded and len(degraded) == len(healthy):
            self.working_on = f"heal: every member degraded ({degraded}) and none is dead"
            o.recovery.rebuild("every member degraded and none is dead", untrusted=False)
            return [self.working_on]
        target, size = o.growth_target(), w.size
        if target:  # the orchestrator's one growth path, as after a recovery
            self.working_on = f"grow DP {size} -> {target} (policy replace)"
            growth = await o.regrow()
            if growth.op is not None:
                return self._outcome("grow", growth.op)
            if growth.no_capacity:
                self.working_on = f"grow DP {size} -> {target}: waiting for capacity ({growth.no_capacity})"
                self.failed("grow", f"no capacity to grow DP {size} -> {target}: {growth.no_capacity}")
            else:
                self.failed("grow", f"grow DP {size} -> {target} refused: {growth.refused}")
            return []
        self.working_on = ""
        self._succeeded()
        done = await self.sweep() if self.sweep is not None and self.ticks % SWEEP_EVERY == 0 else []
        if self.autoscale is not None:  # only once the world is what was desired
            done += await self.autoscale()
        return done

    def _outcome(self, action: str, res: dict[str, Any]) -> list[str]:
        text = f"{action} {res.get('op_id')}: {res.get('state')}"
        if res.get("state") == "succeeded":
            self.working_on = ""  # the difference is closed: status must not show it until the next tick
            self._succeeded()
        else:
            self.failed(action, f"{res.get('op_id')} {res.get('state')}: {res.get('error')}")
        return [text]

    def failures_since(self, since: float) -> list[str]:
        """What the actions taken since ``since`` (an ``eepctl repair``) could not do: every
        operation that did not succeed, and, when the deployment is still short of its desired
        state, the loop's last error (a grow with no capacity runs no operation)."""
        o = self.orch
        failed = [
            f"{op.get('kind', 'scale')} {op['op_id']} {str(op.get('state')).replace('_', ' ')}: "
            f"{op.get('error') or 'no reason given'}"
            for op in o.world.history
            if float(op.get("started") or 0.0) >= since and op.get("finished") and op.get("state") != "succeeded"
        ]
        short = (
            o.recovery.failed_reason
            or any(r in o.recovery.dead for r in o.world.members)
            or (o.on_rank_failure == RankFailurePolicy.REPLACE and o.world.size < o.desired)
        )
        err = self.last_error
        if short and not failed:
            failed.append(
                f"{err['action']}: {err['error']}"
                if err and err["at"] >= since
                else f"the deployment is at DP {o.world.size} of desired {o.desired}"
            )
        return [" ".join(f.split("\n")) for f in failed]

    def view(self) -> dict[str, Any]:
        """What ``eepctl status`` shows of the loop."""
        w = self.orch.world
        running = w.running_op()
        live = (
            f"{running.kind} {running.op_id} in {running.phase}"
            if running is not None
            else "recovery"
            if self.orch.recovery.running()
            else ""
        )
        return {
            "working_on": self.working_on or live,
            "last_error": self.last_error,
            "errors": self.errors,
            "deadline_s": self.health.deadline_s,
            "health": self.health.view(list(w.members)),
            "fenced": {str(r): f for r, f in w.fenced.items()},
            "parked_requests": w.router.parked,
            "router_paused": w.router.paused,
            "escalated": self.escalated,
            "suspicion": self.suspicion.now,
            "last_suspicion": self.suspicion.last,
            # absolute, not "seconds left" nor the tick count: an idle tick changes nothing
            # here, so the controller writes and publishes nothing (engine_ext.ray.durable)
            "retry_at": round(self._backoff_until, 1) if self._backoff_until > time.time() else None,
        }
