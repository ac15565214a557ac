"""Per-transition breakdown of live scaling on a real local Ray cluster, against a cold restart.

Starts its own local Ray head (and stops it), brings up a reference deployment at DP=2,
measures steady-state load, then 2->4 and 4->2 under the same load, then a cold restart to
DP=4 (down, up) for the elastic / cold ratio. Prints a markdown report.

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
    return {"op": f"{op['from_size']}->{op['to_size']}", "wall": wall, "pause": op["serving_pause_s"],
            **{p: merged["phase_durations"].get(p) for p in PHASES},
            "ws_before": max(op["workspace_before"].values()), "ws_after": max(op["workspace_after"].values())}


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
        core.down(t, stop_cluster=False)
        t2 = time.time()
        core.up(t, dp=4, max_dp=4, engine={}, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300)
        cold4 = time.time() - t2
        core.down(t, stop_cluster=False)
    finally:
        cluster.stop_process_group(int(head["pgid"]))

    print(f"cold up to DP 2: {up2:.2f}s; cold restart to DP 4 (up until serving): {cold4:.2f}s\n")
    print("| transition | wall s | serving pause s | " + " | ".join(PHASES) + " | workspace before -> after |")
    print("|" + "---|" * (4 + len(PHASES)))
    for r in rows:
        cells = " | ".join("-" if r[p] is None else f"{r[p]:.3f}" for p in PHASES)
        print(f"| {r['op']} | {r['wall']:.2f} | {r['pause']:.3f} | {cells} | {r['ws_before']} B -> {r['ws_after']} B |")
    up_row = rows[0]
    print(f"\nelastic 2->4 ÷ cold restart to 4: {up_row['wall']:.2f}s / {cold4:.2f}s = {up_row['wall'] / cold4:.2f}")
    print("\n| load window | sent | completed | failed | p50 ms | p90 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|---|---|---|")
    for label, l in loads.items():
        lat = l["latency_s"]
        ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
        print(f"| {label} | {l['sent']} | {l['completed']} | {l['failed']} | {ms(lat['p50'])} | {ms(lat['p90'])} | "
              f"{ms(lat['p99'])} | {ms(lat['max'])} |")


if __name__ == "__main__":
    main()
