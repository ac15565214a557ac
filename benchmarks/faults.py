"""Faults the control plane answers: time from the fault to serving again, and requests failed.

One run, each fault on a fresh DP-3 deployment (policy shrink, health deadline --deadline)
under open-loop load plus a back-to-back probe (one request at a time: its completions show the
serving pause):

* hang          rank 1 SIGSTOPped (fenced after the deadline, recovered around)
* failed-alive  rank 1's step raises (fault ``fail:step@1``; its process stays alive)
* controller    the controller actor SIGKILLed (Ray restarts it; it takes the ranks over)
* partition     (``--partition``, needs root: the test suite's two-node network-namespace
                cluster, tests/multinode.py) DP 2 spread over the nodes, the worker's link set down

and, in the same run, ``down`` + ``up`` + the first completion (a cold restart) for comparison.
Per fault: ``serving_again_s`` (from the fault to the first probe completion after the longest
gap), ``pause_s`` (that gap), ``recovered_s`` (to the end of the recovery operation), requests
sent and failed, and how many of the failed were sent before the fault (in flight at it).

Usage: .venv/bin/python benchmarks/faults.py [--rate 4] [--deadline 4] [--address HOST:PORT] [--partition]
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


def _scenario(
    core: Any,
    t: Any,
    rate: float,
    deadline_s: float,
    faults: list[str],
    inject: Callable[[], float],
    *,
    dp: int = 3,
    placement: str = "pack",
    cleanup: Callable[[], None] = lambda: None,
    **engine_over: Any,
) -> dict[str, Any]:
    """Up DP ``dp``, load, ``inject`` the fault (returns its time), measure, down."""
    engine = dict(ENGINE, faults=faults, fault_delay_s=FAIL_AFTER_S, step_timeout_s=deadline_s, **engine_over)
    core.up(
        t,
        dp=dp,
        max_dp=4,
        engine=engine,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        on_rank_failure="shrink",
        health_deadline_s=deadline_s,
        placement={"policy": placement, "ifname": ""},
    )
    _wait_serving(core, t, dp)
    load: dict[str, Any] = {}
    loader = threading.Thread(
        target=lambda: load.update(core.load(t, core.DEFAULT_PROMPTS, 8, rate, 30.0, timeout_s=300))
    )
    with Probe(_controller(t)) as probe:
        loader.start()
        time.sleep(3.0)
        t_fault = inject()
        try:
            loader.join(300)
            time.sleep(1.0)  # a probe completion after the load
        finally:
            cleanup()
    return _measure(core, t, t_fault, probe.done, load)


def _measure(core: Any, t: Any, t_fault: float, done: list[float], load: dict[str, Any]) -> dict[str, Any]:
    around = [t_fault] + [d for d in done if d > t_fault]
    gaps = [(b - a, b) for a, b in zip(around, around[1:])]
    pause, back = max(gaps) if gaps else (None, None)
    ops = core.events(t)["operations"]
    ended = [
        o["finished"]
        for o in ops
        if o.get("kind") in ("recover", "rebuild")
        and o.get("finished")
        and o["finished"] > t_fault
        and o.get("state") == "succeeded"
    ]
    failed = [r for r in load.get("records", []) if r.get("error")]
    core.down(t, stop_cluster=False)
    return {
        "serving_again_s": round(back - t_fault, 3) if back else None,
        "pause_s": round(pause, 3) if pause else None,
        "recovered_s": round(min(ended) - t_fault, 3) if ended else None,
        "requests": load.get("sent"),
        "failed": load.get("failed"),
        "failed_sent_before_fault": sum(1 for r in failed if r.get("sent_at", 0) < t_fault),
        "operations": [f"{o.get('kind')}:{o.get('state')}" for o in ops],
    }


def _partition(rate: float, deadline_s: float) -> dict[str, Any]:
    """The worker node of a two-node cluster cut off (its processes live) under load."""
    import ray
    from eepctl import core
    from tests import multinode

    cl = multinode.start(num_cpus=6)
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cl.address
    try:
        if ray.is_initialized():
            ray.shutdown()
        t = core.Target(address=cl.address, name="bench-partition")

        def cut() -> float:
            cl.set_link(False)
            return time.time()

        def heal() -> None:
            cl.set_link(True)

        # 8 slots per rank: the head's rank alone holds every expert (at 6, DP 1 cannot, the
        # recovery fails and the deployment waits for the link to rebuild DP 2).
        return _scenario(core, t, rate, deadline_s, [], cut, dp=2, placement="spread", cleanup=heal, slots_per_rank=8)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved
        cl.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--deadline", type=float, default=4.0)
    ap.add_argument("--address", default=None)
    ap.add_argument("--partition", action="store_true", help="also the two-node partition (root)")
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
            while not any(
                r["state"] == "failed" or r["rank"] == 1 and r["state"] == "fenced" for r in core.status(t)["ranks"]
            ):
                time.sleep(0.1)
            return time.time()

        def controller() -> float:
            os.kill(_controller_pid(t), signal.SIGKILL)
            return time.time()

        for name, faults, inject in (
            ("hang", [], hang),
            ("failed_alive", ["fail:step@1"], failed_alive),
            ("controller", [], controller),
        ):
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
        if args.partition:
            out["partition"] = _partition(args.rate, args.deadline)
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
