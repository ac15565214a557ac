"""The controller's autoscaling side: the policy the deployment keeps, the window of rank
signals, the decisions, and what the three actor methods ``eepctl autoscale`` calls through the
driver (``set_autoscale``, ``autoscale_show``, ``autoscale_decisions``) answer.

The controller owns one ``AutoscaleHost`` (``autoscale_host``) and its three actor methods hand
the call to it. Its reconcile loop calls ``tick`` once per round with the ranks' status
records, acts on a decision whose ``act`` is set through the orchestrator's scale, and reports
the outcome with ``record_outcome``. Durable state goes out through ``persist`` (the controller
keeps it in Ray's GCS KV) and comes back as ``saved`` after a controller restart.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from engine_ext.control.autoscale_cost import ScaleCost
from engine_ext.control.autoscale_policy import AutoscalePolicy
from engine_ext.control.autoscale_signals import SignalWindow
from engine_ext.control.autoscaler import Autoscaler, Decision
from engine_ext.protocol import PreconditionError, UsageError, error_record

if TYPE_CHECKING:
    from engine_ext.control.orchestrator import Orchestrator

PERSIST_QUIET_S = 10.0  # ticks that change nothing are persisted at most this often
FAST_TICK_S = 0.45  # the loop waits this long after a tick while a policy is on and there is load: a tick every 0.5 s

Persist = Callable[[dict[str, Any]], None]
"""Stores the host's durable state (``AutoscaleHost.state``): the policy and the last decisions."""


