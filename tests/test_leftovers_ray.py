"""What a deployment owns on Ray is found from Ray's state, not from a controller's memory (issue
36): a restarted controller removes every rank actor and placement group no member holds, a
launch that finds its names taken by a stale resource of the deployment removes it and goes on,
and `eepctl down` removes everything with no controller at all; a second `down` changes nothing."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.helpers import NAMESPACE, SMALL_ENGINE, eepctl, eepctl_json, oracle, wait_for

pytestmark = pytest.mark.ray


def _stale(name: str, actor_name: str | None = None, pg_name: str | None = None) -> None:
    """A detached actor and/or placement group under names of the deployment that no member holds
    (what a controller killed mid-launch leaves)."""
    import ray
    from ray.util.placement_group import placement_group

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
    core.up(core.Target(name=d.name, namespace=NAMESPACE), dp=1, max_dp=2, engine=SMALL_ENGINE, cpus_per_rank=1.0,
            gpus_per_rank=0.0, timeout_s=300, health_deadline_s=3.0)
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

    # A restarted controller removes what no member holds, standbys' names included (the loop's
    # sweep leaves those alone: the pool may be launching one), found by name from Ray's state.
    _stale(d.name, actor_name=f"{d.name}_standby9", pg_name=f"{d.name}_standby9-pg")
    _kill_controller(d.name)

    def took_over() -> list[str] | None:
        res = eepctl("status", "--name", d.name, "-o", "json", timeout=60)
        control = (json.loads(res.stdout.splitlines()[-1])["info"].get("control") if res.returncode == 0 else None) or {}
        return control.get("took_over") if control.get("controller_restarts") else None

    actions = wait_for(took_over, timeout=90, interval=0.5, what="the take-over")
    assert any(f"actor {d.name}_standby9" in a and f"placement group {d.name}_standby9-pg" in a for a in actions), actions
    wait_for(lambda: _owned(d.name) == member, timeout=30, what="only the member's resources left")
    gen = eepctl_json("generate", "--name", d.name, timeout=90)
    cfg_d = dict(SMALL_ENGINE, instance_id=d.name)
    assert all(r["error"] is None and r["output"] == oracle(cfg_d, r["prompt"]) for r in gen["results"]), gen

    # No controller at all (and no registry): `down` still removes every resource of the
    # deployment, leftovers included; a second `down` finds nothing and changes nothing.
    _stale(d.name, actor_name=f"{d.name}_dp7", pg_name=f"{d.name}_dp5-pg")
    for n in (controller_name(d.name), registry_name(d.name)):
        ray.kill(ray.get_actor(n, namespace=NAMESPACE), no_restart=True)
    wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["name"] in (controller_name(d.name), registry_name(d.name))], timeout=30,
             what="the control actors gone")
    res = eepctl("down", "--name", d.name, "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    removed = json.loads(res.stdout.splitlines()[-1])["removed_by_name"]
    assert sorted(removed) == sorted([f"actor {d.name}_dp0", f"actor {d.name}_dp7", f"placement group {d.name}_dp0-pg",
                                      f"placement group {d.name}_dp5-pg"]), removed
    assert _owned(d.name) == [] and DurableState(NAMESPACE, d.name).load() is None
    again = eepctl("down", "--name", d.name, timeout=120)
    assert again.returncode == 3 and "not found" in again.stderr, (again.returncode, again.stderr)
    assert _owned(d.name) == []
