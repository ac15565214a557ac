"""Mixed-fault chaos: a seeded schedule of scales, each with one fault a random moment in.

Each round starts a scale to its target and, ``at_s`` seconds in, injects one fault:

* rank-kill        a rank SIGKILLed (by its pid)
* rank-stop        a rank SIGSTOPped, resumed (SIGCONT) two health deadlines later
* controller-kill  the controller actor SIGKILLed (Ray restarts it; it takes the deployment over)
* rank+controller  a rank and the controller SIGKILLed together

then waits (``--bound``) until the deployment serves again: no operation running, every live rank
serving at one DP size equal to the desired size, and a request answered with the oracle's
output. An open-loop load runs the whole time; at the end no request may have failed.

Figures: rounds, recoveries (recover/rebuild operations that succeeded), time from each fault to
serving again (p50/max), failed requests. ``ISSUE_36`` is the schedule that wedged the deployment
for good before take-overs removed what the old attempt left (issue 36).

Usage: .venv/bin/python benchmarks/chaos.py [--rounds 12] [--seed S] [--rate 2] [--address HOST:PORT]
Without --address it starts a local Ray head (own process group, own state dir) and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FAULTS = ("rank-kill", "rank-stop", "controller-kill", "rank+controller")
# 8 slots per rank: DP 1 holds every expert, so any size from 1 to MAX_DP is a valid world.
ENGINE = {"num_experts": 8, "slots_per_rank": 8, "top_k": 2, "num_layers": 2, "hidden_size": 64,
          "max_num_seqs": 8, "max_num_tokens": 64, "dtype": "float64", "seed": 0, "capture_sizes": [1, 2, 4, 8]}
START_DP, MAX_DP = 2, 4
DEADLINE_S = 3.0  # the health deadline (issue 36's deployment)
PROMPTS = [[1, 2, 3, 4, 5], [17, 42, 99, 7], [77, 78, 79]]


@dataclass(frozen=True)
class Round:
    """One scale and its fault. ``victim`` in [0, 1) picks the rank among those listed when the
    fault fires (sorted); ``members_only``: among the members at the scale's start."""

    target: int
    fault: str
    at_s: float
    victim: float = 0.0
    members_only: bool = False


# Issue 36: 2 -> 4 with rank 1 and the controller killed 1 s in (a placement group of the old
# attempt survived the take-over), 1 -> 3 with its only member killed 1.7 s in (every rebuild then
# failed on that name), back to 2, then 2 -> 1 with rank 0 and the controller killed 0.9 s in.
ISSUE_36 = [Round(4, "rank+controller", 1.0, 0.75, True), Round(3, "rank-kill", 1.7, 0.0, True),
            Round(2, "rank-kill", 2.0, 0.0, False), Round(1, "rank+controller", 0.9, 0.0, True)]


def schedule(seed: int, rounds: int, start_dp: int = START_DP, max_dp: int = MAX_DP) -> list[Round]:
    """``rounds`` random rounds: each target differs from the one before; fault, moment (0.3-3 s)
    and victim drawn from ``seed``."""
    rng = random.Random(seed)
    out, last = [], start_dp
    for _ in range(rounds):
        target = rng.choice([n for n in range(1, max_dp + 1) if n != last])
        out.append(Round(target, rng.choice(FAULTS), round(rng.uniform(0.3, 3.0), 2), round(rng.random(), 3)))
        last = target
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


