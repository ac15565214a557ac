"""Live scaling across two Ray nodes (a veth link) against the same on one node.

Builds the two-node cluster of tests/multinode.py (root: the head on 10.213.0.1; a network
namespace: the second node on 10.213.0.2; needs root), then for each placement runs DP 1->2->4->2
under open-loop load: `pack` keeps every rank on one node, `spread` puts them on both, so weight
transfers to joiners on the other node cross the veth link (1->2 always does under spread). Prints a markdown report: wall time, serving pause,
weight-transfer bytes and throughput per joiner (with whether it crossed nodes), load outcomes.

Usage (as root): .venv/bin/python benchmarks/multinode.py [--rate R] [--hidden H]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-bench-mn-"))

from eepctl import core  # noqa: E402
from tests import multinode  # noqa: E402
from benchmarks.transition import load_during  # noqa: E402


def transfers(t: core.Target, op_id: str, node_of: dict[int, str]) -> list[dict[str, Any]]:
    """One row per joiner that received weights: bytes, seconds, MB/s, and whether it crossed nodes."""
    rows = []
    for e in core.events(t, op_id)["events"]:
        d = e.get("detail") or {}
        if e["phase"] == "transfer" and e["rank"] >= 0 and "received_from" in d:
            src, dst = int(d["received_from"]), int(e["rank"])
            secs = max(e["end"] - e["start"], 1e-9)
            rows.append({"pair": f"{src}->{dst}", "bytes": int(d.get("bytes", 0)), "s": secs,
                         "mbps": d.get("bytes", 0) / secs / 1e6, "cross": node_of.get(src) != node_of.get(dst)})
    return rows


def run_policy(policy: str, engine: dict[str, Any], rate: float) -> list[dict[str, Any]]:
    t = core.Target(name=f"bench-{policy}")
    out = []
    core.up(t, dp=1, max_dp=4, engine=engine, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300,
            placement={"policy": policy, "ifname": ""})
    try:
        for target in (2, 4, 2):
            res: dict[str, Any] = {}
            th = load_during(t, rate, 12.0, res)
            time.sleep(2.0)
            t1 = time.time()
            op = core.scale(t, target, drain_timeout_s=30, timeout_s=300, wait=True)
            wall = time.time() - t1
            th.join()
            snap = core.status(t)
            node_of = {r["rank"]: r["node_ip"] for r in snap["ranks"]}
            out.append({"policy": policy, "op": f"{op['from_size']}->{op['to_size']}", "state": op["state"],
                        "wall": wall, "pause": op["serving_pause_s"], "nodes": sorted(set(node_of.values())),
                        "transfers": transfers(t, op["op_id"], node_of) if op["to_size"] > op["from_size"] else [],
                        "load": res})
    finally:
        core.down(t, stop_cluster=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    engine = {"hidden_size": args.hidden}
    cl = multinode.start(num_cpus=6)
    os.environ["RAY_ADDRESS"] = cl.address
    rows: list[dict[str, Any]] = []
    try:
        for policy in ("pack", "spread"):
            rows += run_policy(policy, engine, args.rate)
    finally:
        cl.stop()
    print(f"hidden {args.hidden}, load {args.rate} req/s\n")
    print("| placement | op | state | wall s | serving pause s | nodes used | sent/completed/failed | p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ld = r["load"]
        print(f"| {r['policy']} | {r['op']} | {r['state']} | {r['wall']:.2f} | {r['pause']:.3f} | "
              f"{len(r['nodes'])} | {ld.get('sent')}/{ld.get('completed')}/{ld.get('failed')} | "
              f"{(ld.get('latency_s') or {}).get('p99', 0) * 1000:.0f} |")
    print("\n| placement | transfer | crosses nodes | bytes | s | MB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for x in r["transfers"]:
            print(f"| {r['policy']} | {x['pair']} | {'yes' if x['cross'] else 'no'} | {x['bytes']} | "
                  f"{x['s']:.4f} | {x['mbps']:.1f} |")


if __name__ == "__main__":
    main()
