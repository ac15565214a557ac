"""Fast scale-up and self-healing on the GPU path, in one run (process launcher, no Ray).

Cases, each from a fresh DP-2 deployment under closed-loop load (4 clients):
  cold              stop + start at DP 4, timed as one span
  elastic           2->4, joiners launched by the operation
  standby           2->4 with a standby pool of 2 (joiners adopted, launch ~0)
  standby+reuse     as standby, with capture_policy=reuse (captures sized for max DP at start)
  kill              DP 3, policy shrink: SIGKILL of rank 1 by its pid while it serves
Per case: wall time, launch, serving pause, capture passes per rank, the MoE workspace each rank
holds, the device memory in use on the GPU (all processes, from cudaMemGetInfo), requests failed,
and every output against the dense float64 oracle.

Usage: PYTHONPATH=. python3 benchmarks/gpu_elastic.py [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from typing import Any

from benchmarks.gpu_transition import MAX_TOKENS, PROMPTS
from benchmarks.gpu_transition import client as _client
from engine_ext.config import EngineConfig
from engine_ext.launcher import LocalDeployment
from engine_ext.model.dense_oracle import reference_generate

CLIENTS = 4


def _device_used_bytes(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _workspace(dep: LocalDeployment) -> dict[str, int]:
    return {str(r): int(s.workspace_bytes) for r, s in sorted(dep.registry.ranks.items()) if r in dep.orch.members}


async def _case(name: str, cfg: EngineConfig, device: str, reference: list[dict]) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    stop = asyncio.Event()
    standby = 2 if name.startswith("standby") else 0
    start_dp = 3 if name == "kill" else 2
    dep = LocalDeployment(
        cfg, f"gpu{name.replace('+', '')}", max_dp=4, device=device, standby=standby, on_rank_failure="shrink"
    )
    await dep.start(start_dp)
    if dep.pool is not None:
        while len(dep.pool.ready) < standby:
            await asyncio.sleep(0.2)
    mem_before, ws_before = _device_used_bytes(device), _workspace(dep)
    clients = [asyncio.ensure_future(_client(dep, stop, s, records)) for s in range(CLIENTS)]
    await asyncio.sleep(3.0)
    t0 = time.perf_counter()
    op: dict[str, Any] = {}
    first_after_kill = None
    if name == "cold":
        stop.set()
        await asyncio.gather(*clients)
        await dep.stop()
        dep = LocalDeployment(cfg, "gpucold4", max_dp=4, device=device)
        await dep.start(4)
        wall = time.perf_counter() - t0
    elif name == "kill":
        killed_at = time.time()
        os.kill(dep.processes[1].pid(), signal.SIGKILL)  # this benchmark's own rank process
        await asyncio.sleep(0.1)
        await dep.orch.recovery.wait()
        wall = time.perf_counter() - t0
        op = next((o for o in reversed(dep.orch.history) if o.get("kind") == "recover"), {})
        await asyncio.sleep(2.0)
        done = sorted(r["t"] for r in records if r["t"] > killed_at and not r["error"])
        first_after_kill = done[0] - killed_at if done else None
    else:
        op = await dep.scale(4, timeout_s=300)
        wall = time.perf_counter() - t0
        await asyncio.sleep(2.0)
    stop.set()
    await asyncio.gather(*clients)
    mem_after, ws_after = _device_used_bytes(device), _workspace(dep)
    transports = sorted({str(s.transport) for r, s in dep.registry.ranks.items() if r in dep.orch.members})
    finals = list(await asyncio.gather(*(dep.generate(p, MAX_TOKENS) for p in PROMPTS)))
    await dep.stop()
    want = {tuple(r["prompt"]): r["output"] for r in reference}
    served = [r for r in records if not r["error"]] + [dict(f, prompt=PROMPTS.index(f["prompt"])) for f in finals]
    wrong = sum(1 for r in served if r["output"] != want[tuple(PROMPTS[r["prompt"]])])
    pd = op.get("phase_durations", {})
    return {
        "case": name,
        "state": op.get("state", "-"),
        "wall_s": round(wall, 3),
        "launch_s": pd.get("launch"),
        "pause_s": op.get("serving_pause_s"),
        "phases": pd,
        "captures_per_rank": op.get("captures_per_rank", {}),
        "workspace_before": ws_before,
        "workspace_after": ws_after,
        "device_used_before": mem_before,
        "device_used_after": mem_after,
        "requests": len(records),
        "failed": sum(1 for r in records if r["error"]),
        "wrong": wrong,
        "rerouted": op.get("rerouted_requests"),
        "first_completion_after_kill_s": first_after_kill,
        "transport": transports,
    }


async def main(device: str, out: str, cases: list[str]) -> None:
    base: dict[str, Any] = {"dtype": "float64", "slots_per_rank": 8, "capture_sizes": [1, 2, 4, 8]}
    reference = reference_generate(EngineConfig(**base), PROMPTS, MAX_TOKENS)
    rows = []
    for name in cases:
        cfg = EngineConfig(**base, capture_policy="reuse" if name == "standby+reuse" else "recapture")
        rows.append(await _case(name, cfg, device, reference))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(out, f"gpu_elastic_{device.replace(':', '')}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    cold = next((r["wall_s"] for r in rows if r["case"] == "cold"), None)
    print(
        "| case | wall s | x cold | launch s | pause s | captures/rank | workspace/rank B | device used MiB | "
        "failed | wrong |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        caps = ",".join(f"{k}:{v}" for k, v in sorted(r["captures_per_rank"].items())) or "-"
        ws = sorted(set(r["workspace_after"].values()))
        mib = "-" if r["device_used_after"] is None else f"{r['device_used_after'] / 2**20:.0f}"
        ratio = f"{r['wall_s'] / cold:.2f}" if cold else "-"
        print(
            f"| {r['case']} | {r['wall_s']:.2f} | {ratio} | {r['launch_s'] if r['launch_s'] is not None else '-'} | "
            f"{round(r['pause_s'], 3) if r['pause_s'] is not None else '-'} | {caps} | {ws} | {mib} | "
            f"{r['failed']} | {r['wrong']} |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="cold,elastic,standby,standby+reuse,kill")
    a = ap.parse_args()
    asyncio.run(main(a.device, a.out, a.cases.split(",")))
