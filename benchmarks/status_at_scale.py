"""`eepctl status -o json` at 256 and 4096 registered ranks: the light read path (registry HTTP
endpoint found through the GCS internal KV, no Ray driver) against the Ray driver path
(EEPCTL_READ_PATH=ray), and the cost of one `status --watch` refresh.

What is measured is the registry and the CLI, so the ranks are synthetic: reporter threads in
this driver push a realistic RankStatus for each rank through ``Registry.report_status`` (the
same call a RankActor makes; at 4096 ranks every ~16 s, so the reporters do not starve two
cores), while the CLI is timed as a whole process (median of RUNS). With --ray-list,
`ray list actors` is timed too (it needs the dashboard, so the head starts with one).

The benchmark starts its own local Ray head (eepctl's start_local: own process group) and
stops it by that group at the end.

Usage: .venv/bin/python benchmarks/status_at_scale.py [RANKS,...=256,4096] [RUNS=7] [--ray-list]
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine_ext.protocol import RankState, RankStatus, to_builtins  # noqa: E402


def synthetic_status(deployment: str, rank: int, dp: int, rng: random.Random) -> dict[str, Any]:
    """A status record shaped exactly like RankEngine.status() produces."""
    iid = f"{deployment}_dp{rank}"
    st = to_builtins(
        RankStatus(
            deployment=deployment,
            rank=rank,
            instance_id=iid,
            engine_id=iid,
            node=f"node-{rank // 8}/10.0.{rank // 8}.1",
            pid=100000 + rank,
            device="cpu",
            state=RankState.SERVING.value,
            dp_size=dp,
            requests_running=rng.randint(0, 8),
            requests_waiting=rng.randint(0, 4),
            slots_used=rng.randint(0, 8),
            slots_total=8,
            kv_blocks_used=rng.randint(1, 127),
            kv_blocks_total=128,
            workspace_bytes=1 << 20,
            workspace_locked=True,
            workspace_required_bytes=1 << 20,
            graphs_captured=4,
            capture_sizes=[1, 2, 4, 8],
            graph_replays=rng.randint(0, 10**6),
            last_capture_s=0.05,
            captures_this_op=1,
            current_op="",
            eplb_step=rng.randint(0, 1000),
            eplb_imbalance=round(rng.random(), 3),
            physical_experts=8,
            logical_experts=8,
            steps=rng.randint(0, 10**6),
            last_heartbeat=time.time(),
        )
    )
    st["stale_replays_refused"] = 0
    st["eplb_logical_load"] = [rng.random() for _ in range(8)]
    st["eplb_recent_load"] = [float(rng.randint(0, 500)) for _ in range(8)]
    st["eplb_slots"] = [(rank + i) % 8 for i in range(4)]
    st["capture_times_s"] = {"1": 0.011, "2": 0.012, "4": 0.013, "8": 0.014}
    st["last_capture_pass_s"] = 0.05
    return st


class Reporters:
    """``threads`` threads, each pushing the status of its share of ranks every ``interval_s``."""

    def __init__(self, registry: Any, deployment: str, ranks: int, threads: int = 4, interval_s: float = 1.0) -> None:
        self.registry, self.deployment, self.ranks = registry, deployment, ranks
        self.interval_s = interval_s
        self._stop = threading.Event()
        self.sent = 0
        self._threads = [threading.Thread(target=self._run, args=(i, threads), daemon=True) for i in range(threads)]

    def _run(self, i: int, n: int) -> None:
        rng = random.Random(i)
        mine = list(range(i, self.ranks, n))
        while not self._stop.is_set():
            t0 = time.time()
            for r in mine:
                self.registry.report_status.remote(synthetic_status(self.deployment, r, self.ranks, rng))
                self.sent += 1
            self._stop.wait(max(0.0, self.interval_s - (time.time() - t0)))

    def __enter__(self) -> Reporters:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)


def start_head(num_cpus: int = 16) -> tuple[int, str]:
    """A local head via eepctl's own start_local (own process group, own state dir)."""
    os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-bench-"))
    from eepctl import cluster

    info = cluster.start_local(num_cpus=num_cpus, dashboard=os.environ.get("EEP_BENCH_DASHBOARD") == "1")
    return int(info["pgid"]), info["address"]


def stop_group(pgid: int) -> None:
    from eepctl import cluster

    cluster.stop_process_group(pgid)


_CPU: dict[str, list[float]] = {}  # per command label: CPU seconds (user+sys) of each run


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(
    cmd: list[str], runs: int, env: dict[str, str], label: str = ""
) -> tuple[list[float], subprocess.CompletedProcess]:
    """Wall seconds of each run; the CPU seconds the process used go to _CPU[label]: on a machine
    other sessions load, wall time mostly measures waiting for a core, CPU time what the command costs."""
    last = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)  # warm-up
    out, cpu = [], []
    for _ in range(runs):
        c0, t0 = _children_cpu(), time.perf_counter()
        last = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        out.append(time.perf_counter() - t0)
        cpu.append(_children_cpu() - c0)
    _CPU[label] = cpu
    return out, last


