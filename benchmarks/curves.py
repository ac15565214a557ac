"""Cost curves, measured side by side in one run (process launcher, CPU/gloo):

  link     the weight-transfer path against the raw link between the same two endpoints (two
           processes on loopback): a plain socket stream, gloo send/recv from and into the weight
           storage (storage to storage: the reshuffle's path now), and the path it ran before
           2026-12-04 (concatenate at the sender, a fresh receive buffer, copy into the storage after)
  bytes    2->4 under a closed-loop client against total expert bytes: transition wall, serving
           pause, the joiners' weight transfer (dense + expert reshuffle) and its throughput
  world    the same against world size: 2->4, 4->8, 8->16 (ranks oversubscribed on this host)
  pause    2->4 with a standby pool of 2 and ``capture_policy=reuse``: the serving pause as a
           ratio to one decode step of the same deployment, measured in the same run

The reference model is sized by ``expert_hidden`` alone: float32, 2 layers, 8 experts, hidden
64, 4 slots per rank, so total expert bytes = 2 layers x 8 experts x 2 matrices x 64 x
expert_hidden x 4 B = 8 KiB x expert_hidden, one expert (what one move sends) 1/8 of that, and
each rank holds 4 slots = half of the experts (2 GiB of experts: 1 GiB per rank, 4 GiB at DP 4).

Writes ``curves.json``, ``curves.svg`` and ``curves.csv`` into ``--out``; prints markdown tables.
Each scale's row keeps the plan's predicted cost beside the measured one (``cost``); ``--fit`` fits
the scale cost model to the bytes part and writes ``cost_model.json`` with this host
(benchmarks/fit_cost.py; docs/operations.md, "What a scale will cost").

Usage: PYTHONPATH=. python benchmarks/curves.py [--quick] [--out docs/results]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine_ext.control.cost_model import host_identity

MIB = 2**20
BASE: dict[str, Any] = {
    "dtype": "float32",
    "num_layers": 2,
    "num_experts": 8,
    "hidden_size": 64,
    "slots_per_rank": 4,
    "max_num_tokens": 16,
    "capture_sizes": [1, 2, 4, 8],
}
PROMPT = [3, 1, 4, 1, 5]


def expert_bytes(expert_hidden: int) -> int:
    """Total expert bytes of the reference model at this ``expert_hidden`` (see the docstring)."""
    return BASE["num_layers"] * BASE["num_experts"] * 2 * BASE["hidden_size"] * expert_hidden * 4


def kv_blocks(cfg: Any, max_dp: int) -> int:
    """KV blocks such that the rank's memory budget (KV + MoE workspace, both sized at world 1:
    engine_ext/rank/warmup.py) still leaves the default 128 blocks at ``max_dp``: the workspace
    grows with the world x expert_hidden, and a budget it eats whole leaves no KV block, so no
    request is admitted (at expert_hidden 32768, DP 4 and the default 128 blocks the scale
    succeeds and every request then waits forever)."""
    block = cfg.num_layers * cfg.block_size * 2 * cfg.hidden_size * 8  # bytes per block, float64 bound
    work = max_dp * cfg.max_num_tokens * (4 * cfg.hidden_size + cfg.expert_hidden + 4 * cfg.top_k) * 8
    return 128 + -(-work // block)


# ---- link: raw socket vs the transfer path, between the same two processes ---------------------
def _link_peer(
    role: int,
    store_port: int,
    sizes: list[int],
    reps: int,
    q: Any,
    device: str,
    host: str = "127.0.0.1",
    node_ip: str = "",
) -> None:
    """Role 0 receives, role 1 sends; both sides' buffers are allocated and touched up front.
    On a GPU the transfer path stages through host memory (gloo cannot move device tensors
    between processes sharing one GPU): ``gloo_device`` is that path, device to device.
    ``host``: role 0's address (the store's and the raw socket's); ``node_ip``: this peer's own
    address for gloo (two nodes: each side of the link binds its end)."""
    import torch

    from engine_ext.elastic.comm import StatelessGroup
    from engine_ext.elastic.rendezvous import Rendezvous
    from engine_ext.elastic.stores import configure_node

    if node_ip:
        configure_node(node_ip)
    g = StatelessGroup(Rendezvous(host, store_port, "link"), role, 2)
    gd = (
        StatelessGroup(Rendezvous(host, store_port, "linkdev"), role, 2, device=torch.device(device))
        if device != "cpu"
        else None
    )
    for nbytes in sizes:
        n = nbytes // 4
        store = torch.empty(n).fill_(float(role))  # the "weight storage", every page touched
        dstore = store.to(device) if gd is not None else None
        half = n // 2  # the old path's expert vector was w1 and w2 concatenated
        rows: dict[str, list[float]] = {
            "raw": [],
            "gloo_direct": [],
            "gloo_staged": [],
            **({"gloo_device": []} if gd is not None else {}),
        }
        for _ in range(reps):
            # raw: one TCP stream over loopback, recv_into the touched storage
            if role == 0:
                srv = socket.socket()
                srv.bind((host, 0))
                srv.listen(1)
                g.broadcast(torch.tensor([srv.getsockname()[1]]), 0)
                c, _ = srv.accept()
                mv = memoryview(store.numpy()).cast("B")
                g.barrier()
                t0 = time.perf_counter()
                got = 0
                while got < nbytes:
                    got += c.recv_into(mv[got:], nbytes - got)
                rows["raw"].append(time.perf_counter() - t0)
                c.close()
                srv.close()
            else:
                port = int(g.broadcast(torch.tensor([0]), 0)[0])
                c = socket.create_connection((host, port))
                g.barrier()
                c.sendall(memoryview(store.numpy()).cast("B"))
                c.close()
            # storage to storage: gloo from the storage into the storage
            g.barrier()
            t0 = time.perf_counter()
            if role == 0:
                g.exchange([], [(store[:half], 1, 1), (store[half:], 1, 2)])
            else:
                g.exchange([(store[:half], 0, 1), (store[half:], 0, 2)], [])
            rows["gloo_direct"].append(time.perf_counter() - t0)
            # the reshuffle before 2026-12-04: a concatenated vector, a fresh receive buffer, a copy after
            g.barrier()
            t0 = time.perf_counter()
            if role == 0:
                buf = torch.empty(n)
                g.exchange([], [(buf, 1, 3)])
                store[:half].copy_(buf[:half])
                store[half:].copy_(buf[half:])
                del buf
            else:
                vec = torch.cat([store[:half].reshape(-1), store[half:].reshape(-1)])
                g.exchange([(vec, 0, 3)], [])
                del vec
            rows["gloo_staged"].append(time.perf_counter() - t0)
            if gd is not None and dstore is not None:
                gd.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if role == 0:
                    gd.exchange([], [(dstore[:half], 1, 1), (dstore[half:], 1, 2)])
                else:
                    gd.exchange([(dstore[:half], 0, 1), (dstore[half:], 0, 2)], [])
                torch.cuda.synchronize()
                rows["gloo_device"].append(time.perf_counter() - t0)
                if role == 0:  # the staging copies alone, as the engine makes them and pinned
                    for leg, secs in _staging_legs(store, dstore).items():
                        rows.setdefault(leg, []).append(secs)
        g.barrier()
        if role == 0:
            q.put({"bytes": nbytes, **{k: statistics.median(v) for k, v in rows.items()}})
        del store, dstore
    g.destroy()


def _staging_legs(store: Any, dstore: Any) -> dict[str, float]:
    """Seconds of each copy around the staged transfer: device to host into a fresh pageable
    tensor (``tensor.cpu()``, the engine's send side) and into a reused pinned one, host to device
    from the touched pageable storage (the engine's receive side) and from pinned memory."""
    import torch

    pinned = torch.empty(store.numel(), dtype=store.dtype, pin_memory=True)
    pinned.fill_(0.0)  # touched, as a reused staging buffer would be
    legs = {
        "d2h_pageable": lambda: dstore.cpu(),
        "d2h_pinned": lambda: pinned.copy_(dstore),
        "h2d_pageable": lambda: dstore.copy_(store),
        "h2d_pinned": lambda: dstore.copy_(pinned),
    }
    out: dict[str, float] = {}
    for name, fn in legs.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out[name] = time.perf_counter() - t0
    return out


def link_curve(
    sizes_mib: list[int],
    reps: int,
    device: str = "cpu",
    *,
    host: str = "127.0.0.1",
    sender: Callable[[int, list[int]], Any] | None = None,
) -> list[dict[str, Any]]:
    """The link table between two processes: both on this host (loopback), or with ``host`` the
    receiver's address and ``sender(store_port, sizes)`` starting the sending peer elsewhere (two
    nodes: in the worker's network namespace) and returning something with ``wait``."""
    import multiprocessing as mp

    from engine_ext.elastic.stores import host_store

    st = host_store(host)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sizes = [s * MIB for s in sizes_mib]
    kw = {"host": host, "node_ip": host} if sender is not None else {}
    procs = [
        ctx.Process(target=_link_peer, args=(r, st.port, sizes, reps, q, device), kwargs=kw)
        for r in ((0,) if sender is not None else (0, 1))
    ]
    for p in procs:
        p.start()
    remote = sender(st.port, sizes) if sender is not None else None
    rows = [q.get(timeout=600) for _ in sizes]
    for p in procs:
        p.join(60)
    if remote is not None:
        remote.wait(60)
    for r in rows:
        for k in (
            "raw",
            "gloo_direct",
            "gloo_staged",
            "gloo_device",
            "d2h_pageable",
            "d2h_pinned",
            "h2d_pageable",
            "h2d_pinned",
        ):
            if k in r:
                r[f"{k}_GBps"] = r["bytes"] / r[k] / 1e9
                if not k.startswith(("d2h", "h2d")):  # the copies alone are no transfer to compare
                    r[f"ratio_{k.removeprefix('gloo_')}"] = r["raw"] / r[k]
    return rows


# ---- deployments --------------------------------------------------------------------------------
async def _client(dep: Any, stop: asyncio.Event, out: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = await dep.generate(PROMPT, 8)
            out.append({"t": time.perf_counter() - t0, "ok": "output" in r})
        except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
            out.append({"t": time.perf_counter() - t0, "ok": False, "error": repr(e)})


async def decode_step_s(dep: Any, k: int = 24, reps: int = 3, prompt: list[int] | None = None) -> float:
    """One decode step of the deployment as it is: (time of 1 + k tokens - time of 1 token) / k,
    medians over ``reps``, idle deployment."""
    prompt = prompt or PROMPT
    t1, tk = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        await dep.generate(prompt, 1)
        t1.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await dep.generate(prompt, 1 + k)
        tk.append(time.perf_counter() - t0)
    return max(0.0, (statistics.median(tk) - statistics.median(t1)) / k)


DEVICE_COPY = """
import statistics, sys, time, torch
n = 1 << 30
a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
ts = []
for _ in range(6):
    torch.cuda.synchronize(); t = time.perf_counter(); b.copy_(a); torch.cuda.synchronize()
    ts.append(time.perf_counter() - t)
print(n / statistics.median(ts[1:]) / 1e9)
"""


def device_copy_GBps() -> float:
    """The device's own device-to-device copy rate (1 GiB, bytes copied per second), in a process
    of its own: the benchmark process must not hold a CUDA context while it starts ranks."""
    import subprocess
    import sys

    return float(
        subprocess.run([sys.executable, "-c", DEVICE_COPY], check=True, capture_output=True, text=True).stdout.strip()
    )


def _rank_events(dep: Any, op_id: str, phase: str) -> dict[int, dict[str, Any]]:
    return {e["rank"]: e for e in dep.registry.events_for(op_id) if e["phase"] == phase and e["rank"] >= 0}


async def transition(
    cfg_d: dict[str, Any],
    name: str,
    start: int,
    target: int,
    *,
    standby: int = 0,
    step: bool = False,
    device: str = "cpu",
    kv_experts: int = 0,
) -> dict[str, Any]:
    """One scale ``start`` -> ``target`` under one closed-loop client, on a fresh deployment.
    ``kv_experts``: KV blocks for that many experts beside the pool, room for a member's pre-copy.
    A scale the admission refuses is a row with ``state`` "refused" and the reason."""
    from engine_ext.capture_memory import kv_block_bytes
    from engine_ext.config import EngineConfig
    from engine_ext.elastic.precopy import expert_nbytes
    from engine_ext.launcher import LocalDeployment
    from engine_ext.protocol import PreconditionError

    cfg = EngineConfig(**cfg_d)
    cfg.num_blocks = kv_blocks(cfg, max(target, 4)) + kv_experts * -(-expert_nbytes(cfg) // kv_block_bytes(cfg))
    dep = LocalDeployment(cfg, name, max_dp=max(target, 4), standby=standby, device=device)
    t_up = time.perf_counter()
    await dep.start(start)
    if dep.pool is not None:
        while len(dep.pool.ready) < standby:
            await asyncio.sleep(0.2)
    up_s = time.perf_counter() - t_up
    row: dict[str, Any] = {"from": start, "to": target, "up_s": up_s}
    try:
        if step:
            row["step_before_s"] = await decode_step_s(dep)
        stop, reqs = asyncio.Event(), []
        client = asyncio.ensure_future(_client(dep, stop, reqs))
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        try:
            op = await dep.scale(target, timeout_s=600)
        except PreconditionError as e:
            stop.set()
            await client
            return row | {"state": "refused", "error": e.message}
        row["wall_s"] = time.perf_counter() - t0
        await asyncio.sleep(0.5)
        stop.set()
        await client
        if step:  # after the pool refilled: its launches would share the cores with the step
            while dep.pool is not None and len(dep.pool.ready) < standby:
                await asyncio.sleep(0.2)
            row["step_after_s"] = await decode_step_s(dep)
        pd = dep.registry.operations(op["op_id"])[-1]["phase_durations"]  # ranks' phases folded in (slowest)
        row.update(
            state=op.get("state"),
            pause_s=op.get("serving_pause_s"),
            launch_s=pd.get("launch", 0.0),
            phases=pd,
            captures=op.get("captures_per_rank", {}),
            requests=len(reqs),
            failed=sum(1 for r in reqs if not r["ok"]),
            request_max_s=max((r["t"] for r in reqs), default=None),
        )
        op_id = op["op_id"]
        # Experts move in the pre-copy (prepare, while serving); the commit's reshuffle only loads a
        # member's spare buffers. A run from before the pre-copy reported them in the reshuffle.
        pre, resh, dense = (_rank_events(dep, op_id, ph) for ph in ("precopy", "reshuffle", "transfer"))
        moved = pre or resh
        per_expert = expert_bytes(cfg.expert_hidden) // cfg.num_experts
        joiners = [r for r in range(start, target)]
        tx = []
        for r in joiners:
            e = moved.get(r)
            if e is None:
                continue
            d = e["detail"]
            got = d.get("bytes_received", d.get("received", 0) * per_expert)  # the latter: before bytes were reported
            dd = dense.get(r, {"duration_s": 0.0, "detail": {}})
            tx.append(
                {
                    "rank": r,
                    "reshuffle_s": e["duration_s"],
                    "expert_bytes": got,
                    "bytes_reported": "bytes_received" in d,
                    "dense_s": dd["duration_s"],
                    "dense_bytes": dd["detail"].get("bytes", 0),
                }
            )
        row["joiners"] = tx
        row["transfer_s"] = max((j["reshuffle_s"] + j["dense_s"] for j in tx), default=None)
        got_total = sum(j["expert_bytes"] + j["dense_bytes"] for j in tx)
        row["transfer_bytes_per_joiner"] = got_total // max(1, len(tx))
        row["transfer_GBps_per_joiner"] = (
            statistics.median(
                [(j["expert_bytes"] + j["dense_bytes"]) / max(1e-9, j["reshuffle_s"] + j["dense_s"]) for j in tx]
            )
            / 1e9
            if tx
            else None
        )
        commits = _rank_events(dep, op_id, "commit")
        row["commit_by_rank"] = {str(r): e["duration_s"] for r, e in commits.items()}
        row["commit_parts_by_rank"] = {str(r): e["detail"].get("parts_s", {}) for r, e in sorted(commits.items())}
        # A joiner's commit starts when its prepare ends (it serves nothing before) and waits in the
        # first collective for the survivors, which stop serving only when they commit: the pause
        # clients see runs from the first survivor stopping to the last rank serving again.
        stops = [e["start"] for r, e in commits.items() if r < start]
        if stops:
            row["pause_window_s"] = max(e["end"] for e in commits.values()) - min(stops)
        # the move's parts: the pre-copy's packing (local copies) and exchange, in prepare; loading
        # the spare buffers into the slots, in the commit (before the pre-copy: all in the commit)
        row["reshuffle_parts_by_rank"] = {
            str(r): {
                k: round(d[k], 4)
                for k in (
                    "clone_s",
                    "pack_s",
                    "exchange_s",
                    "exchanges",
                    "move_publish_s",
                    "move_wait_s",
                    "move_map_s",
                    "move_copy_s",
                )
                if k in d
            }
            | {
                "load_s": round(resh.get(r, {}).get("detail", {}).get("load_s", 0.0), 4),
                "commit_copy_bytes": resh.get(r, {}).get("detail", {}).get("commit_copy_bytes", 0),
                "load_threads": resh.get(r, {}).get("detail", {}).get("load_threads", 1),
                "spare_bytes": d.get("spare_bytes", 0),
                "sent": d.get("bytes_sent", 0),
                "received": d.get("bytes_received", 0),
            }
            for r, d in sorted((r, e["detail"]) for r, e in moved.items())
        }
        row["precopy_s"] = max((e["duration_s"] for e in pre.values()), default=None)
        # the move alone: expert bytes a joiner received over its pre-copy's exchanges' time
        rates = [
            e["detail"]["bytes_received"] / e["detail"]["exchange_s"]
            for r, e in pre.items()
            if r in joiners and e["detail"].get("exchange_s") and e["detail"].get("bytes_received")
        ]
        row["move_GBps_per_joiner"] = statistics.median(rates) / 1e9 if rates else None
        # the device's view: every byte the pre-copy moved over its window (the slowest rank's
        # exchanges, a sender's included: it returns once its receivers copied). Ranks sharing one
        # device share its copy engines, so this, not one joiner's share, compares with the
        # device's own copy rate.
        window = max((e["detail"].get("exchange_s", 0.0) for e in pre.values()), default=0.0)
        got = sum(e["detail"].get("bytes_received", 0) for e in pre.values())
        row["move_GBps_all"] = got / window / 1e9 if window > 0 and got else None
        row["move_memory"] = dep.registry.operations(op_id)[-1].get("move_memory", {})
        # the plan's predicted cost beside the measured one (benchmarks/fit_cost.py fits from them)
        row["cost"] = dep.registry.operations(op_id)[-1].get("cost", {})
        row.update(capture_policy=str(cfg.capture_policy), capture_sizes=list(cfg.capture_sizes), pool=standby > 0)
        for ph in ("warm", "capture", "lock", "reshuffle"):
            row[f"{ph}_by_rank"] = {str(r): e["duration_s"] for r, e in _rank_events(dep, op_id, ph).items()}
        # reuse + a standby pool: the joiners' warm-up and capture pass taken in the pool, before
        # adoption (off the pause); their commit only checks those captures (capture event in_pool)
        row["in_pool_by_rank"] = {
            str(r): {"warm_s": e["detail"].get("pool_warm_s"), "capture_s": e["detail"].get("pool_capture_s")}
            for r, e in _rank_events(dep, op_id, "capture").items()
            if e["detail"].get("in_pool")
        }
    finally:
        await dep.stop()
    return row


def copy_rate(nbytes: int = 64 * MIB, reps: int = 5) -> float:
    """The host's memory copy rate (GB/s, median of ``reps``): a touched tensor into another, as the
    commit loads a spare buffer into its slot, on the threads a rank has (``EEP_TORCH_THREADS``,
    1: this process's default of one per core copied 17.7 GB/s on the 2-core box, a rank 8.4). The
    cost model prices a commit's loads with it where no curve point had any."""
    import os

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(os.environ.get("EEP_TORCH_THREADS", "1"))))
    try:
        src, dst = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / statistics.median(times) / 1e9


def slopes(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares slopes of the pause and the wall time against expert GiB (0 with one point)."""
    xs = [r["expert_MiB"] / 1024 for r in rows]
    out: dict[str, float] = {}
    for key in ("pause_s", "wall_s"):
        ys = [float(r[key] or 0.0) for r in rows]
        mx, my = (sum(xs) / len(xs), sum(ys) / len(ys)) if xs else (0.0, 0.0)
        var = sum((x - mx) ** 2 for x in xs)
        out[f"{key}_per_GiB"] = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return out


def rss_budget_note(eh: int, dp: int) -> str:
    per_rank = expert_bytes(eh) * BASE["slots_per_rank"] // BASE["num_experts"]
    return f"{per_rank / MIB:.0f} MiB of experts per rank, {per_rank * dp / MIB:.0f} MiB at DP {dp}"


# ---- the plot: a hand-written SVG (matplotlib is not in the project's environment) --------------
def _panel(
    x0: int, title: str, xs: list[float], series: dict[str, list[float | None]], xlabel: str, ylabel: str, logx: bool
) -> str:
    import math

    w, h, pad = 360, 240, 44
    pts = [v for s in series.values() for v in s if v is not None]
    if not xs or not pts:
        return ""
    fx = (lambda v: math.log10(v)) if logx else (lambda v: v)  # noqa: E731
    xmin, xmax = fx(min(xs)), fx(max(xs))
    ymax = max(pts) * 1.1 or 1.0
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]

    def px(v: float) -> float:
        return x0 + pad + (fx(v) - xmin) / ((xmax - xmin) or 1) * (w - 2 * pad)

    def py(v: float) -> float:
        return 30 + (1 - v / ymax) * (h - 60)

    out = [
        f'<text x="{x0 + w / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{x0 + pad}" y1="{h - 30}" x2="{x0 + w - pad}" y2="{h - 30}" stroke="black"/>',
        f'<line x1="{x0 + pad}" y1="30" x2="{x0 + pad}" y2="{h - 30}" stroke="black"/>',
        f'<text x="{x0 + w / 2}" y="{h - 4}" text-anchor="middle" font-size="11">{xlabel}</text>',
        f'<text x="{x0 + 4}" y="26" font-size="11">{ylabel} (max {ymax / 1.1:.3g})</text>',
    ]
    for v in xs:
        out.append(f'<text x="{px(v):.1f}" y="{h - 17}" text-anchor="middle" font-size="9">{v:g}</text>')
    for i, (name, ys) in enumerate(series.items()):
        c = colors[i % len(colors)]
        p = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys) if y is not None)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{p}"/>')
        out += [
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>' for x, y in zip(xs, ys) if y is not None
        ]
        out.append(
            f'<text x="{x0 + w - pad - 4}" y="{44 + 13 * i}" text-anchor="end" font-size="10" fill="{c}">{name}</text>'
        )
    return "\n".join(out)


def write_svg(path: str, res: dict[str, Any]) -> None:
    b, wd, lk = res["bytes"], res["world"], res["link"]
    panels = [
        _panel(
            0,
            "2->4 against total expert bytes",
            [r["expert_MiB"] for r in b],
            {
                "wall s": [r["wall_s"] for r in b],
                "pause s": [r["pause_s"] for r in b],
                "transfer s": [r["transfer_s"] for r in b],
            },
            "expert MiB (log)",
            "seconds",
            True,
        ),
        _panel(
            380,
            "against world size (ranks on 2 cores)",
            [r["to"] for r in wd],
            {
                "wall s": [r["wall_s"] for r in wd],
                "pause s": [r["pause_s"] for r in wd],
                "launch s": [r["launch_s"] for r in wd],
                "transfer s": [r["transfer_s"] for r in wd],
            },
            "world after (from half of it)",
            "seconds",
            False,
        ),
        _panel(
            760,
            "transfer / raw socket, same endpoints",
            [r["bytes"] / MIB for r in lk],
            {
                "gloo direct": [r["ratio_direct"] for r in lk],
                "packed + fresh buffer (reshuffle before 12-04)": [r["ratio_staged"] for r in lk],
            },
            "MiB per transfer (log)",
            "ratio",
            True,
        ),
    ]
    with open(path, "w") as f:
        f.write('<svg xmlns="http://www.w3.org/2000/svg" width="1140" height="250" font-family="sans-serif">\n')
        f.write('<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(panels) + "\n</svg>\n")


def write_csv(path: str, res: dict[str, Any]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["curve", "x", "wall_s", "pause_s", "transfer_s", "launch_s", "transfer_GBps", "ratio"])
        for r in res["bytes"]:
            w.writerow(
                [
                    "bytes",
                    r["expert_MiB"],
                    r["wall_s"],
                    r["pause_s"],
                    r["transfer_s"],
                    r["launch_s"],
                    r["transfer_GBps_per_joiner"],
                    "",
                ]
            )
        for r in res["world"]:
            w.writerow(
                [
                    "world",
                    f"{r['from']}->{r['to']}",
                    r["wall_s"],
                    r["pause_s"],
                    r["transfer_s"],
                    r["launch_s"],
                    r["transfer_GBps_per_joiner"],
                    "",
                ]
            )
        for r in res["link"]:
            w.writerow(
                ["link", r["bytes"] / MIB, "", "", r["gloo_direct"], "", r["gloo_direct_GBps"], r["ratio_direct"]]
            )


def _f(v: Any, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _tag(a: argparse.Namespace) -> str:
    return ("_quick" if a.quick else "") + ("" if a.device == "cpu" else "_" + a.device.replace(":", ""))


def save(a: argparse.Namespace, res: dict[str, Any]) -> None:
    """Write what is measured so far (a long run stopped half way keeps its curves)."""
    res["loadavg_end"] = os.getloadavg()
    res.setdefault("bytes", [])
    res.setdefault("world", [])
    tag = _tag(a)
    with open(os.path.join(a.out, f"curves{tag}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    write_svg(os.path.join(a.out, f"curves{tag}.svg"), res)
    write_csv(os.path.join(a.out, f"curves{tag}.csv"), res)
    print(
        f"(wrote {a.out}/curves{tag}.json, .svg, .csv; load average {res['loadavg_start']} -> {res['loadavg_end']})",
        flush=True,
    )


async def main(a: argparse.Namespace) -> dict[str, Any]:
    os.makedirs(a.out, exist_ok=True)
    res: dict[str, Any] = {
        "quick": a.quick,
        "base_config": BASE,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "host": host_identity(a.device),
    }
    link_sizes = [1, 8] if a.quick else [16, 256, 1024]
    dev = a.device
    ehs = [128] if a.quick else [int(x) for x in a.expert_hidden.split(",")]
    worlds = [(2, 4)] if a.quick else [tuple(int(v) for v in w.split(":")) for w in a.worlds.split(",")]

    if "link" in a.parts:
        res["link"] = link_curve(link_sizes, 1 if a.quick else 3, dev)
        print(
            "| MiB per transfer | raw socket GB/s | gloo direct GB/s | ratio "
            "| packed + fresh buffer (reshuffle before 12-04) GB/s | ratio |"
        )
        print("|---|---|---|---|---|---|")
        for r in res["link"]:
            print(
                f"| {r['bytes'] / MIB:.0f} | {r['raw_GBps']:.2f} | {r['gloo_direct_GBps']:.2f} "
                f"| {r['ratio_direct']:.2f} "
                f"| {r['gloo_staged_GBps']:.2f} | {r['ratio_staged']:.2f} |"
                + (
                    f" device->device staged through host: {r['gloo_device_GBps']:.2f} GB/s, "
                    f"ratio {r['ratio_device']:.2f}"
                    if "gloo_device" in r
                    else ""
                )
                + (
                    "; copies alone GB/s: "
                    + ", ".join(
                        f"{k} {r[k + '_GBps']:.1f}"
                        for k in ("d2h_pageable", "d2h_pinned", "h2d_pageable", "h2d_pinned")
                    )
                    if "d2h_pinned" in r
                    else ""
                ),
                flush=True,
            )
    res.setdefault("link", [])

    res["bytes"] = []
    if "bytes" in a.parts:
        if dev.startswith("cuda"):
            res["device_copy_GBps"] = device_copy_GBps()
            print(f"bytes: the device's own device-to-device copy: {res['device_copy_GBps']:.0f} GB/s", flush=True)
        # the commit's loads into slots: device copies on a GPU (the host's rate priced a CUDA
        # commit's 128 MiB load at 13 ms where it took under 1 ms: run16, H100)
        res["copy_GBps"] = res["device_copy_GBps"] if dev.startswith("cuda") else copy_rate()
        print(
            f"{'device' if dev.startswith('cuda') else 'host memory'} copy: {res['copy_GBps']:.2f} GB/s "
            "(the commit's loads into slots)",
            flush=True,
        )
        for eh in ehs:
            print(f"bytes: expert_hidden {eh}: {rss_budget_note(eh, 4)}", flush=True)
            # No captures unless asked (--bytes-capture-sizes): a CUDA capture's decode runs every local
            # slot densely, which at GiBs of experts takes seconds a step; eager decode runs top-k only.
            sizes = [int(x) for x in a.bytes_capture_sizes.split(",") if x]
            row = await transition(
                {
                    **BASE,
                    "expert_hidden": eh,
                    "capture_sizes": sizes,
                    "capture_policy": a.bytes_policy,
                    "transport": a.transport,
                    "commit_load_threads": a.commit_load_threads,
                },
                f"cb{eh}",
                2,
                4,
                device=dev,
                standby=a.bytes_standby,
                kv_experts=a.kv_experts,
            )
            row.update(expert_hidden=eh, expert_MiB=expert_bytes(eh) / MIB)
            if row.get("state") == "refused":  # kept apart: the tables and the fit take scales that ran
                print(f"  refused: {row['error']}", flush=True)
                res.setdefault("bytes_refused", []).append(row)
                continue
            res["bytes"].append(row)
            save(a, res)  # a point that stalls (memory, time limit) keeps the ones before it
        chosen = sorted({str(r.get("capture_policy")) for r in res["bytes"]})  # what auto resolved to
        print(
            f"\n(bytes curve: capture policy {a.bytes_policy} ({', '.join(chosen)}), standby pool {a.bytes_standby}, "
            f"transport {a.transport}, capture sizes {a.bytes_capture_sizes or 'none'})"
        )
        print(
            "| expert MiB | per expert MiB | wall s | launch s | prepare s | pre-copy s | pause s | commit s "
            "| transfer s (joiner) | GB/s per joiner | move GB/s | copied in commit B | failed/requests |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["bytes"]:
            copied = max((p.get("commit_copy_bytes", 0) for p in r["reshuffle_parts_by_rank"].values()), default=0)
            print(
                f"| {r['expert_MiB']:.0f} | {r['expert_MiB'] / 8:.2f} | {_f(r['wall_s'], 2)} | "
                f"{_f(r['launch_s'], 2)} | "
                f"{_f(r['phases'].get('prepare'), 2)} | {_f(r.get('precopy_s'), 2)} | "
                f"{_f(r['pause_s'])} | {_f(r['phases'].get('commit'))} | {_f(r['transfer_s'])} | "
                f"{_f(r['transfer_GBps_per_joiner'], 2)} | {_f(r.get('move_GBps_per_joiner'), 2)} | {copied:,} | "
                f"{r['failed']}/{r['requests']} |",
                flush=True,
            )
        if res.get("device_copy_GBps"):
            for r in res["bytes"]:
                if r.get("move_GBps_per_joiner"):
                    c = res["device_copy_GBps"]
                    print(
                        f"{r['expert_MiB']:.0f} MiB: move {r['move_GBps_per_joiner']:.1f} GB/s per joiner = "
                        f"{r['move_GBps_per_joiner'] / c:.3f}x the device's copy; all ranks' "
                        f"{_f(r.get('move_GBps_all'), 1)} GB/s = {(r.get('move_GBps_all') or 0) / c:.3f}x",
                        flush=True,
                    )
        res["bytes_slope"] = slopes(res["bytes"])
        print(
            f"slopes against expert GiB (least squares): pause {res['bytes_slope']['pause_s_per_GiB']:.4f} s/GiB, "
            f"wall {res['bytes_slope']['wall_s_per_GiB']:.3f} s/GiB",
            flush=True,
        )

    save(a, res)
    if "pause" in a.parts:
        row = await transition(
            {**BASE, "expert_hidden": 128, "capture_policy": "reuse"}, "cpause", 2, 4, standby=2, step=True, device=dev
        )
        row["pause_in_steps"] = row["pause_s"] / max(1e-9, row["step_after_s"])
        row["pause_in_steps_dp2"] = row["pause_s"] / max(1e-9, row["step_before_s"])
        res["pause"] = row
        print(
            f"\npause: 2->4, standby 2, reuse: serving pause {row['pause_s']:.3f} s; one decode step "
            f"{row['step_before_s'] * 1e3:.1f} ms at DP 2, {row['step_after_s'] * 1e3:.1f} ms at DP 4; "
            f"pause = {row['pause_in_steps']:.1f} steps (DP 4), {row['pause_in_steps_dp2']:.1f} steps (DP 2)"
        )
        for ph in ("commit", "reshuffle", "warm", "capture", "lock"):
            print(f"  {ph} by rank: {row.get(f'{ph}_by_rank', {})}", flush=True)
        print(f"  taken in the pool, before adoption, by rank: {row.get('in_pool_by_rank', {})}", flush=True)
        print(f"  inside the commit, by rank: {row.get('commit_parts_by_rank', {})}", flush=True)
        if row.get("pause_window_s") is not None:
            print(
                f"  first survivor stopping -> last rank serving: {row['pause_window_s']:.3f} s = "
                f"{row['pause_window_s'] / max(1e-9, row['step_before_s']):.1f} steps (DP 2)",
                flush=True,
            )
        save(a, res)
    res["world"] = []
    if "world" in a.parts:
        for s, t in worlds:
            row = await transition({**BASE, "expert_hidden": a.world_expert_hidden}, f"cw{t}", s, t, device=dev)
            res["world"].append(row)
            save(a, res)
        print(
            f"\n(world curve: expert_hidden {a.world_expert_hidden}, "
            f"{expert_bytes(a.world_expert_hidden) / MIB:.0f} MiB of experts)"
        )
        print(
            "| op | wall s | launch s | pause s | prepare s | transfer s | commit s | reshuffle s | warm s | capture s "
            "| pause / 2->4 pause |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        p0 = res["world"][0]["pause_s"] or 1e-9
        for r in res["world"]:
            ph = r["phases"]
            print(
                f"| {r['from']}->{r['to']} | {_f(r['wall_s'], 2)} | {_f(r['launch_s'], 2)} | {_f(r['pause_s'])} | "
                f"{_f(ph.get('prepare'))} | {_f(r['transfer_s'])} | {_f(ph.get('commit'))} | "
                f"{_f(ph.get('reshuffle'))} | "
                f"{_f(ph.get('warm'))} | {_f(ph.get('capture'))} | {r['pause_s'] / p0:.2f} |",
                flush=True,
            )

    save(a, res)
    if a.fit:
        from benchmarks.fit_cost import fit_and_write

        fit_and_write([os.path.join(a.out, f"curves{_tag(a)}.json")], os.path.join(a.out, "cost_model.json"))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small smoke run: 1 and 8 MiB link, 2 MiB model, 2->4")
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--parts", default="link,bytes,world,pause")
    ap.add_argument(
        "--expert-hidden",
        default="256,4096,32768,262144",
        help="the bytes curve's points (8 KiB of experts per unit: 2 MiB .. 2 GiB)",
    )
    ap.add_argument("--worlds", default="2:4,4:8,8:16")
    ap.add_argument(
        "--bytes-policy",
        default="auto",
        help="the bytes curve's capture policy: auto (the engine's default), reuse or recapture",
    )
    ap.add_argument(
        "--bytes-capture-sizes",
        default="",
        help="the bytes curve's capture sizes, e.g. 1,2,4,8 (default none: the pause without captures)",
    )
    ap.add_argument(
        "--bytes-standby",
        type=int,
        default=0,
        help="the bytes curve's standby pool (2: the joiners' launch is off the scale)",
    )
    ap.add_argument("--world-expert-hidden", type=int, default=1024)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share the one GPU)")
    ap.add_argument("--transport", default="auto", help="the bytes curve's: auto (same-host memory) or gloo")
    ap.add_argument(
        "--kv-experts",
        type=int,
        default=0,
        help="the bytes curve's KV pool also holds this many experts: room for a member's pre-copy",
    )
    ap.add_argument(
        "--commit-load-threads",
        type=int,
        default=0,
        help="the bytes curve's engine config: threads loading landed experts in the commit (0: sized to the host)",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="fit the cost model to this run's bytes and pause points: <out>/cost_model.json",
    )
    asyncio.run(main(ap.parse_args()))
