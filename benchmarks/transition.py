"""Per-transition breakdown of live scaling on a real local Ray cluster, against a cold restart.

Starts its own local Ray head (and stops it), brings up a reference deployment at DP=2,
measures steady-state load, then 2->4 and 4->2 under the same load, then a cold restart to
DP=4 (`down` + `up --dp 4`, timed as one span) for the elastic / cold ratio, then 2->4 under
the same load with a standby pool of 2 (`up --standby 2`) and with the pool and
`--capture-policy reuse`. Prints a markdown report.

Usage: .venv/bin/python benchmarks/transition.py [--rate R] [--steady S]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from typing import Any

os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-bench-"))

from eepctl import cluster, core  # noqa: E402

PHASES = ("launch", "prepare", "transfer", "drain", "commit", "reshuffle", "warm", "capture", "cleanup")


def load_during(t: core.Target, rate: float, seconds: float, result: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        result.update(core.load(t, core.DEFAULT_PROMPTS, 8, rate, seconds, timeout_s=seconds + 120))

    th = threading.Thread(target=run)
    th.start()
    return th


def op_row(t: core.Target, op: dict[str, Any], wall: float) -> dict[str, Any]:
    merged = core.events(t, op["op_id"])["operations"][-1]
    return {
        "op": f"{op['from_size']}->{op['to_size']}",
        "wall": wall,
        "pause": op["serving_pause_s"],
        **{p: merged["phase_durations"].get(p) for p in PHASES},
        "ws_before": max(op["workspace_before"].values()),
        "ws_after": max(op["workspace_after"].values()),
    }


def pool_case(t: core.Target, rate: float, policy: str) -> dict[str, Any]:
    """2->4 under load on a fresh deployment with two standby ranks, under ``policy``."""
    core.up(
        t,
        dp=2,
        max_dp=4,
        engine={"capture_policy": policy},
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        standby=2,
    )
    deadline = time.time() + 120
    while time.time() < deadline and core.status(t)["summary"].get("standby", 0) < 2:
        time.sleep(0.5)
    res: dict[str, Any] = {}
    th = load_during(t, rate, 12.0, res)
    time.sleep(2.0)
    t1 = time.time()
    op = core.scale(t, 4, drain_timeout_s=10.0, timeout_s=300.0, wait=True)
    row = op_row(t, op, time.time() - t1)
    row["op"] = f"2->4 standby, {policy}"
    row["captures"] = op.get("captures_per_rank", {})
    th.join()
    core.down(t, stop_cluster=False)
    return {**row, "load": res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--steady", type=float, default=20.0)
    args = ap.parse_args()
    head = cluster.start_local(num_cpus=16)
    os.environ["RAY_ADDRESS"] = head["address"]
    t = core.Target(name="bench")
    rows, loads = [], {}
    try:
        t0 = time.time()
        core.up(t, dp=2, max_dp=4, engine={}, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300)
        up2 = time.time() - t0
        loads["steady (DP 2)"] = core.load(t, core.DEFAULT_PROMPTS, 8, args.rate, args.steady, timeout_s=300)
        for target in (4, 2):
            res: dict[str, Any] = {}
            th = load_during(t, args.rate, 12.0, res)
            time.sleep(2.0)
            t1 = time.time()
            op = core.scale(t, target, drain_timeout_s=10.0, timeout_s=300.0, wait=True)
            rows.append(op_row(t, op, time.time() - t1))
            th.join()
            loads[f"during {rows[-1]['op']}"] = res
        t2 = time.time()  # the honest baseline: down and up again, one span
        core.down(t, stop_cluster=False)
        core.up(t, dp=4, max_dp=4, engine={}, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300)
        cold4 = time.time() - t2
        core.down(t, stop_cluster=False)
        for policy in ("recapture", "reuse"):
            row = pool_case(t, args.rate, policy)
            loads[f"during {row['op']}"] = row.pop("load")
            rows.append(row)
    finally:
        cluster.stop_process_group(int(head["pgid"]))

    print(f"cold up to DP 2: {up2:.2f}s; cold restart to DP 4 (down + up until serving): {cold4:.2f}s\n")
    print("| transition | wall s | serving pause s | " + " | ".join(PHASES) + " | workspace before -> after |")
    print("|" + "---|" * (4 + len(PHASES)))
    for r in rows:
        cells = " | ".join("-" if r[p] is None else f"{r[p]:.3f}" for p in PHASES)
        print(f"| {r['op']} | {r['wall']:.2f} | {r['pause']:.3f} | {cells} | {r['ws_before']} B -> {r['ws_after']} B |")
    for r in (rows[0], *rows[2:]):
        print(
            f"\n{r['op']} ÷ cold restart to 4: {r['wall']:.2f}s / {cold4:.2f}s = {r['wall'] / cold4:.2f}"
            + (f"; captures per rank {r['captures']}" if "captures" in r else "")
        )
    print("\n| load window | sent | completed | failed | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|---|")
    for label, window in loads.items():
        lat = window["latency_s"]
        ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
        print(
            f"| {label} | {window['sent']} | {window['completed']} | {window['failed']} | "
            f"{ms(lat['p50'])} | {ms(lat['p90'])} | "
            f"{ms(lat['p99'])} | {ms(lat['max'])} |"
        )


if __name__ == "__main__":
    main()
