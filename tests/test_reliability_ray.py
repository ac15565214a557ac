"""Reliability on a real local Ray cluster: status with 256 ranks registered, the registry killed
and recreated while serving (a rank killed while serving: tests/test_selfheal_ray.py).

Deployments are real (Ray actors, gloo groups) and torn down by name after each test; the only
processes killed are the registry actor and the rank process of a deployment this test created.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from typing import Any

import pytest

from engine_ext.protocol import RankState, RankStatus, to_builtins
from engine_ext.ray.ray_private import actor_id
from tests.helpers import (
    NAMESPACE,
    ROOT,
    check_load,
    eepctl,
    eepctl_json,
    events,
    last_json,
    scale_json,
    serving_view,
    stop_sending,
    up_cli,
    wait_for,
    wait_serving_load,
)

pytestmark = pytest.mark.ray


def _rank_status(deployment: str, rank: int, dp: int, rng: random.Random) -> dict[str, Any]:
    """A serving rank's status with varied load figures, as a RankActor reports it."""
    iid = f"{deployment}_dp{rank}"
    return to_builtins(
        RankStatus(
            deployment=deployment,
            rank=rank,
            instance_id=iid,
            engine_id=iid,
            node=f"node-{rank // 8}",
            pid=100000 + rank,
            state=RankState.SERVING.value,
            dp_size=dp,
            requests_running=rng.randint(0, 8),
            slots_total=8,
            kv_blocks_used=rng.randint(1, 127),
            kv_blocks_total=128,
            workspace_bytes=1 << 20,
            workspace_locked=True,
            workspace_required_bytes=1 << 20,
            graphs_captured=rng.randint(1, 4),
            capture_sizes=[1, 2, 4, 8],
            last_heartbeat=time.time(),
        )
    )


def _driver(ray_cluster) -> None:
    from eepctl import cluster

    cluster.connect(ray_cluster["address"], NAMESPACE)


# ---- status at scale --------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_status_with_256_ranks_is_whole(ray_cluster):
    """256 synthetic ranks reported through the registry's real intake; `eepctl status -o json`
    (a real CLI process) lists every one with every RankStatus field. Timing: benchmarks/status_at_scale.py."""
    import ray
    from engine_ext.ray.names import registry_name
    from engine_ext.ray.registry import Registry

    _driver(ray_cluster)
    name, n = "scale-256", 256
    reg = (
        ray.remote(Registry)
        .options(name=registry_name(name), namespace=NAMESPACE, lifetime="detached", num_cpus=0)
        .remote(name)
    )
    try:
        ray.get(reg.set_info.remote({"dp": n, "max_dp": n}))
        rng = random.Random(0)
        sent = {r: _rank_status(name, r, n, rng) for r in range(n)}
        acks = ray.get([reg.report_status.remote(st) for st in sent.values()])
        assert all(a["accepted"] for a in acks), [a for a in acks if not a["accepted"]][:3]
        t0 = time.perf_counter()
        snap = eepctl_json("status", "--name", name, timeout=60)
        wall = time.perf_counter() - t0
        ranks = snap["ranks"]
        assert sorted(r["rank"] for r in ranks) == list(range(n))
        assert snap["summary"]["ranks"] == n
        want = set(RankStatus.__struct_fields__)
        for r in ranks:
            missing = want - set(r)
            assert not missing, (r["rank"], missing)
            src = sent[r["rank"]]
            for k in ("instance_id", "requests_running", "kv_blocks_used", "workspace_bytes", "graphs_captured"):
                assert r[k] == src[k], (r["rank"], k, r[k], src[k])
        assert snap["summary"]["requests_running"] == sum(s["requests_running"] for s in sent.values())
        print(f"\n[status-256] eepctl status -o json with {n} ranks: {wall:.3f}s wall (one run, not a benchmark)")
    finally:
        ray.kill(reg, no_restart=True)