class AutoscaleHost:
    """One deployment's autoscaler as the controller holds it."""

    def __init__(
        self, deployment: str, max_dp: int, persist: Persist, saved: dict[str, Any] | None = None, metrics: Any = None
    ) -> None:
        self.deployment = deployment
        self.max_dp = max_dp
        self.persist = persist
        self.metrics = metrics  # engine_ext.ray.metrics.AutoscalerMetrics, or None
        self.autoscaler: Autoscaler | None = None
        saved = saved or {}
        self.window = SignalWindow(learned=saved.get("capacity"))
        self.cost = ScaleCost.from_dict(saved.get("cost"))  # what a scale costs here, learned from its scales
        self.loaded = False  # the last tick saw requests admitted or work held
        self.resizing: asyncio.Future[Any] | None = None  # a --standby auto resize of the pool, in the background
        self._members: list[int] = []
        self._persisted_at = -PERSIST_QUIET_S
        self._durable: dict[str, Any] | None = None  # what was persisted last (``state``)
        self._shown: tuple[tuple[Any, ...], float, dict[str, Any]] | None = None  # (key, at, view)
        if saved.get("policy"):
            self.autoscaler = Autoscaler(AutoscalePolicy.from_dict(saved["policy"]), saved.get("decisions"))
            self.window.window_s = self.autoscaler.policy.window_s

    @property
    def policy(self) -> AutoscalePolicy | None:
        return self.autoscaler.policy if self.autoscaler is not None else None

    def state(self) -> dict[str, Any]:
        """The durable state as last persisted: the policy (None: never set) and the last 200
        decisions. The controller writes its whole snapshot every tick when it changed, so this
        moves only when the host persists (a change, or a quiet tick every PERSIST_QUIET_S): an
        idle deployment's tick writes nothing."""
        if self._durable is None:
            self._durable = self._live_state()
        return self._durable

    def _live_state(self) -> dict[str, Any]:
        a = self.autoscaler
        return {
            "policy": a.policy.to_dict() if a else None,
            "decisions": a.recent(200) if a else [],
            "capacity": self.window.capacity.learned,
            "cost": self.cost.to_dict(),
        }

    def period(self, idle_s: float) -> float:
        """How long the controller's loop waits for its next tick: ``FAST_TICK_S`` while a policy
        is set (not off) and the last tick saw load (requests admitted since the one before, or
        work held at a rank), else ``idle_s``: an idle deployment ticks as often as without one."""
        a = self.autoscaler
        on = a is not None and str(a.policy.mode) != "off"
        return min(idle_s, FAST_TICK_S) if on and self.loaded else idle_s

    def shown(self, now: float | None = None) -> dict[str, Any]:
        """``autoscale_show()`` for `eepctl status`, refreshed when what it says changes (policy,
        sizes, action, rule) or every PERSIST_QUIET_S: an idle deployment publishes nothing new."""
        now = time.time() if now is None else now
        a = self.autoscaler
        last = a.decisions[-1] if a and a.decisions else None
        key = (
            repr(a.policy.to_dict()) if a else None,
            (last.current_dp, last.recommendation, last.action, last.rule, last.mode) if last else None,
        )
        if self._shown is None or self._shown[0] != key or now - self._shown[1] >= PERSIST_QUIET_S:
            self._shown = (key, now, self.autoscale_show())
        return self._shown[2]

    # ---- what the actor methods answer -------------------------------------------------------
    def set_autoscale(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Set the policy: ``changes`` over the current one (or the defaults, mode advisory)."""
        before = self.policy.to_dict() if self.policy else None
        try:
            policy = AutoscalePolicy.from_dict({**(before or {}), **changes})
        except ValueError as e:
            return error_record(UsageError(str(e)))
        if policy.max_dp > self.max_dp:
            return error_record(
                PreconditionError(
                    f"--max-dp {policy.max_dp} is over the deployment's max DP "
                    f"{self.max_dp} (set at `eepctl up --max-dp`)"
                )
            )
        if self.autoscaler is None:
            self.autoscaler = Autoscaler(policy)
        else:
            self.autoscaler.set_policy(policy)
        self.window.window_s = policy.window_s
        self._persist()
        return {"deployment": self.deployment, "policy": policy.to_dict(), "previous": before}

    def autoscale_show(self) -> dict[str, Any]:
        """The policy, its mode, and the latest recommendation and why."""
        a = self.autoscaler
        last = a.decisions[-1].to_dict() if a and a.decisions else None
        return {"deployment": self.deployment, "policy": a.policy.to_dict() if a else None, "last": last}

    def autoscale_decisions(self, since: float = 0.0, limit: int = 200) -> dict[str, Any]:
        """Decisions taken after ``since`` (a time), oldest first, at most ``limit``."""
        a = self.autoscaler
        rows = [d.to_dict() for d in (a.decisions if a else []) if d.at > since]
        return {
            "deployment": self.deployment,
            "policy": a.policy.to_dict() if a else None,
            "decisions": rows[-max(1, limit) :],
        }

    # ---- what the reconcile loop calls -------------------------------------------------------
    def tick(
        self,
        statuses: list[dict[str, Any]],
        members: list[int],
        *,
        now: float | None = None,
        busy: str | None = None,
        num_experts: int = 1,
        slots_per_rank: int = 1,
        standby_ready: int = 0,
        prepared_dp: int | None = None,
        capacity: Callable[[int], str | None] | None = None,
        admissions: dict[str, int] | None = None,
        ops: list[dict[str, Any]] | None = None,
    ) -> Decision | None:
        """One round: record the ranks' signals, the router's ``admissions`` counters and what the
        finished scales in ``ops`` cost, and decide (None: no policy set); ``prepared_dp``: the size
        vLLM's engine cores prepared ahead serve by their commit alone. The loop scales to
        ``decision.recommendation`` when ``decision.act``, then calls ``record_outcome``."""
        now = time.time() if now is None else now
        if list(members) != self._members:  # readings of another world say nothing about this one
            self.window.readings.clear()
            self._members = list(members)
        before = self.window.arrivals.rows[-1][1] if self.window.arrivals.rows else None
        self.window.add(now, statuses, admissions)
        after = self.window.arrivals.rows[-1][1] if self.window.arrivals.rows else None
        self.loaded = (before is not None and after is not None and after > before) or any(
            isinstance(s, dict) and ((s.get("requests_waiting") or 0) + (s.get("requests_running") or 0)) > 0
            for s in statuses
        )
        learned = self.learn_costs(ops, persist=False)  # kept below, with the tick's decision
        self.cost.seed(next((str(s.get("kind")) for s in statuses if isinstance(s, dict) and s.get("kind")), ""))
        if self.autoscaler is None:
            return None
        imbalance = max((float(s.get("eplb_imbalance") or 0.0) for s in statuses if isinstance(s, dict)), default=None)
        obs = self.window.observed(
            now,
            list(members),
            busy=busy,
            num_experts=num_experts,
            slots_per_rank=slots_per_rank,
            standby_ready=standby_ready,
            prepared_dp=prepared_dp,
            capacity=capacity,
            eplb_imbalance=imbalance,
            capacity_seed=self.autoscaler.policy.capacity_tokens_s,
            cost=self.cost,
        )
        decision = self.autoscaler.decide(now, obs)
        if self.metrics is not None:
            self.metrics.on_decision(decision)
        if learned or decision.action != "none" or now - self._persisted_at >= PERSIST_QUIET_S:
            self._persist()  # a quiet tick is not worth a write; one in PERSIST_QUIET_S keeps the trail
            self._persisted_at = now
        return decision

    def learn_costs(self, ops: list[dict[str, Any]] | None, persist: bool = True) -> bool:
        """Learn each finished scale's wall time in ``ops`` (once each), with a policy or without
        one: a policy set later starts from this deployment's own scale costs, not the seed.
        Kept (persisted) when something was learned."""
        learned = [op for op in ops or [] if self.cost.observe(op)]
        if learned and persist:
            self._persist()
        return bool(learned)

    def record_outcome(self, decision_id: str, ok: bool, detail: str = "") -> None:
        """How the loop's scale for ``decision_id`` ended; a failure backs the autoscaler off."""
        if self.autoscaler is not None:
            self.autoscaler.record_outcome(decision_id, ok, detail)
            if self.metrics is not None:
                self.metrics.on_outcome(ok)
            self._persist()

    def record_skip(self, decision_id: str, why: str) -> None:
        """The loop could not start ``decision_id``'s scale (another operation got there first):
        its record says "skipped: why", it no longer counts as acted on (no cooldown, no back-off),
        and the next tick decides again."""
        a = self.autoscaler
        if a is None:
            return
        for d in reversed(a.decisions):
            if d.id == decision_id:
                d.act, d.action = False, f"skipped: {why}"[:300]
                break
        a.last_action_at = max((d.at for d in a.decisions if d.act), default=-math.inf)
        self._persist()

    def _persist(self) -> None:
        self._durable = self._live_state()
        try:
            self.persist(self._durable)
        except Exception:  # noqa: BLE001 - the next change persists again; the loop never dies of it
            pass


Act = Callable[[Decision], Awaitable[dict[str, Any]]]
"""Moves the desired size to ``decision.recommendation`` and returns the finished operation."""
Standby = Callable[[int], Awaitable[Any]]
"""Keeps that many ranks launched ahead (``eepctl standby --count``: the controller's ``set_standby``)."""


def busy_reason(orch: Orchestrator) -> str | None:
    """Why no scale may be decided now: an operation holds the world, or a member is dead (a
    recovery runs or is due)."""
    running = orch.busy()
    if running:
        return running
    dead = sorted(r for r in orch.recovery.dead if r in orch.members)
    return f"recovery of rank(s) {', '.join(map(str, dead))}" if dead else None


async def autoscale_round(
    host: AutoscaleHost,
    orch: Orchestrator,
    act: Act | None = None,
    now: float | None = None,
    statuses: list[dict[str, Any]] | None = None,
    standby: Standby | None = None,
) -> Decision | None:
    """One autoscaling round of a controller's loop over ``orch``'s world: decide from the
    members' status records, and when the decision acts, ``act`` on it and record the outcome.
    Without ``act`` the decision is only returned (the loop acts later and calls
    ``record_outcome``). ``statuses``: the records the loop's health probe already has this
    tick (``Health.statuses``), so a tick asks each rank once; None asks every member here.
    ``standby``: resizes the standby pool to what a ``--standby auto`` decision asks (no operation running)."""
    if statuses is None:
        answers = await asyncio.gather(*(c.status(timeout=3) for c in orch.clients.values()), return_exceptions=True)
        statuses = [a for a in answers if isinstance(a, dict)]
    pool = orch.spawner.pool
    decision = host.tick(
        statuses,
        list(orch.members),
        now=now,
        busy=busy_reason(orch),
        num_experts=orch.cfg.num_experts,
        slots_per_rank=orch.cfg.slots_per_rank,
        standby_ready=len(pool.ready) if pool is not None else 0,
        capacity=orch.spawner.check_capacity,
        admissions=orch.world.router.admissions(),
        ops=orch.history[-5:],
    )
    size = pool.size if pool is not None else 0
    if (
        decision is not None
        and decision.standby is not None
        and standby is not None
        and decision.standby != size
        and not busy_reason(orch)
        and (host.resizing is None or host.resizing.done())
    ):
        host.resizing = asyncio.ensure_future(standby(decision.standby))  # the pool the next burst wants
    if decision is None or not decision.act or act is None:
        return decision
    try:
        op = await act(decision)
    except Exception as e:  # noqa: BLE001 - a refused or failed scale backs the autoscaler off
        host.record_outcome(decision.id, False, f"{type(e).__name__}: {e}"[:300])
        return decision
    host.record_outcome(decision.id, op.get("state") == "succeeded", scale_outcome(op))
    return decision


def scale_outcome(op: dict[str, Any]) -> str:
    """What the decision record says of the scale it started: the operation and its sizes, and the
    requests a scale-up re-dispatched over the new width (engine_ext.control.redispatch); or how it
    failed."""
    if op.get("state") != "succeeded":
        return f"{op.get('op_id', '')} {op.get('state')}: {op.get('error')}"
    moved = int(op.get("redispatched_requests") or 0)
    return f"{op.get('op_id', '')} DP {op.get('from_size')} -> {op.get('to_size')}" + (
        f", {moved} waiting request(s) re-dispatched over the new width" if moved else ""
    )


def autoscaler_metrics(deployment: str) -> Any:
    """The autoscaler's Ray metrics, or None where they cannot be had (best effort)."""
    try:
        from engine_ext.ray.metrics import AutoscalerMetrics

        return AutoscalerMetrics(deployment)
    except Exception:  # noqa: BLE001 - metrics are best effort
        return None
