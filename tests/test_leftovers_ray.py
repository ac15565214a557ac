"""What a deployment owns on Ray is found from Ray's state, not from a controller's memory (issue
36): a restarted controller removes every rank actor and placement group no member holds, a
launch that finds its names taken by a stale resource of the deployment removes it and goes on,
and `eepctl down` removes everything with no controller at all; a second `down` changes nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from tests.helpers import NAMESPACE, SMALL_ENGINE, eepctl, eepctl_json, oracle, wait_for

pytestmark = pytest.mark.ray


def _stale(name: str, actor_name: str | None = None, pg_name: str | None = None) -> None:
    """A detached actor and/or placement group under names of the deployment that no member holds
    (what a controller killed mid-launch leaves)."""
    from ray.util.placement_group import placement_group

    import ray

    if pg_name:
        pg = placement_group([{"CPU": 0.01}], name=pg_name, lifetime="detached")
        ray.get(pg.ready(), timeout=30)
    if actor_name:

        @ray.remote(num_cpus=0)
        class Leftover:
            def ping(self) -> int:
                return 1

        h = Leftover.options(name=actor_name, namespace=NAMESPACE, lifetime="detached").remote()
        ray.get(h.ping.remote(), timeout=30)


def _owned(name: str) -> list[str]:
    from engine_ext.ray.leftovers import owned

    return sorted(owned(NAMESPACE, name).names())


NOISE = 1000


def _noise() -> tuple[list, list]:
    """1,000 placement groups of no one's (0.001 CPU each) in the deployment's namespace and 1,000
    named actors in ten other namespaces (detached, asking for a resource no node has: they stay
    pending, so they cost Ray a record each and no process)."""
    from ray.util.placement_group import placement_group

    import ray

    pgs = [placement_group([{"CPU": 0.001}], name=f"noise{i}-pg") for i in range(NOISE)]
    ray.get([pg.ready() for pg in pgs], timeout=300)

    @ray.remote(num_cpus=0, resources={"nowhere": 1})
    class Pending:
        pass

    actors = [
        Pending.options(name=f"noise{i}", namespace=f"noise-{i % 10}", lifetime="detached").remote()
        for i in range(NOISE)
    ]
    return pgs, actors


def _a_crowded_cluster_costs_the_loop_nothing(name: str) -> None:
    """The controller's sweep for orphans looks at the deployment's names only (its namespace's
    named actors, their placement groups by name), never Ray's whole placement group table or
    every namespace's actors, and runs in a thread: with 1,000 unrelated placement groups and
    1,000 unrelated actors in the cluster, an orphaned DP rank is still found, and every tick the
    controller records (sweeps included) stays within the loop's period."""
    from ray.util.placement_group import remove_placement_group

    import ray
    from engine_ext.ray import leftovers
    from engine_ext.ray.names import controller_name

    pgs, actors = _noise()
    try:
        controller = ray.get_actor(controller_name(name), namespace=NAMESPACE)
        since = ray.get(controller.tick_record.remote(), timeout=30)["ticks"]
        # The sweep's lookups, in this process, with the whole-cluster reads made to fail.
        util, table, listed = ray.util, ray.util.placement_group_table, ray.util.list_named_actors

        def scoped_list(all_namespaces: bool = False) -> list:
            assert not all_namespaces, "the sweep listed every namespace's actors"
            return listed(all_namespaces)

        def no_table(*_: object) -> dict:
            raise AssertionError("the sweep read the whole placement group table")

        util.placement_group_table, util.list_named_actors = no_table, scoped_list
        try:
            found = leftovers.owned(NAMESPACE, name, everything=False)
        finally:
            util.placement_group_table, util.list_named_actors = table, listed
        assert found.names() == {f"{name}_dp0", f"{name}_dp0-pg"}, found
        record = wait_for(
            lambda: (r := ray.get(controller.tick_record.remote(), timeout=30))["ticks"] >= since + 12 and r,
            timeout=120,
            what="12 ticks (two sweeps) of the controller in the crowded cluster",
        )
        ticks = record["tick_s"][-(record["ticks"] - since) :]
        print(
            f"\n[leftovers] {NOISE} placement groups + {NOISE} actors of no one's: {len(ticks)} ticks, "
            f"max {max(ticks) * 1000:.0f} ms, median {sorted(ticks)[len(ticks) // 2] * 1000:.0f} ms "
            f"(period {record['period_s']:.1f} s)"
        )
        assert max(ticks) < record["period_s"], ticks
    finally:
        for pg in pgs:
            remove_placement_group(pg)
        for a in actors:
            ray.kill(a, no_restart=True)


def _kill_controller(name: str) -> int:
    import ray
    from engine_ext.ray.names import controller_name

    pid = int(ray.get(ray.get_actor(controller_name(name), namespace=NAMESPACE).pid.remote(), timeout=30))
    os.kill(pid, signal.SIGKILL)  # this test's own deployment's controller actor
    return pid


