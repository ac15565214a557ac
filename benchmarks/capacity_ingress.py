"""capacity.py's ``ingress`` part (issue 33): the token rate of a Ray deployment through its
ingresses, with 1 and with more of them.

Each point is a deployment (`eepctl up --dp D --ingress N`, through eepctl.core) and two
closed-loop runs of ``--clients`` clients, spread over the ingresses in turn:
  http  the OpenAI endpoint, streamed, through the client `eepctl generate` uses
        (engine_ext.drivers.completions);
  ray   Ray actor calls to the same ingress actors' ``generate`` (no HTTP).
capacity.py's ``closed`` part is the direct path beside them (a LocalDeployment: no Ray, no
ingress). For each run: tok/s, request p50/p99, the requests each ingress answered, and the CPU
time the ingress processes spent per output token (read from /proc where they run on this host):
``1000 / cpu_ms_per_token`` is the token rate one ingress process could carry at most, the
ceiling N ingresses multiply.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
NAMESPACE = "eepctl-bench"


def _pct(xs: list[float], q: float) -> float | None:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _cpu_s(pids: list[int]) -> float | None:
    """utime + stime of these processes (None: one runs on another host)."""
    total = 0.0
    for pid in pids:
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            return None
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _closed(send: Any, clients: int, seconds: float) -> tuple[list[float], int, int]:
    """``clients`` threads, each sending ``send(i)`` back to back for ``seconds``: the served
    requests' latencies, the failed ones and the tokens served. ``send`` returns the answer's
    output tokens, or None for a request answered with an error."""
    lat: list[float] = []
    failed, served = [0], [0]
    stop = time.perf_counter() + seconds

    def client(i: int) -> None:
        n = i
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                got = send(n)
            except Exception:  # noqa: BLE001 - a failed request is a figure
                got = None
            if got is not None:
                lat.append(time.perf_counter() - t0)
                served[0] += len(got)
            else:
                failed[0] += 1
            n += clients

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return lat, failed[0], served[0]


def _output(res: dict[str, Any]) -> list[int] | None:
    return None if res.get("error") else list(res.get("output") or [])


def ingress_point(dp: int, ingresses: int, a: Any, transport: str) -> dict[str, Any]:
    import ray
    from eepctl import core
    from engine_ext.ray.names import ingress_name

    t = core.Target(address=a.address or None, namespace=NAMESPACE, name=f"cap-d{dp}-i{ingresses}")
    core.up(
        t,
        dp=dp,
        max_dp=dp,
        engine={"transport": transport},
        cpus_per_rank=1.0,
        gpus_per_rank=1.0 if a.device == "cuda" else 0.0,
        timeout_s=600,
        ingress=ingresses,
    )
    row: dict[str, Any] = {"dp": dp, "ingresses": ingresses, "transport": transport, "clients": a.clients}
    try:
        handles = [ray.get_actor(ingress_name(t.name, i), namespace=NAMESPACE) for i in range(ingresses)]
        pids = ray.get([h.pid.remote() for h in handles], timeout=60)
        with core.requests(t, a.tokens, 120.0) as submit:  # as `eepctl generate` sends
            paths = {
                "http": lambda n: _output(submit(PROMPT).wait(120)),
                "ray": lambda n: _output(
                    ray.get(handles[n % ingresses].generate.remote(PROMPT, a.tokens), timeout=120)
                ),
            }
            for path, send in paths.items():
                _closed(send, 2, 1.0)  # warm: first requests, first replays
                before = [ray.get(h.stats.remote(), timeout=30)["completed"] for h in handles]
                cpu0, t0 = _cpu_s(pids), time.perf_counter()
                lat, failed, tokens = _closed(send, a.clients, a.seconds)
                wall, cpu1 = time.perf_counter() - t0, _cpu_s(pids)
                after = [ray.get(h.stats.remote(), timeout=30)["completed"] for h in handles]
                row[path] = {
                    "requests": len(lat),
                    "failed": failed,
                    "tokens": tokens,
                    "tok_s": tokens / wall,
                    "p50_ms": (_pct(lat, 0.5) or 0) * 1e3,
                    "p99_ms": (_pct(lat, 0.99) or 0) * 1e3,
                    "per_ingress": [x - y for x, y in zip(after, before)],
                    "cpu_ms_per_token": (cpu1 - cpu0) * 1e3 / tokens
                    if tokens and cpu0 is not None and cpu1 is not None
                    else None,
                }
    finally:
        core.down(t, stop_cluster=False)
    return row


def print_table(rows: list[dict[str, Any]], clients: int) -> None:
    print(
        f"\n| DP | ingresses | path | {clients} clients tok/s | p50 ms | p99 ms | requests per ingress "
        "| ingress CPU ms/token | one ingress's ceiling tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for path in ("http", "ray"):
            m = r[path]
            cpu = m["cpu_ms_per_token"]
            print(
                f"| {r['dp']} | {r['ingresses']} | {path} | {m['tok_s']:.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
                f"{'/'.join(map(str, m['per_ingress']))} | {'-' if cpu is None else f'{cpu:.3f}'} | "
                f"{'-' if not cpu else f'{1000 / cpu:.0f}'} |",
                flush=True,
            )
