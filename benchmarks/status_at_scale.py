"""`eepctl status -o json` with 256 ranks registered, side by side with `ray list actors`.

What is measured is the registry and the CLI, so the ranks are synthetic: reporter threads in
this driver push a realistic RankStatus for each of ranks 0..N-1 about once a second through
``Registry.report_status`` (the same call a RankActor makes), while the CLI is timed as a whole
process (median of RUNS).

The benchmark starts its own local Ray head (eepctl's start_local: own process group, with the
dashboard, since `ray list actors` needs the state API it serves) and stops it by that group at
the end. `ray.util.list_named_actors` from a fresh Python driver is timed as well.

Usage: .venv/bin/python benchmarks/status_at_scale.py [ranks=256] [runs=9]
"""

from __future__ import annotations

import json
import os
import random
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
    st = to_builtins(RankStatus(
        deployment=deployment, rank=rank, instance_id=iid, engine_id=iid, node=f"node-{rank // 8}/10.0.{rank // 8}.1",
        pid=100000 + rank, device="cpu", state=RankState.SERVING.value, dp_size=dp,
        requests_running=rng.randint(0, 8), requests_waiting=rng.randint(0, 4), slots_used=rng.randint(0, 8),
        slots_total=8, kv_blocks_used=rng.randint(1, 127), kv_blocks_total=128, workspace_bytes=1 << 20,
        workspace_locked=True, workspace_required_bytes=1 << 20, graphs_captured=4, capture_sizes=[1, 2, 4, 8],
        graph_replays=rng.randint(0, 10 ** 6), last_capture_s=0.05, captures_this_op=1, current_op="",
        eplb_step=rng.randint(0, 1000), eplb_imbalance=round(rng.random(), 3), physical_experts=8,
        logical_experts=8, steps=rng.randint(0, 10 ** 6), last_heartbeat=time.time(),
    ))
    st["stale_replays_refused"] = 0
    st["eplb_logical_load"] = [rng.random() for _ in range(8)]
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

    info = cluster.start_local(num_cpus=num_cpus, dashboard=True)  # `ray list actors` needs it
    return int(info["pgid"]), info["address"]


def stop_group(pgid: int) -> None:
    from eepctl import cluster

    cluster.stop_process_group(pgid)


def timed(cmd: list[str], runs: int, env: dict[str, str]) -> tuple[list[float], subprocess.CompletedProcess]:
    last = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)  # warm-up
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        last = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        out.append(time.perf_counter() - t0)
    return out, last


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    name, ns = "scale-bench", "eepctl"
    pgid, address = start_head()
    env = dict(os.environ, RAY_ADDRESS=address, NO_COLOR="1")
    try:
        import ray

        from engine_ext.ray.names import registry_name
        from engine_ext.ray.registry import Registry

        ray.init(address=address, namespace=ns, logging_level="ERROR", log_to_driver=False)
        registry = ray.remote(Registry).options(name=registry_name(name), namespace=ns, lifetime="detached",
                                                num_cpus=0).remote(name)
        ray.get(registry.set_info.remote({"dp": ranks, "max_dp": ranks}))
        with Reporters(registry, name, ranks) as rep:
            deadline = time.time() + 30
            while len(ray.get(registry.snapshot.remote())["ranks"]) < ranks and time.time() < deadline:
                time.sleep(0.2)
            t_status, res = timed([sys.executable, "-m", "eepctl", "status", "--name", name, "-o", "json"], runs, env)
            snap = json.loads([ln for ln in res.stdout.splitlines() if ln.strip()][-1])
            assert res.returncode == 0 and len(snap["ranks"]) == ranks, (res.returncode, res.stderr[-500:])
            ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
            t_list, lres = timed([ray_bin, "list", "actors", "--format", "json", "--limit", "10000"],
                                 runs, env)
            list_ok = lres.returncode == 0
            t_named, _ = timed([sys.executable, "-c", "import ray; ray.init(address='auto', logging_level='ERROR', "
                                "log_to_driver=False); print(len(ray.util.list_named_actors(all_namespaces=True)))"],
                               runs, env)
            t_snap = []
            for _ in range(runs):
                t0 = time.perf_counter()
                ray.get(registry.snapshot.remote())
                t_snap.append(time.perf_counter() - t0)
            sent = rep.sent
        ray.kill(registry, no_restart=True)
        med_s, med_l, med_n = statistics.median(t_status), statistics.median(t_list), statistics.median(t_named)
        print(f"ranks registered: {len(snap['ranks'])}; status reports pushed during the run: {sent}")
        print(f"{'command':<44} {'runs':>4} {'min':>7} {'median':>7} {'max':>7}")
        print(f"{'eepctl status -o json (256 ranks)':<44} {runs:>4} {min(t_status):>6.3f}s {med_s:>6.3f}s "
              f"{max(t_status):>6.3f}s")
        label = "ray list actors" + ("" if list_ok else f" (FAILED rc={lres.returncode})")
        print(f"{label:<44} {runs:>4} {min(t_list):>6.3f}s {med_l:>6.3f}s {max(t_list):>6.3f}s")
        print(f"{'python: ray.util.list_named_actors':<44} {runs:>4} {min(t_named):>6.3f}s {med_n:>6.3f}s "
              f"{max(t_named):>6.3f}s")
        print(f"{'registry.snapshot() round trip (in-driver)':<44} {runs:>4} {min(t_snap):>6.3f}s "
              f"{statistics.median(t_snap):>6.3f}s {max(t_snap):>6.3f}s")
        print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        print(f"ratio status / ray list actors: {med_s / med_l:.2f}; status / list_named_actors: {med_s / med_n:.2f}; "
              f"status < 1 s: {med_s < 1.0}")
        if not list_ok:
            print("ray list actors stderr:", lres.stderr.strip()[-400:])
    finally:
        try:
            import ray

            ray.shutdown()
        finally:
            stop_group(pgid)


if __name__ == "__main__":
    main()
