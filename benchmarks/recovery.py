"""Recovery: SIGKILL one rank of a DP-3 deployment under load, against a cold restart.

Reports, for the self-healing path (policy ``shrink``): the time from the kill to the first
completed request on the recovered deployment, the serving pause (longest gap between
completions of a sequential probe), failed and re-routed requests, wrong outputs (oracle).
Then, in the same run, a cold restart (``down`` + ``up`` + first completion, timed as one span).

Usage: .venv/bin/python benchmarks/recovery.py [--rate 4] [--address HOST:PORT]
Without --address it starts a local Ray head (own process group, own state dir) and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENGINE = {
    "num_experts": 8,
    "slots_per_rank": 6,
    "top_k": 2,
    "num_layers": 2,
    "hidden_size": 64,
    "max_num_seqs": 8,
    "max_num_tokens": 64,
    "dtype": "float64",
    "seed": 0,
    "capture_sizes": [1, 2, 4, 8],
}
PROBE = [5, 6, 7]


class Probe:
    """One request at a time, back to back: the completion times show when serving pauses."""

    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress
        self.done: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                res = ray.get(self.ingress.generate.remote(PROBE, 1), timeout=120)
                if res.get("error"):
                    self.errors += 1
                else:
                    self.done.append(time.time())
            except Exception:  # noqa: BLE001 - counted, the probe goes on
                self.errors += 1
                time.sleep(0.05)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(130)


def _ingress(t: Any) -> Any:
    """Requests enter the deployment's ingress (the controller is not on their path)."""
    from engine_ext.ray.deployment import actor
    from engine_ext.ray.names import ingress_name

    return actor(ingress_name(t.name, 0), t.namespace)


def _wait_serving(core: Any, t: Any, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        s = core.status(t)
        live = [r for r in s["ranks"] if r["state"] == "serving" and r["dp_size"] == n]
        if len(live) == n and not s.get("operation"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"not {n} ranks serving after {timeout_s:.0f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--address", default=None)
    ap.add_argument("--name", default="bench-recovery")
    args = ap.parse_args()
    from eepctl import cluster, core
    from engine_ext.config import EngineConfig
    from engine_ext.model.dense_oracle import reference_generate

    started = None
    if args.address is None:
        os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-recovery-"))
        started = cluster.start_local(num_cpus=16)
        args.address = started["address"]
    t = core.Target(address=args.address, name=args.name)
    out: dict[str, Any] = {}
    try:
        core.up(
            t,
            dp=3,
            max_dp=4,
            engine=ENGINE,
            cpus_per_rank=1.0,
            gpus_per_rank=0.0,
            timeout_s=300,
            on_rank_failure="shrink",
        )
        _wait_serving(core, t, 3)
        victim = next(r for r in core.status(t)["ranks"] if r["rank"] == 1)
        load: dict[str, Any] = {}
        loader = threading.Thread(
            target=lambda: load.update(core.load(t, core.DEFAULT_PROMPTS, 8, args.rate, 12.0, timeout_s=300))
        )
        with Probe(_ingress(t)) as probe:
            loader.start()
            time.sleep(3.0)
            t_kill = time.time()
            os.kill(int(victim["pid"]), signal.SIGKILL)
            _wait_serving(core, t, 2)
            loader.join(300)
        after = [d for d in probe.done if d > t_kill]
        gaps = [b - a for a, b in zip(probe.done, probe.done[1:])]
        cfg = EngineConfig(**ENGINE)
        ref = {i: reference_generate(cfg, [p], 8)[0]["output"] for i, p in enumerate(load["prompts"])}
        wrong = sum(1 for r in load["records"] if not r["error"] and r["output"] != ref[r["prompt_index"]])
        ops = [o for o in core.events(t)["operations"] if o.get("kind") == "recover"]
        out["self_heal"] = {
            "kill_to_first_completion_s": round(after[0] - t_kill, 3) if after else None,
            "serving_pause_s": round(max(gaps), 3) if gaps else None,
            "requests": load["sent"],
            "failed": load["failed"],
            "wrong": wrong,
            "rerouted": ops[-1].get("rerouted_requests") if ops else None,
            "recover_phases_s": ops[-1].get("phase_durations") if ops else None,
            "probe_errors": probe.errors,
        }
        # Cold restart: down + up + the first completion, one span.
        t0 = time.time()
        core.down(t, stop_cluster=False)
        core.up(t, dp=3, max_dp=4, engine=ENGINE, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300)
        core.generate(t, [PROBE], 1, 120)
        cold = time.time() - t0
        out["cold_restart_s"] = round(cold, 3)
        heal = out["self_heal"]["kill_to_first_completion_s"]
        out["ratio_to_cold_restart"] = round(heal / cold, 3) if heal else None
    finally:
        try:
            core.down(t, stop_cluster=False)
        except Exception:  # noqa: BLE001
            pass
        if started is not None:
            cluster.stop_process_group(int(started["pgid"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
