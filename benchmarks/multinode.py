"""Live scaling across two Ray nodes (a veth link) against the same on one node.

Builds the two-node cluster of tests/multinode.py (root: the head on 10.213.0.1; a network
namespace: the second node on 10.213.0.2; needs root), then for each placement runs DP 1->2->4->2
under open-loop load: `pack` keeps every rank on one node, `spread` puts them on both, so weight
transfers to joiners on the other node cross the veth link (1->2 always does under spread). Prints a
markdown report: wall time, serving pause, weight-transfer bytes and throughput per joiner (with
whether it crossed nodes), load outcomes.

``--curve``: issue 25's two-node point of the world curve, sized as benchmarks/curves.py sizes its
model (``--expert-hidden``, default 32768 = 256 MiB of experts): the raw link across the veth (a
TCP stream and gloo storage to storage, between a process on the head and one in the worker's
namespace), then 2->4 under spread and under pack on the same cluster, with each joiner's
expert bytes (the pre-copy's and the commit's reshuffle's), exchange seconds and rate, how much of
it crossed the link, and the rate as a ratio to the raw veth stream. Writes ``--out``/multinode_curve.json.

Usage (as root): .venv/bin/python benchmarks/multinode.py [--rate R] [--hidden H]
                 .venv/bin/python benchmarks/multinode.py --curve [--expert-hidden E] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-bench-mn-"))

from benchmarks.transition import load_during  # noqa: E402
from eepctl import core  # noqa: E402
from tests import multinode  # noqa: E402


def transfers(t: core.Target, op_id: str, node_of: dict[int, str]) -> list[dict[str, Any]]:
    """One row per joiner that received weights: bytes, seconds, MB/s, and whether it crossed nodes."""
    rows = []
    for e in core.events(t, op_id)["events"]:
        d = e.get("detail") or {}
        if e["phase"] == "transfer" and e["rank"] >= 0 and "received_from" in d:
            src, dst = int(d["received_from"]), int(e["rank"])
            secs = max(e["end"] - e["start"], 1e-9)
            rows.append(
                {
                    "pair": f"{src}->{dst}",
                    "bytes": int(d.get("bytes", 0)),
                    "s": secs,
                    "mbps": d.get("bytes", 0) / secs / 1e6,
                    "cross": node_of.get(src) != node_of.get(dst),
                }
            )
    return rows


def run_policy(policy: str, engine: dict[str, Any], rate: float) -> list[dict[str, Any]]:
    t = core.Target(name=f"bench-{policy}")
    out = []
    core.up(
        t,
        dp=1,
        max_dp=4,
        engine=engine,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        placement={"policy": policy, "ifname": ""},
    )
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
            out.append(
                {
                    "policy": policy,
                    "op": f"{op['from_size']}->{op['to_size']}",
                    "state": op["state"],
                    "wall": wall,
                    "pause": op["serving_pause_s"],
                    "nodes": sorted(set(node_of.values())),
                    "transfers": transfers(t, op["op_id"], node_of) if op["to_size"] > op["from_size"] else [],
                    "load": res,
                }
            )
    finally:
        core.down(t, stop_cluster=False)
    return out


def veth_link(cl: multinode.TwoNodeCluster, sizes_mib: list[int], reps: int) -> list[dict[str, Any]]:
    """curves.py's link table across the veth: the receiver on the head, the sender in the
    worker's namespace (its own address bound for gloo)."""
    from benchmarks.curves import link_curve

    root = str(Path(__file__).resolve().parent.parent)

    def sender(port: int, sizes: list[int]) -> subprocess.Popen:
        code = (
            f"from benchmarks.curves import _link_peer; _link_peer(1, {port}, {sizes!r}, {reps}, None, 'cpu', "
            f"host={multinode.HEAD_IP!r}, node_ip={multinode.WORKER_IP!r})"
        )
        return subprocess.Popen(
            ["ip", "netns", "exec", cl.ns, sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root}
        )

    return link_curve(sizes_mib, reps, host=multinode.HEAD_IP, sender=sender)


