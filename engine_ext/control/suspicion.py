"""Suspecting the observer: when most members fall silent together, the controller doubts itself first.

Envoy's outlier detection never ejects more than ``max_ejection_percent`` of a cluster on one
signal; Kubernetes' node lifecycle controller stops evicting when most of a zone looks unhealthy at
once. A liveness deadline that every member of a world misses together on a busy host says more
about the host, or the controller that runs on it, than about the members. The rule, each tick,
over the members whose processes live (a death is the transport's signal, never silence):

* a member that reported ``failed`` is fenced at once: that is an answer, not silence;
* when at most ``MAX_FENCE_FRACTION`` of the members are silent past the deadline and the
  controller's own tick lag stays under ``LAG_FRACTION`` of it, each silent member is fenced (the
  others answering show that the observer works);
* otherwise the observer is suspected: the deadline is extended to ``SUSPECT_FACTOR`` times the
  configured one, and a member silent past that is fenced only when a second probe, independent
  of the status probe (``RankClient.ping``, with the deadline as its timeout), gets no answer
  either. An answer to it is a sign of life, for a while: a member whose process answers the second
  probe but whose engine stays silent past ``HUNG_FACTOR`` configured deadlines is fenced all the
  same (a hung engine in a live process: a deadlock in a step, a lock never released).

A member that answers neither probe is so fenced at most ``fence_bound_s`` after its last sign of
life, suspicion or not; one whose process still answers, at most ``hung_bound_s``. Torch-free and
transport-free.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine_ext.control.health import silent_for

MAX_FENCE_FRACTION = 0.5  # more of the members silent together than this: suspect the observer
SUSPECT_FACTOR = 3.0  # the deadline while suspecting, in configured deadlines (the bound)
LAG_FRACTION = 0.5  # the controller's tick lag from this share of the deadline on: suspect the observer
HUNG_FACTOR = 6.0  # silent this many deadlines: fenced even while its process answers the second probe


def extended_deadline_s(deadline_s: float) -> float:
    """The deadline while the observer is suspected."""
    return SUSPECT_FACTOR * deadline_s


def confirm_timeout_s(deadline_s: float) -> float:
    """How long the second probe waits for an answer."""
    return deadline_s


def fence_bound_s(deadline_s: float, tick_s: float, probe_wait_s: float) -> float:
    """The longest a member that answers no probe stays unfenced after its last sign of life: the
    extended deadline, one more tick (its wait and the status probe's timeout), the second probe."""
    return extended_deadline_s(deadline_s) + tick_s + probe_wait_s + confirm_timeout_s(deadline_s)


def hung_bound_s(deadline_s: float, tick_s: float) -> float:
    """The longest a member whose process answers the second probe while its engine stays silent
    stays unfenced: ``HUNG_FACTOR`` deadlines and one more tick (its wait and the status probe's)."""
    return HUNG_FACTOR * deadline_s + tick_s + deadline_s


def host_load() -> tuple[float, int] | None:
    """The host's 1-minute load average and its core count (None where the OS does not say)."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None


class TickLag:
    """How late the reconcile loop's own timer fires: the observer's lag (a starved host, a paused
    controller), the largest seen within ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.seen: deque[tuple[float, float]] = deque(maxlen=512)  # (when, lag in seconds)

    def observe(self, lag_s: float) -> None:
        self.seen.append((time.time(), max(0.0, lag_s)))

    def recent(self) -> float:
        cut = time.time() - self.window_s
        return max((lag for at, lag in self.seen if at >= cut), default=0.0)


@dataclass
class Verdict:
    """What a tick does about its unhealthy members."""

    fence: dict[int, str] = field(default_factory=dict)  # rank -> reason: fence now
    confirm: dict[int, str] = field(default_factory=dict)  # rank -> reason: fence if the second probe fails too
    suspicion: dict[str, Any] | None = None  # the observer is suspected: what status shows


def judge(
    failed: dict[int, str],
    silent: dict[int, tuple[float, str]],
    members: int,
    deadline_s: float,
    lag_s: float,
    load: tuple[float, int] | None = None,
) -> Verdict:
    """The rule above. ``failed``: members that reported failed, with why; ``silent``: members
    silent past ``deadline_s``, with how long and what the last probe got; ``members``: how many
    live members there are; ``lag_s``: the controller's recent tick lag."""
    verdict = Verdict(fence=dict(failed))
    quiet = {r: v for r, v in silent.items() if r not in failed}
    if not quiet:
        return verdict
    if len(quiet) <= MAX_FENCE_FRACTION * members and lag_s < LAG_FRACTION * deadline_s:
        verdict.fence.update({r: silent_for(age, deadline_s, why) for r, (age, why) in quiet.items()})
        return verdict
    ext = extended_deadline_s(deadline_s)
    extended = f" extended to {ext:g}s: {len(quiet)} of {members} silent together, tick lag {lag_s:.1f}s"
    hung = HUNG_FACTOR * deadline_s
    hung_note = f"{extended}; past {hung:g}s a live process is no proof of a live engine"
    verdict.fence.update(
        {r: silent_for(age, deadline_s, why, hung_note) for r, (age, why) in quiet.items() if age > hung}
    )
    verdict.confirm = {
        r: silent_for(age, deadline_s, why, extended) for r, (age, why) in quiet.items() if ext < age <= hung
    }
    verdict.suspicion = {
        "silent": sorted(quiet),
        "members": members,
        "silent_s": round(min(age for age, _ in quiet.values()), 1),
        "lag_s": round(lag_s, 1),
        "load": round(load[0], 1) if load else None,
        "cores": load[1] if load else None,
        "deadline_s": deadline_s,
        "extended_s": ext,
    }
    return verdict


class Suspicion:
    """The suspicion under way (``now``) and the last one that ended (``last``), for status: when
    it began, the longest silence it saw and the ranks a second probe confirmed and got fenced."""

    def __init__(self) -> None:
        self.now: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None

    def update(self, found: dict[str, Any] | None, fenced: list[int]) -> None:
        """One tick's finding (None: the observer is not suspected) and the ranks the second probe
        confirmed, which it fenced."""
        t = time.time()
        if found is None:
            if self.now is not None:
                self.last = {**self.now, "ended": round(t, 1)}
            self.now = None
            return
        prev = self.now or {"since": round(t, 1), "longest_s": 0.0, "fenced": []}
        self.now = {
            **found,
            "since": prev["since"],
            "longest_s": max(prev["longest_s"], found["silent_s"]),
            "fenced": sorted(prev["fenced"] + fenced),
        }
