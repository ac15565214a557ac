"""What the vLLM controller's loop reconciles, as pure functions of what it observed.

Each tick the loop reads the registry (the plugin's rank records and the API server's info) and
turns it into: the autoscaler's input (the current world's live vLLM ranks, whose records carry
vLLM's own waiting/running counts and KV-cache use), vLLM's scaling flag, and the findings
``status`` shows and ``repair`` answers to — a flag held with no operation of ours running for
longer than a bound (vLLM then answers 503 to everything, vLLM #50778/#53947), and engines that
vLLM's fault tolerance reports unhealthy or dead. Ray- and httpx-free, so the rules are unit-tested.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

FLAG_STUCK_S = 60.0  # a flag held this long with no operation of ours is a finding (EEPCTL_VLLM_FLAG_STUCK_S)
INFO_FRESH_S = 10.0  # the API server's info is trusted this long after its last update (it writes every 2 s)
RESTART_REMEDY = "restart the vLLM API server with the same arguments (nothing else lowers vLLM's scaling flag)"
ORPHAN_SETTLE_S = 6.0  # vLLM's flag down this long before an orphaned operation is ended (info is 2 s old at most)


def current_world(snap: dict[str, Any], stale_after_s: float = INFO_FRESH_S) -> tuple[list[int], list[dict[str, Any]]]:
    """(members, statuses) for the autoscaler: the ranks of vLLM's current DP size, and the records
    of those that report fresh (``requests_waiting``, ``requests_running``, ``kv_usage`` as vLLM's
    scheduler counts them). A rank that left or went stale says nothing about the current load."""
    info = snap.get("info") or {}
    ranks = [r for r in snap.get("ranks", []) if isinstance(r, dict) and "rank" in r]
    dp = int(info.get("dp") or len(ranks) or 1)
    members = list(range(dp))
    live = [
        r
        for r in ranks
        if int(r["rank"]) < dp
        and r.get("state") not in ("stale", "stopped", "failed")
        and float(r.get("heartbeat_age_s") or 0.0) <= stale_after_s
    ]
    return members, live


def scale_running(snap: dict[str, Any], now: float | None = None) -> bool | None:
    """Whether vLLM is scaling: its flag (up for the commit only) or a scale in flight in the API
    server (its prepare launches the new ranks for tens of seconds with the flag down); None when the
    info is missing or stale."""
    flag = published_flag(snap, now)
    if flag is None:
        return None
    return flag or bool((snap.get("info") or {}).get("scale_in_flight"))


def left_ranks(snap: dict[str, Any], now: float | None = None) -> list[int]:
    """The ranks whose records outlived their process past vLLM's current size: a rank a scale-down
        removed exits before its last report (so it goes stale, never "stopped"), and status would show
        it for ever. Only while the API server reports and vLLM is not scaling (``scale_running``), with no
    operation running:
        a rank past the size is then neither joining nor held prepared (those report)."""
    info = snap.get("info") or {}
    if scale_running(snap, now) is not False or snap.get("operation"):
        return []
    dp = int(info.get("dp") or 0)
    ranks = [r for r in snap.get("ranks", []) if isinstance(r, dict) and "rank" in r]
    return sorted(int(r["rank"]) for r in ranks if dp and int(r["rank"]) >= dp and r.get("state") == "stale")


def published_flag(snap: dict[str, Any], now: float | None = None) -> bool | None:
    """vLLM's scaling flag as the plugin read it in the API server process (the value
    ``/is_scaling_elastic_ep`` answers), or None when the info is missing or older than
    INFO_FRESH_S (the loop then asks the endpoint)."""
    info = snap.get("info") or {}
    now = time.time() if now is None else now
    if "scaling" not in info or now - float(info.get("api_heartbeat") or 0.0) > INFO_FRESH_S:
        return None
    return bool(info["scaling"])


def prepared_dp(snap: dict[str, Any], now: float | None = None) -> int | None:
    """The DP size whose engine cores vLLM holds prepared (engine_ext.vllm.standby: the API server's
    ``info["standby"]``, state "prepared"), so a scale-up to it is the commit alone; None when none
    is held over the current size, or the info is older than INFO_FRESH_S."""
    info = snap.get("info") or {}
    held = info.get("standby") or {}
    now = time.time() if now is None else now
    if held.get("state") != "prepared" or now - float(info.get("api_heartbeat") or 0.0) > INFO_FRESH_S:
        return None
    try:
        size = int(held.get("prepared") or 0)
    except (TypeError, ValueError):
        return None
    return size if size > int(info.get("dp") or 0) else None


@dataclass
class FlagWatch:
    """vLLM's scaling flag seen from outside: set while no operation of ours runs, for longer
    than ``bound_s``, it is a finding. A scale we run holds the flag legitimately; one posted to
    vLLM by someone else is covered by the bound (keep it above a normal transition)."""

    bound_s: float = FLAG_STUCK_S
    since: float | None = None
    last: dict[str, Any] | None = None

    def observe(self, now: float, flag: bool | None, running: str | None) -> dict[str, Any] | None:
        """This tick's finding, or None. An unreadable flag (None: the API server does not
        answer) keeps the last finding as it was, neither clearing nor growing it."""
        if flag is None:
            return self.last
        if not flag or running:
            self.since = self.last = None
            return None
        self.since = self.since if self.since is not None else now
        self.last = self._finding(now)
        return self.last

    def _finding(self, now: float) -> dict[str, Any] | None:
        assert self.since is not None
        held = now - self.since
        if held < self.bound_s:
            return None
        return {
            "since": round(self.since, 3),
            "held_s": round(held, 1),
            "bound_s": self.bound_s,
            "reason": (
                f"vLLM's scaling flag has been set for {held:.0f}s with no operation of eepctl's running "
                f"(bound {self.bound_s:.0f}s): vLLM answers 503 to every request"
            ),
            "repair": f"nothing eepctl can do: {RESTART_REMEDY}",
        }


@dataclass
class OrphanWatch:
    """A running operation in the registry that no controller runs: the one that ran it died
    mid-scale (Ray restarted the controller; its thread, and its POST to vLLM, died with it). vLLM
    finishes or drops that scale on its own. Once vLLM has stopped scaling for ``settle_s`` (its flag
    down and no scale in flight in the API server, ``scale_running``: the plugin's info, written every
    2 s, then carries vLLM's size), the record is ended with the size
    vLLM reports: succeeded at the target, rolled back at the old size, failed at any other."""

    settle_s: float = ORPHAN_SETTLE_S
    down_since: float | None = None

    def observe(
        self, now: float, op: dict[str, Any] | None, ours: bool, flag: bool | None, size: int
    ) -> dict[str, Any] | None:
        """The ended record to write now, or None (not an orphan, vLLM still scaling, or settling)."""
        if not op or op.get("state") != "running" or ours or flag:
            self.down_since = None
            return None
        if flag is None:  # unreadable now: neither start nor reset the settling
            return None
        if self.down_since is None:
            self.down_since = now
        if now - self.down_since < self.settle_s:
            return None
        self.down_since = None
        why = "its controller died during the scale (Ray restarted it)"
        if size == int(op["to_size"]):
            return dict(
                op,
                state="succeeded",
                finished=now,
                phase="commit",
                error=f"{why}; vLLM completed it: DP {size}",
                error_code=0,
            )
        if size == int(op["from_size"]):
            return dict(
                op,
                state="rolled_back",
                finished=now,
                error_code=5,
                error=f"{why}; vLLM did not complete it: still DP {size}",
            )
        return dict(
            op,
            state="failed",
            finished=now,
            error_code=5,
            error=f"{why}; vLLM reports DP {size}, neither DP {op['from_size']} nor DP {op['to_size']}",
        )


def engines_finding(body: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``GET /fault_tolerance/status`` reduced to what is not healthy, with what repair
    would do about it; None when every engine is healthy (or the server has no fault tolerance)."""
    if not isinstance(body, dict):
        return None
    if body.get("error"):
        return {"engines": {}, "reason": f"fault-tolerance status unreadable: {body['error']}", "repair": ""}
    bad = {str(e.get("id")): str(e.get("status")) for e in body.get("engines", []) if e.get("status") != "healthy"}
    if not bad:
        return None
    dead = sorted(k for k, v in bad.items() if v == "dead")
    unhealthy = sorted(k for k, v in bad.items() if v == "unhealthy")
    plan = []
    if unhealthy:
        plan.append(f"apply vLLM's 'retry' to engine(s) {', '.join(unhealthy)}")
    if dead:
        plan.append(f"none for dead engine(s) {', '.join(dead)}: restart the vLLM server")
    return {
        "engines": bad,
        "reason": "vLLM fault tolerance: " + ", ".join(f"engine {k} {v}" for k, v in sorted(bad.items())),
        "repair": "; ".join(plan),
    }


def server_down_finding(
    snap: dict[str, Any], now: float, ends: dict[int, dict[str, Any]], flag: bool | None
) -> dict[str, Any] | None:
    """vLLM's API server gone: its info older than INFO_FRESH_S and its flag endpoint not
    answering (``flag`` None). ``ends`` is Ray's record of the engine-core actors that ended (pid
    -> ``reason``, ``message``, ``end``): the first to die that vLLM did not kill itself is the
    cause. vLLM 0.32 answers a dead engine core by killing every other one and exiting the server
    (its engine manager's liveness monitor), so nothing is left to scale: the server must be
    started again, and the finding says with what command. Only the ranks of the server's last DP
    size count: one a scale-down removed ended earlier (vLLM stopped it), and its record may stay."""
    info = snap.get("info") or {}
    age = now - float(info.get("api_heartbeat") or 0.0)
    if not info.get("api_url") or flag is not None or age <= INFO_FRESH_S:
        return None
    size = int(info.get("dp") or 0)  # the world the server ran: a rank a scale-down removed left earlier, on purpose
    ranks = {
        int(r["pid"]): int(r["rank"])
        for r in snap.get("ranks", [])
        if isinstance(r, dict) and r.get("pid") and (not size or int(r["rank"]) < size)
    }
    dead = sorted((float(e.get("end") or now), ranks[pid], pid, e) for pid, e in ends.items() if pid in ranks)
    cause = next((d for d in dead if d[3].get("reason") != "RAY_KILL"), None)
    reason = f"vLLM's API server (pid {info.get('api_pid')}) stopped answering {age:.0f}s ago"
    finding: dict[str, Any] = {"since": round(now - age, 3), "dead_ranks": sorted(r for _, r, _, _ in dead)}
    if cause is not None:
        _, rank, pid, e = cause
        finding.update(dead_rank=rank, dead_pid=pid)
        killed = [r for _, r, _, x in dead if x is not e]
        reason += (
            f": engine-core rank {rank} (pid {pid}) died first ({e.get('reason')}: "
            f"{str(e.get('message') or '').strip()[:160]})"
            + (f"; vLLM then stopped rank(s) {', '.join(map(str, killed))} and exited" if killed else "")
        )
    command = info.get("api_command")
    finding.update(
        reason=reason,
        repair="vLLM cannot go on without a rank (no elastic scale with a dead peer; "
        "its fault tolerance needs --enable-fault-tolerance with an external load balancer): "
        + (f"start the server again: {command}" if command else RESTART_REMEDY),
    )
    return finding


def repair_plan(snap: dict[str, Any]) -> list[str]:
    """What `eepctl repair` would do, from what the controller and the plugin published: the
    findings first (a stuck flag blocks everything else: vLLM answers 503 to the fault-tolerance
    endpoints too)."""
    info = snap.get("info") or {}
    found = (info.get("control") or {}).get("vllm") or {}
    plan = []
    if found.get("flag_stuck") or info.get("wedged"):
        plan.append(f"vLLM's scaling flag is stuck: {RESTART_REMEDY}; repair cannot lower it")
    if found.get("server_down"):
        plan.append(f"{found['server_down']['reason']}; {found['server_down']['repair']}")
    if found.get("engines") and found["engines"].get("repair"):
        plan.append(found["engines"]["repair"])
    return plan
