"""Soak: random transitions between DP 1 and 4 under continuous load.

Every request's output is compared with the dense oracle (model/dense_oracle.py, reference_generate); after
every transition the deployment must be whole (ranks 0..N-1 serving, no running operation, no
invariant violation) and answer a request. Zero failed, zero wrong, zero wedged is the pass.

Usage: .venv/bin/python benchmarks/soak.py [--transitions 50] [--seed 0] [--rate 4] [--address HOST:PORT]
Without --address it starts a local Ray head (own process group, own state dir) and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENGINE = {
    "num_experts": 8,
    "slots_per_rank": 8,
    "top_k": 2,
    "num_layers": 2,
    "hidden_size": 64,
    "max_num_seqs": 8,
    "max_num_tokens": 64,
    "dtype": "float64",
    "seed": 0,
    "capture_sizes": [1, 2, 4, 8],
}
MAX_TOKENS = 8


class Load:
    """Continuous open-loop load from a thread, in chunks of eepctl.core.load."""

    def __init__(self, t: Any, rate: float, chunk_s: float = 8.0) -> None:
        self.t, self.rate, self.chunk_s = t, rate, chunk_s
        self.records: list[dict[str, Any]] = []
        self.prompts: list[list[int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._chunk = 0

    def _run(self) -> None:
        from eepctl import core

        while not self._stop.is_set():
            try:
                res = core.load(
                    self.t, core.DEFAULT_PROMPTS, MAX_TOKENS, self.rate, self.chunk_s, timeout_s=300, seed=self._chunk
                )
                self.prompts = res["prompts"]
                self.records.extend(res["records"])
            except Exception as e:  # noqa: BLE001 - reported, and fails the soak
                self.errors.append(f"{type(e).__name__}: {e}")
            self._chunk += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=self.chunk_s + 330)


def _whole(t: Any, n: int, timeout_s: float = 30.0) -> dict[str, Any]:
    from eepctl import core

    deadline = time.time() + timeout_s
    snap: dict[str, Any] = {}
    while time.time() < deadline:
        snap = core.status(t)
        ranks = snap["ranks"]
        if (
            sorted(r["rank"] for r in ranks) == list(range(n))
            and all(r["state"] == "serving" for r in ranks)
            and all(r["dp_size"] == n for r in ranks)
            and snap.get("operation") is None
        ):
            return snap
        time.sleep(0.3)
    raise AssertionError(
        f"wedged: not whole at DP {n} after {timeout_s:.0f}s: "
        f"{[(r['rank'], r['state'], r['dp_size']) for r in snap.get('ranks', [])]}, "
        f"operation {snap.get('operation')}"
    )


def run_soak(
    t: Any, transitions: int, seed: int = 0, rate: float = 4.0, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """On a running deployment at DP 1 (max DP >= 4): ``transitions`` random scales under load."""
    from eepctl import core
    from engine_ext.config import EngineConfig
    from engine_ext.model.dense_oracle import reference_generate

    rng = random.Random(seed)
    snap = _whole(t, 1)
    cfg = EngineConfig.from_dict(snap["info"]["config"])
    oracle = {tuple(p): list(reference_generate(cfg, [list(p)], MAX_TOKENS)[0]["output"]) for p in core.DEFAULT_PROMPTS}
    size, ops, t0 = 1, [], time.time()
    with Load(t, rate) as load:
        time.sleep(2.0)
        for i in range(transitions):
            target = rng.choice([n for n in (1, 2, 3, 4) if n != size])
            t1 = time.time()
            op = core.scale(t, target, drain_timeout_s=30, timeout_s=300, wait=True)
            assert op["state"] == "succeeded", op
            snap = _whole(t, target)
            assert snap["violations"] == [], snap["violations"]
            probe = core.generate(t, [core.DEFAULT_PROMPTS[i % len(core.DEFAULT_PROMPTS)]], MAX_TOKENS, 60)
            r = probe["results"][0]
            assert r["error"] is None and r["output"] == oracle[tuple(r["prompt"])], r
            ops.append(
                {
                    "op_id": op["op_id"],
                    "from": size,
                    "to": target,
                    "s": round(time.time() - t1, 2),
                    "pause_s": round(op.get("serving_pause_s", 0.0), 4),
                }
            )
            say(
                f"[soak] {i + 1}/{transitions} DP {size}->{target} in {ops[-1]['s']:.1f}s "
                f"(pause {ops[-1]['pause_s'] * 1000:.0f} ms); load records so far {len(load.records)}"
            )
            size = target
    failed = [r for r in load.records if r["error"]]
    wrong = [
        r for r in load.records if not r["error"] and r["output"] != oracle[tuple(load.prompts[r["prompt_index"]])]
    ]
    lat = sorted(r["latency_s"] for r in load.records if not r["error"] and r["latency_s"] is not None)
    return {
        "transitions": len(ops),
        "elapsed_s": round(time.time() - t0, 1),
        "requests": len(load.records),
        "failed": len(failed),
        "wrong": len(wrong),
        "load_errors": load.errors,
        "moved": sum(1 for r in load.records if r["moved_from"]),
        "latency_s": core.percentiles(lat),
        "transition_s": core.percentiles([o["s"] for o in ops]),
        "pause_s": core.percentiles([o["pause_s"] for o in ops]),
        "ops": ops,
        "first_failures": [r["error"] for r in failed[:3]],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transitions", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--address", default=None)
    ap.add_argument("--name", default="soak")
    args = ap.parse_args()
    from eepctl import cluster, core

    started = None
    if args.address is None:
        os.environ.setdefault("EEPCTL_STATE_DIR", tempfile.mkdtemp(prefix="eep-soak-"))
        started = cluster.start_local(num_cpus=16)
        args.address = started["address"]
    t = core.Target(address=args.address, name=args.name)
    try:
        core.up(t, dp=1, max_dp=4, engine=ENGINE, cpus_per_rank=1.0, gpus_per_rank=0.0, timeout_s=300)
        try:
            res = run_soak(t, args.transitions, args.seed, args.rate)
        finally:
            core.down(t, stop_cluster=False)
        print(json.dumps({k: v for k, v in res.items() if k != "ops"}))
        ok = res["failed"] == 0 and res["wrong"] == 0 and not res["load_errors"]
        print(
            f"soak {'PASSED' if ok else 'FAILED'}: {res['transitions']} transitions, {res['requests']} requests, "
            f"{res['failed']} failed, {res['wrong']} wrong, {res['elapsed_s']}s"
        )
        sys.exit(0 if ok else 1)
    finally:
        if started is not None:
            import ray

            ray.shutdown()
            cluster.stop_process_group(int(started["pgid"]))


if __name__ == "__main__":
    main()
