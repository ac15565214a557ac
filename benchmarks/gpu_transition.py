"""The GPU path, measured: DP ranks as processes sharing one GPU, CUDA graphs, 2 -> 4 -> 2 under load.

Runs the same RankEngine / Orchestrator as the Ray path, through the process launcher (no Ray
needed). Collectives: gloo with device tensors for all-reduce/all-gather (NCCL refuses two
ranks on one device) and host-staged point-to-point transfers (gloo send/recv of CUDA tensors
fails). Decode steps are captured piecewise: each run of compute between two collectives is
one CUDA graph; the gloo collectives run eagerly between graph replays.

Variants, in one run:
  normal          the protocol as implemented (release -> resize -> warm -> capture once -> lock)
  skip_release    graphs are not released before the workspace grows: the replay check must
                  refuse every stale replay (and the step is served eagerly), no crash
  double_capture  upstream before its fix: two capture passes per transition (for the ratio)

Usage: PYTHONPATH=. python3 benchmarks/gpu_transition.py [--out DIR] [--dtype float64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate

PROMPTS = [
    [1, 2, 3, 4, 5],
    [17, 42, 99, 7],
    [200, 13, 13, 8, 250, 3, 61],
    [5, 6, 7, 8, 9, 10, 11, 12],
    [128],
    [77, 78, 79],
    [9] * 12,
    [31, 41, 59, 26, 53],
]
MAX_TOKENS = 12


async def client(dep: LocalDeployment, stop: asyncio.Event, seed: int, records: list[dict[str, Any]]) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        i = rng.randrange(len(PROMPTS))
        t0 = time.perf_counter()
        res = await dep.generate(PROMPTS[i], MAX_TOKENS)
        records.append(
            {
                "prompt": i,
                "output": res.get("output"),
                "error": res.get("error"),
                "latency_s": time.perf_counter() - t0,
                "t": time.time(),
            }
        )


def summarize_op(dep: LocalDeployment, op: dict[str, Any]) -> dict[str, Any]:
    reg = dep.registry
    evs = reg.events_for(op["op_id"])
    merged = reg.operations(op["op_id"])[-1]
    capture = {}
    warm = {}
    counted_passes = {}
    passes: dict[int, int] = {}
    for e in evs:
        if e["phase"] == "capture":
            passes[e["rank"]] = passes.get(e["rank"], 0) + 1
            capture.setdefault(str(e["rank"]), []).append(e["detail"].get("per_size_s"))
        if e["phase"] == "warm":
            warm[str(e["rank"])] = round(e["end"] - e["start"], 4)
        if e["phase"] == "lock":
            counted_passes[str(e["rank"])] = e["detail"].get("capture_passes")
    return {
        "op": f"{op['from_size']}->{op['to_size']}",
        "state": op["state"],
        "error": op.get("error"),
        "serving_pause_s": op["serving_pause_s"],
        "phase_durations": merged["phase_durations"],
        "captures_per_rank": op["captures_per_rank"],
        "capture_passes_seen": passes,
        "capture_per_size_s": capture,
        "warm_s": warm,
        "capture_passes_counted": counted_passes,
        "workspace_before": op["workspace_before"],
        "workspace_after": op["workspace_after"],
    }


async def run_variant(
    name: str, faults: list[str], dtype: str, ref: dict[int, list[int]], device: str
) -> dict[str, Any]:
    cfg = EngineConfig(
        dtype=dtype, slots_per_rank=8, capture_sizes=[1, 2, 4, 8], faults=faults, capture_policy="recapture"
    )
    out: dict[str, Any] = {"variant": name, "faults": faults, "dtype": dtype}
    async with LocalDeployment(cfg, f"gpu-{name.replace('_', '-')}", device=device, max_dp=4) as dep:
        t0 = time.time()
        await dep.start(2)
        out["start_s"] = round(time.time() - t0, 3)
        stop = asyncio.Event()
        records: list[dict[str, Any]] = []
        steady_stop = asyncio.Event()
        steady: list[dict[str, Any]] = []
        tasks = [asyncio.ensure_future(client(dep, steady_stop, 100 + i, steady)) for i in range(4)]
        await asyncio.sleep(5.0)
        steady_stop.set()
        await asyncio.gather(*tasks)
        tasks = [asyncio.ensure_future(client(dep, stop, i, records)) for i in range(4)]
        await asyncio.sleep(2.0)
        ops = []
        for target in (4, 2):
            op = await dep.scale(target, drain_timeout_s=5.0, timeout_s=300.0)
            ops.append(summarize_op(dep, op))
            await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*tasks)
        views = dep.registry.rank_views()
        out["ops"] = ops
        out["violations"] = dep.registry.violations()
        out["stale_replays_refused"] = {str(v["rank"]): v.get("stale_replays_refused", 0) for v in views}
        out["graph_kind"] = sorted({v.get("graph_kind") for v in views})
        out["graph_replays"] = {str(v["rank"]): v.get("graph_replays", 0) for v in views}
        out["device_workspace_bytes"] = {str(v["rank"]): v["workspace_bytes"] for v in views}
    for label, recs in (("steady", steady), ("during_transitions", records)):
        ok = [r for r in recs if not r["error"]]
        wrong = [r for r in ok if r["output"] != ref[r["prompt"]]]
        lat = sorted(r["latency_s"] for r in ok)
        out[label] = {
            "requests": len(recs),
            "failed": len(recs) - len(ok),
            "wrong_outputs": len(wrong),
            "p50_ms": round(1000 * statistics.median(lat), 2) if lat else None,
            "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
            "max_ms": round(1000 * lat[-1], 2) if lat else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--variants", default="normal,skip_release,double_capture")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu to check the script")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"device: {device_name}, torch {torch.__version__}", flush=True)
    cfg = EngineConfig(dtype=args.dtype, slots_per_rank=8)
    ref = {i: r["output"] for i, r in enumerate(reference_generate(cfg, PROMPTS, MAX_TOKENS))}
    faults = {"normal": [], "skip_release": ["skip_release"], "double_capture": ["double_capture"]}
    results = []
    for name in args.variants.split(","):
        t0 = time.time()
        res = asyncio.run(run_variant(name, faults[name], args.dtype, ref, args.device))
        res["wall_s"] = round(time.time() - t0, 2)
        results.append(res)
        print(json.dumps(res, indent=1, default=str), flush=True)
    with open(os.path.join(args.out, f"gpu_transition{args.tag}.json"), "w") as f:
        json.dump({"device": device_name, "torch": torch.__version__, "results": results}, f, indent=1, default=str)
    print(
        "\nvariant        op    state      pause_ms  commit_s  warm_s(max) capture_s(max) passes  "
        "stale_refused  wrong/failed"
    )
    for r in results:
        for op in r["ops"]:
            pd = op["phase_durations"]
            passes = max(op["capture_passes_seen"].values(), default=0)
            print(
                f"{r['variant']:<14} {op['op']:<5} {op['state']:<10} {op['serving_pause_s'] * 1000:8.1f} "
                f"{pd.get('commit', 0):8.3f}  {pd.get('warm', 0):10.3f}  {pd.get('capture', 0):12.3f}  {passes:5d} "
                f"{sum(r['stale_replays_refused'].values()):13d}  "
                f"{r['during_transitions']['wrong_outputs']}/{r['during_transitions']['failed']}"
            )


if __name__ == "__main__":
    main()