def curve_case(policy: str, expert_hidden: int, rate: float) -> dict[str, Any]:
    """2->4 under load with curves.py's model at ``expert_hidden``: per joiner, what it received,
    in how long, and which of its experts came across the link."""
    from benchmarks.curves import BASE, expert_bytes, kv_blocks
    from engine_ext.config import EngineConfig

    engine = {**BASE, "expert_hidden": expert_hidden, "capture_sizes": []}
    engine["num_blocks"] = kv_blocks(EngineConfig(**engine), 4)
    per_expert = expert_bytes(expert_hidden) // BASE["num_experts"]
    t = core.Target(name=f"curve-{policy}")
    core.up(
        t,
        dp=2,
        max_dp=4,
        engine=engine,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        placement={"policy": policy, "ifname": ""},
    )
    try:
        res: dict[str, Any] = {}
        th = load_during(t, rate, 30.0, res)
        time.sleep(2.0)
        t1 = time.time()
        op = core.scale(t, 4, drain_timeout_s=30, timeout_s=300, wait=True)
        wall = time.time() - t1
        th.join()
        node_of = {r["rank"]: r["node_ip"] for r in core.status(t)["ranks"]}
        evs = core.events(t, op["op_id"])
        record = evs["operations"][-1]
        moves = record.get("plan", {}).get("expert_moves", [])
        # A joiner's experts move in the pre-copy (prepare) and, what did not fit its spare room, in
        # the commit's reshuffle: its bytes and exchange seconds are both phases' sums.
        got: dict[int, dict[str, float]] = {}
        for e in evs["events"]:
            d = e.get("detail") or {}
            if e["phase"] not in ("precopy", "reshuffle") or e["rank"] < 2 or "exchange_s" not in d:
                continue
            g = got.setdefault(int(e["rank"]), {"precopy": 0, "reshuffle": 0, "exchange_s": 0.0})
            g[e["phase"]] += int(d.get("bytes_received", d.get("commit_bytes_received", 0)))
            g["exchange_s"] += d["exchange_s"]
        joiners = []
        for j, g in sorted(got.items()):
            crossed = sum(
                per_expert for m in moves if m["dst_rank"] == j and node_of.get(m["src_rank"]) != node_of.get(j)
            )
            nbytes = int(g["precopy"] + g["reshuffle"])
            joiners.append(
                {
                    "rank": j,
                    "node": node_of.get(j),
                    "bytes": nbytes,
                    "precopy_bytes": int(g["precopy"]),
                    "commit_bytes": int(g["reshuffle"]),
                    "crossed_bytes": crossed,
                    "exchange_s": g["exchange_s"],
                    "GBps": nbytes / max(g["exchange_s"], 1e-9) / 1e9,
                }
            )
        return {
            "policy": policy,
            "state": op["state"],
            "wall_s": wall,
            "pause_s": op["serving_pause_s"],
            "nodes": node_of,
            "joiners": joiners,
            "moves": len(moves),
            "load": {k: res.get(k) for k in ("sent", "completed", "failed")},
        }
    finally:
        core.down(t, stop_cluster=False)


def curve(expert_hidden: int, rate: float, out: str) -> None:
    from benchmarks.curves import MIB, expert_bytes

    cl = multinode.start(num_cpus=6)
    os.environ["RAY_ADDRESS"] = cl.address
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": os.getloadavg(),
        "expert_hidden": expert_hidden,
        "expert_MiB": expert_bytes(expert_hidden) / MIB,
    }
    try:
        res["link"] = veth_link(cl, [256], reps=3)
        res["cases"] = [curve_case(p, expert_hidden, rate) for p in ("spread", "pack")]
    finally:
        cl.stop()
    res["loadavg_end"] = os.getloadavg()
    raw = res["link"][0]["raw_GBps"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "multinode_curve.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    lk = res["link"][0]
    print(
        f"veth, 256 MiB, median of 3: raw TCP {raw:.2f} GB/s, gloo storage to storage "
        f"{lk['gloo_direct_GBps']:.2f} GB/s (ratio {lk['ratio_direct']:.2f})"
    )
    print(f"\n2->4, {res['expert_MiB']:.0f} MiB of experts, load {rate} req/s")
    print(
        "| placement | state | wall s | pause s | joiner | node | received MiB | crossed the link MiB | exchange s "
        "| GB/s | / raw veth |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in res["cases"]:
        for j in c["joiners"]:
            print(
                f"| {c['policy']} | {c['state']} | {c['wall_s']:.2f} | {c['pause_s']:.3f} | {j['rank']} | {j['node']} "
                f"| {j['bytes'] / MIB:.0f} | {j['crossed_bytes'] / MIB:.0f} | {j['exchange_s']:.3f} | {j['GBps']:.2f} "
                f"| {j['GBps'] / raw:.2f} |"
            )
        print(f"  ({c['policy']}: load sent/completed/failed {c['load']})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--curve", action="store_true", help="issue 25's two-node point (see the docstring)")
    ap.add_argument("--expert-hidden", type=int, default=32768)
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args()
    if args.curve:
        curve(args.expert_hidden, args.rate, args.out)
        return
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
        print(
            f"| {r['policy']} | {r['op']} | {r['state']} | {r['wall']:.2f} | {r['pause']:.3f} | "
            f"{len(r['nodes'])} | {ld.get('sent')}/{ld.get('completed')}/{ld.get('failed')} | "
            f"{(ld.get('latency_s') or {}).get('p99', 0) * 1000:.0f} |"
        )
    print("\n| placement | transfer | crosses nodes | bytes | s | MB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for x in r["transfers"]:
            print(
                f"| {r['policy']} | {x['pair']} | {'yes' if x['cross'] else 'no'} | {x['bytes']} | "
                f"{x['s']:.4f} | {x['mbps']:.1f} |"
            )


if __name__ == "__main__":
    main()