def watch_refresh(address: str, ns: str, name: str, runs: int) -> list[float]:
    """One `status --watch` refresh in-process: the registry call and the table for a 50-line screen."""
    from eepctl import readpath, render

    read = readpath.reader(address, ns, name)
    assert read is not None, "the light read path is not available"
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        render.status_text(read(), width=200, max_rows=38)
        out.append(time.perf_counter() - t0)
    return out


def row(label: str, ts: list[float]) -> str:
    return f"{label:<52} {len(ts):>4} {min(ts):>6.3f}s {statistics.median(ts):>6.3f}s {max(ts):>6.3f}s"


def bench(address: str, env: dict[str, str], ranks: int, runs: int, ray_list: bool) -> dict[str, float]:
    import ray
    from engine_ext.ray.names import registry_name
    from engine_ext.ray.registry import Registry

    name, ns = f"scale-bench-{ranks}", "eepctl"
    registry = (
        ray.remote(Registry)
        .options(name=registry_name(name), namespace=ns, lifetime="detached", num_cpus=0)
        .remote(name)
    )
    ray.get(registry.set_info.remote({"dp": ranks, "max_dp": ranks}))
    lines = []
    with Reporters(registry, name, ranks, interval_s=max(1.0, ranks / 256)) as rep:
        deadline = time.time() + 120
        while len(ray.get(registry.snapshot.remote())["ranks"]) < ranks and time.time() < deadline:
            time.sleep(0.5)
        cmd = [sys.executable, "-m", "eepctl", "status", "--name", name, "-o", "json"]
        t_fast, res = timed(cmd, runs, env, "light")
        snap = json.loads([ln for ln in res.stdout.splitlines() if ln.strip()][-1])
        assert res.returncode == 0 and len(snap["ranks"]) == ranks, (res.returncode, res.stderr[-500:])
        t_ray, res = timed(cmd, runs, dict(env, EEPCTL_READ_PATH="ray"), "ray")
        assert res.returncode == 0, res.stderr[-500:]
        t_watch = watch_refresh(address, ns, name, runs)
        t_snap = []
        for _ in range(runs):
            t0 = time.perf_counter()
            ray.get(registry.snapshot.remote())
            t_snap.append(time.perf_counter() - t0)
        lines += [
            row(f"eepctl status -o json, light path ({ranks} ranks)", t_fast),
            row("  CPU seconds of that process", _CPU["light"]),
            row(f"eepctl status -o json, Ray driver ({ranks} ranks)", t_ray),
            row("  CPU seconds of that process", _CPU["ray"]),
            row(f"status --watch refresh, light path ({ranks} ranks)", t_watch),
            row(f"registry.snapshot() round trip in-driver ({ranks})", t_snap),
        ]
        if ray_list:
            ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
            t_list, lres = timed([ray_bin, "list", "actors", "--format", "json", "--limit", "10000"], runs, env)
            lines.append(row("ray list actors" + ("" if lres.returncode == 0 else " (FAILED)"), t_list))
        sent = rep.sent
    ray.kill(registry, no_restart=True)
    print(
        f"ranks registered: {len(snap['ranks'])}; status reports pushed during the run: {sent}; "
        f"snapshot JSON {len(res.stdout) / 1e6:.1f} MB"
    )
    print(f"{'command':<52} {'runs':>4} {'min':>7} {'median':>7} {'max':>7}")
    print("\n".join(lines))
    target = 0.3 if ranks <= 256 else 1.0
    med = statistics.median(t_fast)
    print(
        f"light path median {med:.3f}s wall, {statistics.median(_CPU['light']):.3f}s CPU vs target {target:.1f}s: "
        f"{'MET' if med <= target else 'MISSED'}; "
        f"Ray driver path / light path: {statistics.median(t_ray) / med:.1f}x; "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n"
    )
    return {"ranks": ranks, "light_s": med, "ray_s": statistics.median(t_ray)}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sizes = [int(x) for x in (args[0] if args else "256,4096").split(",")]
    runs = int(args[1]) if len(args) > 1 else 7
    ray_list = "--ray-list" in sys.argv
    if ray_list:
        os.environ["EEP_BENCH_DASHBOARD"] = "1"
    pgid, address = start_head()
    env = dict(os.environ, RAY_ADDRESS=address, NO_COLOR="1")
    try:
        import ray

        ray.init(address=address, namespace="eepctl", logging_level="ERROR", log_to_driver=False)
        for ranks in sizes:
            bench(address, env, ranks, runs, ray_list)
    finally:
        try:
            import ray

            ray.shutdown()
        finally:
            stop_group(pgid)


if __name__ == "__main__":
    main()
