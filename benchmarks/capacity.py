"""Capacity against width (issue 32): does a wider deployment serve more?

  profile  where one decode step's time goes at each DP: W processes run the reference model's
           forward plan directly (no scheduler, no router), each step of the plan timed: the
           step header all-reduce, the per-layer dispatch and combine (the routed all-to-alls,
           engine_ext/model/routed.py), and the compute between them. Medians over ``--steps`` steps; then
           500 header all-reduces back to back (the transport's own latency, no compute between).
  closed   ``--clients`` closed-loop clients (``--tokens`` output tokens each) against a
           ``LocalDeployment`` for ``--seconds``: tok/s (the tokens the answers carried; a request
           answered with an error is a failure, counted, and adds none), request p50/p99
  open     open-loop arrivals (Poisson, ``--rate`` requests/s) for ``--seconds``: the same figures
  step     one decode step of the idle deployment: (time of 1 + k tokens - time of 1 token) / k
  ingress  a Ray deployment (`eepctl up --ingress N`) for each of ``--ingress`` at the largest
           ``--dp``: closed-loop tok/s through the ingresses' HTTP endpoint and through Ray actor
           calls to them, the requests each answered, the ingress CPU per token
           (benchmarks/capacity_ingress.py); ``closed`` is the direct path beside it

Every load point also runs with one client (``light``): the light-load request p50.
``--transport`` picks the per-step collectives' transport (engine config ``transport``):
``gloo`` (TCP), ``shm`` (shared memory among the ranks of one host; gloo across hosts) or ``auto``.

Usage: PYTHONPATH=. python benchmarks/capacity.py [--dp 1,2,4] [--device cpu|cuda]
       [--transport gloo,auto] [--parts profile,closed,open,step,ingress] [--ingress 1,2] [--out docs/results]
       [--address HOST:PORT]
A bigger host: ``--big`` (DP 1,2,4,8, 64 clients, 1, 2 and 4 ingresses, 30 s a run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

from benchmarks.curves import decode_step_s

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- profile: the forward plan, step by step ----------------------------------------------------
def _profile_rank(
    rank: int, world: int, port: int, tokens: int, steps: int, device: str, transport: str, q: Any
) -> None:
    import torch

    torch.set_num_threads(1)  # as a rank runs (EEP_TORCH_THREADS)
    from engine_ext.config import EngineConfig
    from engine_ext.elastic.comm import StatelessGroup
    from engine_ext.elastic.eplb import build_layout
    from engine_ext.elastic.rendezvous import Rendezvous
    from engine_ext.elastic.workspace import WorkspaceManager
    from engine_ext.model.model import Batch, MoEModel

    cfg = EngineConfig(transport=transport)
    dev = torch.device(device if device == "cpu" else f"{device}:0")
    layout = build_layout(cfg.num_experts, cfg.slots_per_rank, world)
    model = MoEModel(cfg, layout, rank, dev, cfg.seed)
    group = (
        StatelessGroup(
            Rendezvous("127.0.0.1", port, "prof"),
            rank,
            world,
            device=dev,
            transport=transport,
            shm_bytes=model.exchange_bound(world),
        )
        if world > 1
        else None
    )
    ws = WorkspaceManager(dev)
    T = tokens
    batch = Batch(
        torch.randint(0, cfg.vocab_size, (T,), device=dev),
        torch.arange(T, device=dev) % 8,
        torch.full((T,), model.null_slot, dtype=torch.int64, device=dev),
        torch.ones(T, dtype=torch.bool, device=dev),
    )
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"header": [], "dispatch": [], "combine": [], "compute": [], "step": []}
    for i in range(steps + 5):
        plan, _ = model.plan(batch, group, ws, record_load=False)
        t_step = time.perf_counter()
        row = {"header": 0.0, "dispatch": 0.0, "combine": 0.0, "compute": 0.0}
        t0 = time.perf_counter()
        if group is not None:
            group.all_reduce_max(torch.zeros(5, dtype=torch.int64))
        row["header"] += time.perf_counter() - t0
        comm_i = 0
        for kind, fn in plan:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t0
            if kind == "comm":
                row["dispatch" if comm_i % 2 == 0 else "combine"] += dt
                comm_i += 1
            else:
                row["compute"] += dt
        row["step"] = time.perf_counter() - t_step
        if i >= 5:
            for k, v in row.items():
                times[k].append(v)
    lat: list[float] = []  # one header all-reduce after another: the transport's own latency
    if group is not None:
        for _ in range(500):
            t0 = time.perf_counter()
            group.all_reduce_max(torch.zeros(5, dtype=torch.int64))
            lat.append(time.perf_counter() - t0)
        kind = group.transport_kind
        group.destroy()
    else:
        kind = "-"
    if rank == 0:
        q.put(
            {
                "dp": world,
                "tokens_per_rank": T,
                "transport": kind,
                "allreduce_us": statistics.median(lat) * 1e6 if lat else 0.0,
                **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
            }
        )


def profile(dps: list[int], tokens: int, steps: int, device: str, transport: str) -> list[dict[str, Any]]:
    import multiprocessing as mp

    from engine_ext.elastic.stores import host_store

    ctx = mp.get_context("spawn")
    rows = []
    for w in dps:
        store = host_store("127.0.0.1")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_profile_rank, args=(r, w, store.port, tokens, steps, device, transport, q))
            for r in range(w)
        ]
        for p in procs:
            p.start()
        rows.append(q.get(timeout=300))
        for p in procs:
            p.join(60)
        del store
    return rows


# ---- load against a deployment --------------------------------------------------------------------
class Served:
    """What a run served: the tokens its answers carried and their latency; an answer with an
    error (the router's ``error``: no rank took it, the input was refused) or a raised call is a
    failure and adds no tokens."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.tokens = 0
        self.failed = 0

    async def send(self, dep: Any, tokens: int) -> None:
        t0 = time.perf_counter()
        try:
            res = await dep.generate(PROMPT, tokens)
        except Exception:  # noqa: BLE001 - a failed request is a figure
            self.failed += 1
            return
        if res.get("error"):
            self.failed += 1
            return
        self.lat.append(time.perf_counter() - t0)
        self.tokens += len(res.get("output") or [])

    def figures(self, wall: float) -> dict[str, Any]:
        return {
            "requests": len(self.lat),
            "failed": self.failed,
            "tokens": self.tokens,
            "tok_s": self.tokens / wall,
            "p50_ms": (_pct(self.lat, 0.5) or 0) * 1e3,
            "p99_ms": (_pct(self.lat, 0.99) or 0) * 1e3,
        }


async def _closed(dep: Any, clients: int, tokens: int, seconds: float) -> dict[str, Any]:
    served = Served()
    stop = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < stop:
            await served.send(dep, tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {"clients": clients, **served.figures(time.perf_counter() - t0)}


async def _open(dep: Any, rate: float, tokens: int, seconds: float, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    served = Served()
    tasks = []
    t0 = time.perf_counter()
    nxt = t0
    while nxt < t0 + seconds:
        await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
        tasks.append(asyncio.ensure_future(served.send(dep, tokens)))
        nxt += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return {"rate": rate, **served.figures(time.perf_counter() - t0)}


async def load_point(dp: int, a: argparse.Namespace, transport: str) -> dict[str, Any]:
    from engine_ext.config import EngineConfig
    from engine_ext.launcher import LocalDeployment

    cfg = EngineConfig(transport=transport)
    dep = LocalDeployment(cfg, f"cap{dp}{transport}", max_dp=max(dp, 2), device=a.device)
    row: dict[str, Any] = {"dp": dp, "transport": transport}
    try:
        await dep.start(dp)
        await _closed(dep, 2, a.tokens, 1.0)  # warm: first requests, first replays
        row["transport_seen"] = sorted({v.get("transport", "") for v in dep.registry.rank_views()})
        if "step" in a.parts:
            row["step_ms"] = await decode_step_s(dep, reps=5, prompt=PROMPT) * 1e3
        if "closed" in a.parts:
            row["light"] = await _closed(dep, 1, a.tokens, a.seconds)
            row["closed"] = await _closed(dep, a.clients, a.tokens, a.seconds)
        if "open" in a.parts:
            row["open"] = await _open(dep, a.rate, a.tokens, a.seconds)
    finally:
        await dep.stop()
    return row


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


async def main(a: argparse.Namespace) -> dict[str, Any]:
    dps = [int(x) for x in a.dp.split(",")]
    transports = a.transport.split(",")
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "device": a.device,
        "args": vars(a),
    }
    if "profile" in a.parts:
        res["profile"] = []
        print(
            "| transport | DP | tokens/rank | step ms | header ms | dispatch ms | combine ms | compute ms "
            "| all-reduce us |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for tr in transports:
            for r in profile(dps, a.profile_tokens, a.steps, a.device, tr):
                r["requested"] = tr
                res["profile"].append(r)
                print(
                    f"| {r['transport']} ({tr}) | {r['dp']} | {r['tokens_per_rank']} | {r['step_ms']:.2f} | "
                    f"{r['header_ms']:.2f} | {r['dispatch_ms']:.2f} | {r['combine_ms']:.2f} | "
                    f"{r['compute_ms']:.2f} | {r['allreduce_us']:.0f} |",
                    flush=True,
                )
    if {"closed", "open", "step"} & set(a.parts):
        res["load"] = []
        for tr in transports:
            for dp in dps:
                res["load"].append(await load_point(dp, a, tr))
                print(json.dumps(res["load"][-1]), flush=True)
        print(
            f"\n| transport | DP | closed {a.clients} clients tok/s | p50 ms | p99 ms | light (1 client) p50 ms "
            f"| open {a.rate}/s tok/s | p50 ms | p99 ms | decode step ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in res["load"]:
            c, lt, o = r.get("closed", {}), r.get("light", {}), r.get("open", {})
            print(
                f"| {r['transport']} | {r['dp']} | {_f(c.get('tok_s'), 0)} | {_f(c.get('p50_ms'))} | "
                f"{_f(c.get('p99_ms'))} | {_f(lt.get('p50_ms'))} | {_f(o.get('tok_s'), 0)} | {_f(o.get('p50_ms'))} | "
                f"{_f(o.get('p99_ms'))} | {_f(r.get('step_ms'), 2)} |",
                flush=True,
            )
        for r in res["load"]:
            failed = {k: r[k]["failed"] for k in ("light", "closed", "open") if r.get(k, {}).get("failed")}
            if failed:
                print(f"({r['transport']} DP {r['dp']}: failed requests {failed}; tok/s counts served tokens only)")
    if "ingress" in a.parts:
        from benchmarks.capacity_ingress import ingress_point, print_table

        res["ingress"] = []
        for n in [int(x) for x in a.ingress.split(",")]:
            res["ingress"].append(ingress_point(max(dps), n, a, transports[0]))
            print(json.dumps(res["ingress"][-1]), flush=True)
        print_table(res["ingress"], a.clients)
    res["loadavg_end"] = os.getloadavg()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"capacity_{a.device}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"(wrote {path}; load average {res['loadavg_start']} -> {res['loadavg_end']})")
    return res


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", default="1,2,4", help="comma-separated DP sizes")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--transport", default="auto", help="comma-separated: gloo, shm, auto")
    p.add_argument("--parts", default="profile,closed,open,step")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=20.0, help="open-loop requests/s")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--steps", type=int, default=200, help="profile: steps per DP")
    p.add_argument("--profile-tokens", type=int, default=8, help="profile: decode tokens per rank")
    p.add_argument("--out", default="", help="folder for capacity_<device>.json")
    p.add_argument("--ingress", default="1,2", help="ingress part: comma-separated ingress counts")
    p.add_argument("--address", default="", help="ingress part: a Ray cluster (default: RAY_ADDRESS, or a local one)")
    p.add_argument("--big", action="store_true", help="a bigger host: DP 1,2,4,8, 64 clients, ingresses 1,2,4, 30 s")
    a = p.parse_args()
    if a.big:
        a.dp, a.clients, a.ingress, a.seconds = "1,2,4,8", 64, "1,2,4", 30.0
    a.parts = a.parts.split(",")
    return a


if __name__ == "__main__":
    asyncio.run(main(parse()))