@pytest.mark.timeout(300)
def test_take_over_launch_and_down_remove_what_no_member_holds(deployments, ray_cluster):
    import ray
    from eepctl import cluster, core
    from engine_ext.ray.durable import DurableState
    from engine_ext.ray.names import controller_name, registry_name

    d = deployments("lo")
    if ray.is_initialized():
        ray.shutdown()
    core.up(
        core.Target(name=d.name, namespace=NAMESPACE),
        dp=1,
        max_dp=2,
        engine=SMALL_ENGINE,
        cpus_per_rank=1.0,
        gpus_per_rank=0.0,
        timeout_s=300,
        health_deadline_s=3.0,
    )
    cluster.connect(ray_cluster["address"], NAMESPACE)
    member = [f"{d.name}_dp0", f"{d.name}_dp0-pg"]
    assert _owned(d.name) == member

    # A launch whose names a stale reservation holds removes it and goes on (before: "Failed to
    # create placement group ... because name 'lo_dp1-pg' already exists", every time).
    _stale(d.name, pg_name=f"{d.name}_dp1-pg")
    up = eepctl_json("scale", "--dp", "2", "--name", d.name, timeout=300)
    assert up["state"] == "succeeded", up
    assert _owned(d.name) == sorted(member + [f"{d.name}_dp1", f"{d.name}_dp1-pg"])
    assert eepctl_json("scale", "--dp", "1", "--name", d.name, "--retire", "1", timeout=300)["state"] == "succeeded"
    _a_crowded_cluster_costs_the_loop_nothing(d.name)

    # A restarted controller removes what no member holds, standbys' names included (the loop's
    # sweep leaves those alone: the pool may be launching one), found by name from Ray's state.
    _stale(d.name, actor_name=f"{d.name}_standby9", pg_name=f"{d.name}_standby9-pg")
    _kill_controller(d.name)

    def took_over() -> list[str] | None:
        res = eepctl("status", "--name", d.name, "-o", "json", timeout=60)
        if res.returncode != 0:
            return None
        control = json.loads(res.stdout.splitlines()[-1])["info"].get("control") or {}
        return control.get("took_over") if control.get("controller_restarts") else None

    actions = wait_for(took_over, timeout=90, interval=0.5, what="the take-over")
    standby9 = (f"actor {d.name}_standby9", f"placement group {d.name}_standby9-pg")
    assert any(all(s in a for s in standby9) for a in actions), actions
    wait_for(lambda: _owned(d.name) == member, timeout=30, what="only the member's resources left")
    gen = eepctl_json("generate", "--name", d.name, timeout=90)
    cfg_d = dict(SMALL_ENGINE, instance_id=d.name)
    assert all(r["error"] is None and r["output"] == oracle(cfg_d, r["prompt"]) for r in gen["results"]), gen

    # No controller at all (and no registry): `down` still removes every resource of the
    # deployment, leftovers included; a second `down` finds nothing and changes nothing.
    for n in (controller_name(d.name), registry_name(d.name)):
        ray.kill(ray.get_actor(n, namespace=NAMESPACE), no_restart=True)
    wait_for(
        lambda: (
            not [
                a
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"] in (controller_name(d.name), registry_name(d.name))
            ]
        ),
        timeout=30,
        what="the control actors gone",
    )
    _stale(d.name, actor_name=f"{d.name}_dp7", pg_name=f"{d.name}_dp5-pg")  # made now: no sweep ends them
    res = eepctl("down", "--name", d.name, "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    removed = json.loads(res.stdout.splitlines()[-1])["removed_by_name"]
    assert sorted(removed) == sorted(
        [
            f"actor {d.name}_dp0",
            f"actor {d.name}_dp7",
            f"placement group {d.name}_dp0-pg",
            f"placement group {d.name}_dp5-pg",
        ]
    ), removed
    assert _owned(d.name) == [] and DurableState(NAMESPACE, d.name).load() is None
    again = eepctl("down", "--name", d.name, timeout=120)
    assert again.returncode == 3 and "not found" in again.stderr, (again.returncode, again.stderr)
    assert _owned(d.name) == []


# A child that makes a segment as vLLM's message queues do (multiprocessing.shared_memory) and waits.
SHM_CHILD = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(seg._name, "shared_memory")  # as a killed process's tracker would never unlink it
print(seg.name, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_repair_of_a_vllm_deployment_removes_orphaned_shared_memory(ray_cluster):
    """`eepctl repair` on a vLLM deployment first removes, on every node, the shared-memory
    segments killed processes left (vLLM's queues: engine_ext.shm_orphans says which count), then
    asks vLLM for its recovery. No vLLM server runs here (vLLM servers are the vLLM lane's): the
    deployment's API server does not answer, so the repair fails as unreachable (exit 3) after the
    sweep, and what it removed rides in the error's detail. A live process's segment stays."""
    import subprocess
    import sys
    import time

    import ray
    from eepctl import cluster
    from engine_ext.drivers.vllm import VllmDriver
    from engine_ext.protocol import UnreachableError

    if not ray.is_initialized():
        cluster.connect(ray_cluster["address"], NAMESPACE)
    dead, live = (
        subprocess.Popen([sys.executable, "-c", SHM_CHILD], stdout=subprocess.PIPE, text=True) for _ in range(2)
    )
    names: list[str] = []
    try:
        names += [p.stdout.readline().strip() for p in (dead, live)]  # type: ignore[union-attr]
        dead.kill()  # SIGKILL: nothing unlinks its segment
        dead.wait(30)
        time.sleep(6.0)  # older than engine_ext.shm_orphans.MIN_AGE_S
        snap = {"deployment": "vllm-gone", "info": {"api_url": "http://127.0.0.1:9"}, "ranks": []}
        with pytest.raises(UnreachableError) as err:
            VllmDriver(None, snap).repair(timeout_s=10)
        removed = err.value.detail["shm_removed"]
        assert any(f"removed orphaned shared memory {names[0].lstrip('/')} (1 MiB)" in r for r in removed), removed
        assert not os.path.exists(f"/dev/shm/{names[0].lstrip('/')}")
        assert os.path.exists(f"/dev/shm/{names[1].lstrip('/')}")  # its maker lives and maps it
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(30)
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{n.lstrip('/')}")
