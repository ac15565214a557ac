"""Faults the control plane answers: time from the fault to serving again, and requests failed.

One run, each fault on a fresh DP-3 deployment (policy shrink, health deadline --deadline)
under open-loop load plus a back-to-back probe (its completion times show the serving pause):

* hang          rank 1 SIGSTOPped (fenced after the deadline, recovered around)
* failed-alive  rank 1's step raises (fault ``fail:step@1``; its process stays alive)
* controller    the controller actor SIGKILLed (Ray restarts it; it takes the ranks over)

and, in the same run, ``down`` + ``up`` + the first completion (a cold restart) for comparison.
A partition needs a second node (the test suite's network namespace): tests/test_multinode_ray.py.

Usage: .venv/bin/python benchmarks/faults.py [--rate 4] [--deadline 4] [--address HOST:PORT]
Without --address it starts a local Ray head (own process group, own state dir) and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.recovery import ENGINE, PROBE, Probe, _controller, _wait_serving  # noqa: E402

FAIL_AFTER_S = 25.0  # failed-alive: the rank fails this long after it started


def _pid_of(core: Any, t: Any, rank: int) -> int:
    return int(next(r for r in core.status(t)["ranks"] if r["rank"] == rank)["pid"])


def _controller_pid(t: Any) -> int:
    import ray

    return int(ray.get(_controller(t).pid.remote(), timeout=30))


def _scenario(core: Any, t: Any, rate: float, deadline_s: float, faults: list[str],
              inject: Callable[[], float]) -> dict[str, Any]:
    """Up DP 3, load, ``inject`` the fault (returns its time), wait for DP 2 (or 3) serving."""
    engine = dict(ENGINE, faults=faults, fault_delay_s=FAIL_AFTER_S, step_timeout_s=deadline_s)
    core.up(t, dp=3, max_dp=4, engine=engine, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300,
            on_rank_failure="shrink", health_deadline_s=deadline_s)
    _wait_serving(core, t, 3)
    load: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: load.update(core.load(t, core.DEFAULT_PROMPTS, 8, rate, 30.0,
                                                                   timeout_s=300)))
    with Probe(_controller(t)) as probe:
        loader.start()
        time.sleep(3.0)
        t_fault = inject()
        loader.join(300)
    around = [d for d in probe.done if d > t_fault - 5]
    gaps = [b - a for a, b in zip(around, around[1:]) if b > t_fault]
    ops = core.events(t)["operations"]
    core.down(t, stop_cluster=False)
    return {"serving_pause_s": round(max(gaps), 3) if gaps else None,
            "requests": load.get("sent"), "failed": load.get("failed"),
            "operations": [f"{o.get('kind')}:{o.get('state')}" for o in ops]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--deadline", type=float, default=4.0)
    ap.add_argument("--address", default=None)
    args = ap.parse_args()
    from eepctl import cluster, core

    started = None
    if args.address is None:
        os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-faults-"))
        started = cluster.start_local(num_cpus=16)
        args.address = started["address"]
    out: dict[str, Any] = {"deadline_s": args.deadline}
    stopped: list[int] = []
    try:
        def hang() -> float:
            pid = _pid_of(core, t, 1)
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            return time.time()

        def failed_alive() -> float:
            while not any(r["state"] == "failed" or r["rank"] == 1 and r["state"] == "fenced"
                          for r in core.status(t)["ranks"]):
                time.sleep(0.1)
            return time.time()

        def controller() -> float:
            os.kill(_controller_pid(t), signal.SIGKILL)
            return time.time()

        for name, faults, inject in (("hang", [], hang), ("failed_alive", ["fail:step@1"], failed_alive),
                                     ("controller", [], controller)):
            t = core.Target(address=args.address, name=f"bench-{name.replace('_', '-')}")
            out[name] = _scenario(core, t, args.rate, args.deadline, faults, inject)
        t = core.Target(address=args.address, name="bench-cold")
        core.up(t, dp=3, max_dp=4, engine=ENGINE, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300)
        t0 = time.time()
        core.down(t, stop_cluster=False)
        core.up(t, dp=3, max_dp=4, engine=ENGINE, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300)
        core.generate(t, [PROBE], 1, 120)
        out["down_up_s"] = round(time.time() - t0, 3)
        core.down(t, stop_cluster=False)
    finally:
        for pid in stopped:  # the process this run stopped, if it is still there
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        if started is not None:
            cluster.stop_process_group(int(started["pgid"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
