"""The chaos runner both the chaos test (tests/test_chaos_ray.py) and benchmarks/chaos.py drive:
rounds of engine_ext.fault_schedule against one deployment of this machine, each a scale with one
fault a moment in (faults are signals by pid), then a wait until the deployment serves its desired
size again with the oracle's outputs. The deployment both use: ENGINE at START_DP, MAX_DP and the
DEADLINE_S health deadline."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from engine_ext.fault_schedule import Round

# 8 slots per rank: DP 1 holds every expert, so any size from 1 to MAX_DP is a valid world.
ENGINE = {
    "num_experts": 8,
    "slots_per_rank": 8,
    "top_k": 2,
    "num_layers": 2,
    "hidden_size": 64,
    "max_num_seqs": 8,
    "max_num_tokens": 64,
    "dtype": "float64",
    "seed": 0,
    "capture_sizes": [1, 2, 4, 8],
}
START_DP, MAX_DP = 2, 4
DEADLINE_S = 3.0  # the health deadline
PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99, 7], [77, 78, 79]]


class Chaos:
    """Runs rounds against one deployment of this machine (faults are signals by pid)."""

    def __init__(
        self,
        core: Any,
        t: Any,
        oracle: Callable[[list[int]], list[int]],
        *,
        bound_s: float = 150.0,
        deadline_s: float = DEADLINE_S,
        log: Callable[[str], None] = print,
    ) -> None:
        self.core, self.t, self.oracle = core, t, oracle
        self.bound_s, self.deadline_s, self.log = bound_s, deadline_s, log
        self.stopped: list[int] = []  # SIGSTOPped pids, resumed by a timer (or by close())

    def _controller_pid(self) -> int:
        import ray
        from engine_ext.ray.deployment import actor
        from engine_ext.ray.names import controller_name

        return int(ray.get(actor(controller_name(self.t.name), self.t.namespace).pid.remote(), timeout=30))

    def _ranks(self) -> list[dict[str, Any]]:
        return [
            r
            for r in self.core.status(self.t)["ranks"]
            if r.get("pid") and r["state"] not in ("stale", "removed", "fenced", "dead", "standby")
        ]

    def run_round(self, i: int, rnd: Round) -> dict[str, Any]:
        """One round; its record (raises AssertionError when the deployment does not serve within the bound)."""
        ctl_pid = self._controller_pid()
        members = {r["rank"] for r in self._ranks()}
        outcome: dict[str, Any] = {}

        def scale() -> None:
            try:
                outcome["op"] = self.core.scale(self.t, rnd.target, drain_timeout_s=30.0, timeout_s=120.0, wait=True)
            except Exception as e:  # noqa: BLE001 - a scale a fault ended is expected to fail
                outcome["error"] = f"{type(e).__name__}: {str(e)[:200]}"

        scaler = threading.Thread(target=scale, daemon=True)
        t0 = time.time()
        scaler.start()
        time.sleep(max(0.0, t0 + rnd.at_s - time.time()))
        listed = sorted(
            (r for r in self._ranks() if not rnd.members_only or r["rank"] in members), key=lambda r: r["rank"]
        )
        victim = listed[int(rnd.victim * len(listed))] if listed and rnd.fault != "controller-kill" else None
        t_fault = time.time()
        if victim is not None:
            pid = int(victim["pid"])
            if rnd.fault == "rank-stop":
                os.kill(pid, signal.SIGSTOP)  # this deployment's own rank process
                self.stopped.append(pid)
                threading.Timer(2 * self.deadline_s, self._resume, [pid]).start()
            else:
                os.kill(pid, signal.SIGKILL)
        if rnd.fault in ("controller-kill", "rank+controller"):
            os.kill(ctl_pid, signal.SIGKILL)  # this deployment's own controller actor
        what = f"{rnd.fault}" + (f" rank {victim['rank']}" if victim is not None else "")
        self.log(f"round {i}: DP {len(members)} -> {rnd.target}, {what} {t_fault - t0:.1f}s in")
        scaler.join(240)
        killed = [int(victim["pid"])] if victim is not None and rnd.fault != "rank-stop" else []
        serving_s = self.wait_serving(t_fault, killed, ctl_pid if "controller" in rnd.fault else 0)
        rec = {
            "round": i,
            **asdict(rnd),
            "from": len(members),
            "victim_rank": victim["rank"] if victim else None,
            "scale": (outcome.get("op") or {}).get("state") or outcome.get("error"),
            "serving_s": round(serving_s, 2),
            "dp": self.core.status(self.t)["info"].get("desired_dp"),
        }
        self.log(f"round {i}: serving again at DP {rec['dp']} {serving_s:.1f}s after the fault (scale: {rec['scale']})")
        return rec

    def _resume(self, pid: int) -> None:
        if pid in self.stopped:
            self.stopped.remove(pid)
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass

    def close(self) -> None:
        for pid in list(self.stopped):
            self._resume(pid)

    def wait_serving(self, since: float, killed: list[int] = (), old_controller: int = 0) -> float:
        """Seconds from ``since`` until the deployment serves its desired size with the oracle's
        outputs, with no ``killed`` pid among its ranks and the controller restarted when it was
        ``old_controller``; AssertionError naming what status showed after the bound."""
        deadline, last = since + self.bound_s, "nothing"
        while time.time() < deadline:
            try:
                if old_controller and self._controller_pid() == old_controller:
                    last = "the killed controller is still listed"
                    time.sleep(0.5)
                    continue
                s = self.core.status(self.t)
                live = [r for r in s["ranks"] if r["state"] not in ("stale", "removed", "fenced", "dead", "standby")]
                if any(int(r.get("pid") or 0) in killed for r in live):
                    last = f"a killed rank {killed} is still listed as live"
                    time.sleep(0.5)
                    continue
                desired = int(s["info"].get("desired_dp") or 0)
                control = s["info"].get("control") or {}
                last = (
                    f"ranks {[(r['rank'], r['state'], r.get('dp_size')) for r in live]}, desired {desired}, "
                    f"operation {bool(s.get('operation'))}, working on {control.get('working_on')!r}, "
                    f"last error {control.get('last_error')}, escalated {control.get('escalated')}"
                )
                if (
                    live
                    and not s.get("operation")
                    and len(live) == desired
                    and all(r["state"] == "serving" and r.get("dp_size") == desired for r in live)
                ):
                    t_ok = time.time()
                    gen = self.core.generate(self.t, PROMPTS, 8, 60)
                    bad = [r for r in gen["results"] if r["error"] or r["output"] != self.oracle(r["prompt"])]
                    assert not bad, f"outputs unlike the oracle's or failed: {bad}"
                    return t_ok - since
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - the controller or registry is being restarted
                last = f"{type(e).__name__}: {str(e)[:200]}"
            time.sleep(0.5)
        raise AssertionError(f"{self.t.name} did not serve within {self.bound_s:.0f}s of the fault; last: {last}")