class Chaos:
    """Runs rounds against one deployment of this machine (faults are signals by pid)."""

    def __init__(self, core: Any, t: Any, oracle: Callable[[list[int]], list[int]], *, bound_s: float = 150.0,
                 deadline_s: float = DEADLINE_S, log: Callable[[str], None] = print) -> None:
        self.core, self.t, self.oracle = core, t, oracle
        self.bound_s, self.deadline_s, self.log = bound_s, deadline_s, log
        self.stopped: list[int] = []  # SIGSTOPped pids, resumed by a timer (or by close())

    def _controller_pid(self) -> int:
        import ray

        from engine_ext.ray.deployment import actor
        from engine_ext.ray.names import controller_name

        return int(ray.get(actor(controller_name(self.t.name), self.t.namespace).pid.remote(), timeout=30))

    def _ranks(self) -> list[dict[str, Any]]:
        return [r for r in self.core.status(self.t)["ranks"]
                if r.get("pid") and r["state"] not in ("stale", "removed", "fenced", "dead", "standby")]

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
        listed = sorted((r for r in self._ranks() if not rnd.members_only or r["rank"] in members),
                        key=lambda r: r["rank"])
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
        rec = {"round": i, **asdict(rnd), "from": len(members), "victim_rank": victim["rank"] if victim else None,
               "scale": (outcome.get("op") or {}).get("state") or outcome.get("error"),
               "serving_s": round(serving_s, 2), "dp": self.core.status(self.t)["info"].get("desired_dp")}
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
                last = (f"ranks {[(r['rank'], r['state'], r.get('dp_size')) for r in live]}, desired {desired}, "
                        f"operation {bool(s.get('operation'))}, working on {control.get('working_on')!r}, "
                        f"last error {control.get('last_error')}, escalated {control.get('escalated')}")
                if (live and not s.get("operation") and len(live) == desired
                        and all(r["state"] == "serving" and r.get("dp_size") == desired for r in live)):
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


def figures(records: list[dict[str, Any]], ops: list[dict[str, Any]], load: dict[str, Any]) -> dict[str, Any]:
    times = sorted(r["serving_s"] for r in records)
    return {"rounds": len(records),
            "recoveries": sum(1 for o in ops if o.get("kind") in ("recover", "rebuild") and o.get("state") == "succeeded"),
            "failed_operations": sum(1 for o in ops if o.get("state") not in ("succeeded", "running")),
            "time_to_serving_s": {"p50": round(statistics.median(times), 2) if times else None,
                                  "max": round(times[-1], 2) if times else None},
            "requests": load.get("sent"), "failed_requests": load.get("failed")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    ap.add_argument("--issue-36", action="store_true", help="run issue 36's schedule first")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--bound", type=float, default=150.0, help="seconds a round may take to serve again")
    ap.add_argument("--address", default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    rounds = (ISSUE_36 if args.issue_36 else []) + schedule(seed, args.rounds,
                                                            ISSUE_36[-1].target if args.issue_36 else START_DP)
    print(f"chaos: seed {seed}, {len(rounds)} rounds: {[asdict(r) for r in rounds]}", flush=True)
    from eepctl import cluster, core
    from engine_ext.config import EngineConfig
    from engine_ext.model.dense_oracle import reference_generate

    started = None
    if args.address is None:
        os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-chaos-"))
        started = cluster.start_local(num_cpus=16)
        args.address = started["address"]
    t = core.Target(address=args.address, name="bench-chaos")
    cfg = EngineConfig(**ENGINE, instance_id=t.name)
    cache: dict[tuple[int, ...], list[int]] = {}

    def oracle(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = list(reference_generate(cfg, [list(prompt)], 8)[0]["output"])
        return cache[tuple(prompt)]

    chaos = Chaos(core, t, oracle, bound_s=args.bound, log=lambda s: print(s, flush=True))
    records: list[dict[str, Any]] = []
    load: dict[str, Any] = {}
    stop = threading.Event()
    try:
        core.up(t, dp=START_DP, max_dp=MAX_DP, engine=ENGINE, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300,
                health_deadline_s=DEADLINE_S)
        submit_ctx = core.requests(t, 8, 3600, note=lambda s: print(s, flush=True))
        from eepctl import loadgen

        with submit_ctx as submit:
            loader = threading.Thread(target=lambda: load.update(
                loadgen.open_loop(submit, PROMPTS, args.rate, 24 * 3600, 3600, seed, stop)))
            loader.start()
            try:
                for i, rnd in enumerate(rounds):
                    records.append(chaos.run_round(i, rnd))
            finally:
                stop.set()
                loader.join(600)
        wrong = [r for r in load.get("records", []) if not r["error"] and r["output"] != oracle(PROMPTS[r["prompt_index"]])]
        out = {"seed": seed, **figures(records, core.events(t)["operations"], load), "wrong_outputs": len(wrong),
               "per_round": records}
        print(json.dumps(out), flush=True)
    finally:
        chaos.close()
        try:
            core.down(t, stop_cluster=False)
        except Exception:  # noqa: BLE001 - the cluster goes next anyway
            pass
        if started is not None:
            cluster.stop_process_group(int(started["pgid"]))


if __name__ == "__main__":
    main()
