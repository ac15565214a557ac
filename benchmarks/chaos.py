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
serving again (p50/max), failed requests, wrong outputs; the exit status is 1 when a request
failed or an output was not the oracle's (a round that does not serve again within the bound
raises). ``--takeovers`` runs engine_ext.fault_schedule.TAKEOVERS first. The schedule is
engine_ext.fault_schedule's, the runner tests/chaos.py's (the chaos test runs both too).

Usage: .venv/bin/python benchmarks/chaos.py [--rounds 12] [--seed S] [--rate 2] [--address HOST:PORT]
Without --address it starts a local Ray head (own process group, own state dir) and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine_ext.fault_schedule import TAKEOVERS, schedule  # noqa: E402
from tests.chaos import DEADLINE_S, ENGINE, MAX_DP, PROMPTS, START_DP, Chaos  # noqa: E402


def figures(records: list[dict[str, Any]], ops: list[dict[str, Any]], load: dict[str, Any]) -> dict[str, Any]:
    times = sorted(r["serving_s"] for r in records)
    return {
        "rounds": len(records),
        "recoveries": sum(1 for o in ops if o.get("kind") in ("recover", "rebuild") and o.get("state") == "succeeded"),
        "failed_operations": sum(1 for o in ops if o.get("state") not in ("succeeded", "running")),
        "time_to_serving_s": {
            "p50": round(statistics.median(times), 2) if times else None,
            "max": round(times[-1], 2) if times else None,
        },
        "requests": load.get("sent"),
        "failed_requests": load.get("failed"),
    }


def verdict(out: dict[str, Any]) -> tuple[int, str]:
    """The run's exit status (1 when a request failed or an output was not the oracle's) and why."""
    failed, wrong = int(out.get("failed_requests") or 0), int(out.get("wrong_outputs") or 0)
    if failed or wrong:
        return 1, f"{failed} request(s) failed, {wrong} output(s) unlike the oracle's"
    return 0, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    ap.add_argument("--takeovers", action="store_true", help="run the take-over schedule (TAKEOVERS) first")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--bound", type=float, default=150.0, help="seconds a round may take to serve again")
    ap.add_argument("--address", default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**6)
    first = TAKEOVERS[-1].target if args.takeovers else START_DP
    rounds = (TAKEOVERS if args.takeovers else []) + schedule(seed, args.rounds, first, MAX_DP)
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
        core.up(
            t,
            dp=START_DP,
            max_dp=MAX_DP,
            engine=ENGINE,
            cpus_per_rank=1.0,
            gpus_per_rank=0.0,
            timeout_s=300,
            health_deadline_s=DEADLINE_S,
        )
        submit_ctx = core.requests(t, 8, 3600, note=lambda s: print(s, flush=True))
        from eepctl import loadgen

        with submit_ctx as submit:
            loader = threading.Thread(
                target=lambda: load.update(loadgen.open_loop(submit, PROMPTS, args.rate, 24 * 3600, 3600, seed, stop))
            )
            loader.start()
            try:
                for i, rnd in enumerate(rounds):
                    records.append(chaos.run_round(i, rnd))
            finally:
                stop.set()
                loader.join(600)
        wrong = [
            r for r in load.get("records", []) if not r["error"] and r["output"] != oracle(PROMPTS[r["prompt_index"]])
        ]
        out = {
            "seed": seed,
            **figures(records, core.events(t)["operations"], load),
            "wrong_outputs": len(wrong),
            "per_round": records,
        }
        print(json.dumps(out), flush=True)
        code, why = verdict(out)
        if why:
            print(f"chaos: {why}", file=sys.stderr, flush=True)
        return code
    finally:
        chaos.close()
        try:
            core.down(t, stop_cluster=False)
        except Exception:  # noqa: BLE001 - the cluster goes next anyway
            pass
        if started is not None:
            cluster.stop_process_group(int(started["pgid"]))


if __name__ == "__main__":
    sys.exit(main())