# ---- the registry killed and recreated while serving ----------------------------------------------------
@pytest.mark.timeout(360)
def test_registry_killed_and_recreated_while_serving(deployments, ray_cluster):
    import ray
    from engine_ext.ray.names import registry_name

    d = deployments("rel-registry")
    up_cli(d, 1, 4)
    op = scale_json(d.name, 2)
    assert op["state"] == "succeeded", op
    before = serving_view(d.name, 2)
    cfg_d = before["info"]["config"]
    held = wait_for(
        lambda: (
            [e for e in events(d.name, op["op_id"])["events"] if e["rank"] >= 0 and e["phase"] == "warm"]
            if len({e["rank"] for e in events(d.name, op["op_id"])["events"] if e["rank"] >= 0}) == 2
            else None
        ),
        timeout=15,
        what="rank events of the scale",
    )
    keys_before = {(e["op_id"], e["rank"], e["phase"], round(e["start"], 6)) for e in events(d.name)["events"]}

    load = d.popen("generate", "--name", d.name, "--rate", "4", "--duration", "20", "-o", "json")
    wait_serving_load(d.name)
    _driver(ray_cluster)
    old = ray.get_actor(registry_name(d.name), namespace=NAMESPACE)
    old_id = actor_id(old)
    ray.kill(old, no_restart=True)
    t_kill = time.time()

    def whole():
        try:
            h = ray.get_actor(registry_name(d.name), namespace=NAMESPACE)
        except ValueError:
            return None
        if actor_id(h) == old_id:
            return None
        res = eepctl("status", "--name", d.name, "-o", "json", timeout=60)
        if res.returncode != 0:
            return None
        s = last_json(res.stdout)
        ranks = s["ranks"]
        if sorted(r["rank"] for r in ranks) == [0, 1] and all(r["state"] == "serving" for r in ranks):
            return s
        return None

    snap = wait_for(whole, timeout=30, interval=0.5, what="a new registry with ranks 0..1 serving")
    recovered_s = time.time() - t_kill
    assert snap["info"]["config"] == cfg_d and snap["info"]["max_dp"] == 4, snap["info"]
    assert snap["violations"] == [], snap["violations"]

    def history_back():
        data = events(d.name)
        keys = {(e["op_id"], e["rank"], e["phase"], round(e["start"], 6)) for e in data["events"]}
        ops = [o for o in data["operations"] if o["op_id"] == op["op_id"]]
        return (keys, ops) if keys_before <= keys and ops else None

    keys_after, ops = wait_for(history_back, timeout=15, interval=0.5, what="operation history and rank events re-sent")
    assert ops[0]["state"] == "succeeded" and ops[0]["to_size"] == 2, ops[0]
    # The warm events the old registry held (waited for above) came back into the new one.
    assert {(e["op_id"], e["rank"], e["phase"], round(e["start"], 6)) for e in held} <= keys_after

    stop_sending(load)
    out, err = load.communicate(timeout=240)
    assert load.returncode == 0, err[-2000:]
    result = last_json(out)
    check_load(result, cfg_d)
    print(
        f"\n[registry-kill] status whole again {recovered_s:.1f}s after the kill; {len(keys_before)} events "
        f"before, {len(keys_after)} after; load sent {result['sent']} failed {result['failed']}"
    )


# ---- a rank process killed while serving: see tests/test_selfheal_ray.py (the deployment recovers) ----


# ---- soak (CI size) ------------------------------------------------------------------------------------
@pytest.mark.timeout(540)
def test_soak_random_transitions_under_load(ray_cluster):
    """benchmarks/soak.py at CI size, run as the script it is against the session's cluster: 5
    random transitions between DP 1 and 4 under continuous load; zero failed or wrong (oracle)
    requests, whole after every transition (longer soaks: the script itself, docs/benchmarks.md)."""
    name = "rel-soak"
    try:
        res = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "soak.py"),
                "--transitions",
                "5",
                "--seed",
                "7",
                "--rate",
                "4",
                "--address",
                ray_cluster["address"],
                "--name",
                name,
            ],
            capture_output=True,
            text=True,
            timeout=520,
            cwd=ROOT,
        )
    finally:
        eepctl("down", "--name", name, timeout=120)  # when the script died before its own down
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"soak printed no result (exit {res.returncode}): {res.stderr[-3000:]}"
    out = json.loads(lines[-1])
    print(
        f"\n[soak] {out['transitions']} transitions in {out['elapsed_s']}s, {out['requests']} requests "
        f"({out['moved']} moved), latency {out['latency_s']}, transition {out['transition_s']}"
    )
    assert res.returncode == 0, (out, res.stderr[-2000:])
    assert out["transitions"] == 5
    assert not out["load_errors"], out["load_errors"]
    assert out["failed"] == 0, out["first_failures"]
    assert out["wrong"] == 0
    assert out["requests"] >= 20, out["requests"]
