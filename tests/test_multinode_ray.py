"""Multi-node (issue 11): ranks on two real Ray nodes, one of them in a network namespace.

The cluster (tests/multinode.py) has the head on 10.213.0.1 and a second raylet inside a
namespace on 10.213.0.2. Hostnames here resolve to 127.0.0.1, so a rank that advertises its
hostname's address (gloo's default device) or a default-route guess for its store cannot be
reached from the other node: on the code before this issue, `up --dp 2` across the nodes fails in
gloo's connectFullMesh. The placement-policy tests at the top are pure (no Ray).
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from collections import Counter
from typing import Any

import pytest

from engine_ext.ray.placement import Node, PlacementError, after_pending, choose_nodes
from tests import multinode
from tests.helpers import (
    check_load,
    eepctl,
    eepctl_json,
    events,
    finish_load,
    json_lines,
    last_json,
    moved_off,
    oracle,
    owned_deployments,
    scale_json,
    serving_view,
    status,
    stop_sending,
    up_with_faults,
    wait_for,
    wait_held,
    wait_serving_load,
)

A, B, C = (Node("a" * 8, "10.0.0.1", 4, 0), Node("b" * 8, "10.0.0.2", 4, 0), Node("c" * 8, "10.0.0.3", 1, 0))


# ---- the policy, pure -------------------------------------------------------------------------------
def test_pack_fills_the_node_already_used_first():
    got = choose_nodes("pack", [A, B], Counter({B.node_id: 1}), 3, 1.0, 0.0)
    assert [n.node_id for n in got] == [B.node_id] * 3


def test_spread_balances_with_the_ranks_already_placed():
    got = choose_nodes("spread", [A, B, C], Counter({A.node_id: 2, B.node_id: 1}), 3, 1.0, 0.0)
    assert Counter(n.node_id for n in got) == Counter({C.node_id: 1, B.node_id: 1, A.node_id: 1})
    assert got[0] == C  # the emptiest node first


def test_strict_spread_refuses_more_ranks_than_free_nodes():
    assert {n.node_id for n in choose_nodes("strict-spread", [A, B], Counter(), 2, 1.0, 0.0)} == {A.node_id, B.node_id}
    with pytest.raises(
        PlacementError, match=r"one rank per node: 2 new rank\(s\) need 2 node\(s\).*2 alive node\(s\), 1 of them"
    ):
        choose_nodes("strict-spread", [A, B], Counter({A.node_id: 1}), 2, 1.0, 0.0)


def test_capacity_is_per_node():
    with pytest.raises(PlacementError, match=r"only 5 fit"):
        choose_nodes("spread", [A, C], Counter(), 6, 1.0, 0.0)
    with pytest.raises(PlacementError, match="GPU"):
        choose_nodes("pack", [A], Counter(), 1, 1.0, 1.0)


def test_pending_placement_groups_take_their_cpus_first():
    """Demand that waits already (a pinned bundle on its node, another on the freest node that fits
    it; one that fits nowhere takes nothing) is not counted as room for a new rank."""
    got = after_pending([A, B, C], [{"CPU": 3.0, "node:10.0.0.2": 0.001}, {"CPU": 2.0}, {"CPU": 9.0}])
    assert [(n.node_id, n.cpus) for n in got] == [(A.node_id, 2.0), (B.node_id, 1.0), (C.node_id, 1.0)]
    with pytest.raises(PlacementError, match=r"only 4 fit"):
        choose_nodes("spread", got, Counter(), 5, 1.0, 0.0)


# ---- a real two-node cluster ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    """The two-node Ray cluster; RAY_ADDRESS (and a state dir) point at it for this module only."""
    try:
        cl = multinode.start(num_cpus=6)
    except multinode.NamespaceRefused as e:
        pytest.skip(str(e))
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "EEPCTL_STATE_DIR")}
    os.environ["RAY_ADDRESS"] = cl.address
    os.environ["EEPCTL_STATE_DIR"] = str(tmp_path_factory.mktemp("eepctl-multinode-state"))
    try:
        yield cl
    finally:
        import ray

        # This process may be connected to the two-node cluster (tests that `up` in-process): a
        # driver whose cluster is gone is ended by Ray a minute later, with the whole test run.
        if ray.is_initialized():
            ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cl.stop()


@pytest.fixture
def md(two_nodes):
    with owned_deployments() as make:
        yield make


def nodes_of(snap: dict[str, Any]) -> dict[int, str]:
    """rank -> node IP, after checking each rank's node fields are Ray's and never loopback."""
    ids = {multinode.HEAD_IP: set(), multinode.WORKER_IP: set()}
    out = {}
    for r in snap["ranks"]:
        assert r["node_ip"] in ids, f"rank {r['rank']} advertises {r['node_ip']!r}, not a node IP"
        assert len(r["node_id"]) >= 8, r
        ids[r["node_ip"]].add(r["node_id"])
        out[r["rank"]] = r["node_ip"]
    assert all(len(v) <= 1 for v in ids.values()), f"one Ray node id per IP: {ids}"
    return out


def check_node_column(name: str, snap: dict[str, Any]) -> None:
    text = eepctl("status", "--name", name, timeout=60).stdout
    per_node = Counter()
    for r in snap["ranks"]:
        label = f"{r['node_id'][:8]}/{r['node_ip']}"
        per_node[label] += 1
        assert any(f"{r['instance_id']}" in ln and label in ln for ln in text.splitlines()), (label, text)
    want = ", ".join(f"{k} {v}" for k, v in sorted(per_node.items()))
    assert f"ranks per node: {want}" in text, text


@pytest.mark.ray
@pytest.mark.timeout(360)
def test_spread_over_two_nodes_and_scale_under_load(md):
    d = md("mn-spread")
    res = eepctl(
        "up",
        "--dp",
        "2",
        "--max-dp",
        "4",
        "--dtype",
        "float64",
        "--placement",
        "spread",
        "--name",
        d.name,
        "-o",
        "json",
        timeout=240,
    )
    assert res.returncode == 0, f"up exited {res.returncode}: {res.stderr[-3000:]}"
    snap = serving_view(d.name, 2)
    where = nodes_of(snap)
    assert sorted(where.values()) == sorted([multinode.HEAD_IP, multinode.WORKER_IP]), where
    check_node_column(d.name, snap)
    cfg_d = snap["info"]["config"]
    pids = {r["rank"]: r["pid"] for r in snap["ranks"]}

    plan = eepctl_json("scale", "--dp", "4", "--name", d.name, "--dry-run", timeout=60)
    predicted = {p["rank"]: p["node_ip"] for p in plan["placement"]["nodes"]}
    assert plan["placement"]["policy"] == "spread" and sorted(predicted) == [2, 3], plan["placement"]
    assert sorted(predicted.values()) == sorted([multinode.HEAD_IP, multinode.WORKER_IP]), predicted

    duration = 90
    load = d.popen("generate", "--name", d.name, "--rate", "2", "--duration", str(duration), "-o", "json")
    wait_serving_load(d.name)
    for n in (4, 3, 2):
        retire = ["--retire", str(n)] if n < 4 else []  # the last rank leaves: the checks below follow ranks 0..n-1
        op = eepctl_json("scale", "--dp", str(n), "--name", d.name, *retire, timeout=240)
        assert op.get("object") == "scale" and op["state"] == "succeeded", op
        snap = serving_view(d.name, n)
        now = nodes_of(snap)
        if n == 4:
            assert {r: now[r] for r in predicted} == predicted, "joiners did not land where --dry-run said"
        for r in range(n):  # survivors keep their node and process; identities are the suffixed names
            if r in where:
                assert now[r] == where[r], (r, now[r], where[r])
        for r in snap["ranks"]:
            assert r["instance_id"] == f"{d.name}_dp{r['rank']}" and r["dp_size"] == n, r
            if r["rank"] in pids:
                assert r["pid"] == pids[r["rank"]], f"rank {r['rank']} was restarted"
        per_node = Counter(now.values())
        assert set(per_node) == {multinode.HEAD_IP, multinode.WORKER_IP}, per_node
        assert max(per_node.values()) - min(per_node.values()) <= 1, f"spread is unbalanced: {per_node}"
        assert snap["violations"] == [], snap["violations"]
        check_node_column(d.name, snap)
        where = {**where, **now}
        pids = {r["rank"]: r["pid"] for r in snap["ranks"]}
    assert load.poll() is None, "the load ended before the sequence did: raise its duration"
    stop_sending(load)
    out, err = load.communicate(timeout=duration + 240)
    assert load.returncode == 0, f"load exited {load.returncode}: {err[-2000:]} {out[-3000:]}"
    result = last_json(out)
    assert result["stopped_early"] and result["sent"] >= 10, result["sent"]  # it ran through the sequence
    check_load(result, cfg_d)


def _transports(name: str, n: int) -> dict[int, tuple[str, str, int]]:
    """rank -> (node IP, transport, ranks that mapped its shared memory), once all ``n`` report a
    group of ``n`` (a heartbeat after a switch)."""

    def ok() -> dict[int, tuple[str, str, int]] | None:
        snap = serving_view(name, n)
        if all(r["dp_size"] == n and r.get("transport") for r in snap["ranks"]):
            return {r["rank"]: (r["node_ip"], r["transport"], r["transport_attached"]) for r in snap["ranks"]}
        return None

    return wait_for(ok, timeout=30, interval=0.5, what=f"{n} ranks reporting their transport")


def _serves_the_oracle(name: str, cfg_d: dict[str, Any]) -> None:
    gen = eepctl_json("generate", "--name", name, timeout=120)
    for r in gen["results"]:
        assert r["error"] is None and r["output"] == oracle(cfg_d, r["prompt"]), r


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_transport_follows_the_world_onto_a_second_node_and_back(md):
    """transport auto (the default), chosen per world at every transition: two ranks packed on one
    node share memory; a joiner on the other node makes a mixed world, in which every rank goes to
    gloo; retiring it brings the two back to shared memory. Each world serves the oracle's tokens,
    and status shows each rank's transport."""
    d = md("mn-xport")
    res = eepctl(
        "up",
        "--dp",
        "2",
        "--max-dp",
        "3",
        "--dtype",
        "float64",
        "--cpus-per-rank",
        "3",
        "--name",
        d.name,
        "-o",
        "json",
        timeout=240,
    )  # 3 of a node's 6 CPUs: two ranks fill one
    assert res.returncode == 0, f"up exited {res.returncode}: {res.stderr[-3000:]}"
    cfg_d = serving_view(d.name, 2)["info"]["config"]
    assert cfg_d["transport"] == "auto"
    one = _transports(d.name, 2)
    assert len({ip for ip, _, _ in one.values()}) == 1 and {(t, a) for _, t, a in one.values()} == {("shm", 2)}, one
    _serves_the_oracle(d.name, cfg_d)
    op = eepctl_json("scale", "--dp", "3", "--name", d.name, timeout=240)
    assert op["state"] == "succeeded", op
    mixed = _transports(d.name, 3)
    assert len({ip for ip, _, _ in mixed.values()}) == 2 and {(t, a) for _, t, a in mixed.values()} == {("gloo", 0)}, (
        mixed
    )
    prep = [e for e in events(d.name, op["op_id"])["events"] if e["phase"] == "prepare" and e["rank"] >= 0]
    assert prep and {e["detail"].get("transport") for e in prep} == {"gloo"}, prep  # chosen in prepare
    _serves_the_oracle(d.name, cfg_d)
    op = eepctl_json("scale", "--dp", "2", "--retire", "2", "--name", d.name, timeout=240)
    assert op["state"] == "succeeded", op
    back = _transports(d.name, 2)
    assert back == one, (back, one)
    _serves_the_oracle(d.name, cfg_d)
    assert status(d.name)["violations"] == []


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_strict_spread_refuses_more_ranks_than_nodes(md):
    d = md("mn-strict")
    res = eepctl("up", "--dp", "3", "--max-dp", "4", "--placement", "strict-spread", "--name", d.name, timeout=120)
    assert res.returncode == 4, (res.returncode, res.stderr)
    assert "strict-spread puts one rank per node: 3 new rank(s) need 3 node(s)" in res.stderr, res.stderr
    assert "the cluster has 2 alive node(s)" in res.stderr, res.stderr
    listed = eepctl("status", "--name", d.name, timeout=60)
    assert listed.returncode == 3, (listed.returncode, listed.stdout)  # not found: nothing was left behind


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_worker_cut_off_under_load_is_fenced_and_never_heard_from_again(md, two_nodes):
    """Issue 22 point 4: the worker node's link is set down under open-loop load (its processes
    live): its rank goes silent, is fenced by epoch after the health deadline, and the head's
    rank serves alone; when the link comes back, nothing of the old world serves or reports into
    the new one. Runs before the node-loss test, which takes the worker node away. Issue 33 point
    4: `up` runs from the worker node's shell, and the control plane is still on the head (policy,
    not the caller's node)."""
    d = md("mn-partition")
    up = two_nodes.eepctl_on_worker(
        "up",
        "--name",
        d.name,
        "--dp",
        "2",
        "--max-dp",
        "4",
        "--dtype",
        "float64",
        "--placement",
        "spread",
        "--on-rank-failure",
        "shrink",
        "-o",
        "json",
    )
    assert up.returncode == 0, f"up from the worker node exited {up.returncode}: {up.stderr}"
    snap = serving_view(d.name, 2)
    where = nodes_of(snap)
    head_rank = next(r for r, ip in where.items() if ip == multinode.HEAD_IP)
    cut_rank = 1 - head_rank
    # The control plane is on the head by policy (`up` ran on the worker): cut off there, it could tell nothing.
    assert snap["info"]["control_node"]["node_ip"] == multinode.HEAD_IP, snap["info"].get("control_node")
    # Rank 0 hosts the world's store: cut off with it, the head's rank has no store to idle on
    # (its recovery once failed so: "the step loop did not stop in 10s").
    print(f"\n[partition] cut off: rank {cut_rank}{' (the store host)' if cut_rank == 0 else ''}")
    cfg_d = snap["info"]["config"]
    load = d.popen("generate", "--name", d.name, "--rate", "2", "--duration", "24", "-o", "json")
    wait_serving_load(d.name)
    two_nodes.set_link(False)
    try:
        last: list[dict[str, Any]] = []

        def alone() -> dict[str, Any] | None:
            s = status(d.name)
            last[:] = [s]
            live = [r for r in s["ranks"] if r["state"] == "serving"]
            return s if [r["rank"] for r in live] == [head_rank] and live[0]["dp_size"] == 1 else None

        try:
            wait_for(alone, timeout=60, interval=0.5, what="the head rank serving alone at DP 1")
        except AssertionError as e:  # say what the control plane saw and did
            s = last[0] if last else {}
            seen = [(r["rank"], r["state"], r.get("dp_size"), r.get("state_reason")) for r in s.get("ranks", [])]
            raise AssertionError(
                f"{e}; ranks {seen}; operation {s.get('operation')}; control {s.get('info', {}).get('control')}"
            ) from e
    finally:
        two_nodes.set_link(True)
    link_up = time.time()
    heard: list[dict[str, Any]] = []
    while time.time() < link_up + 8:  # the cut-off rank is reachable again: it must stay silent
        heard += [r for r in status(d.name)["ranks"] if r["rank"] == cut_rank]
        time.sleep(0.5)
    assert heard == [], heard[-1:]
    res = finish_load(load, cfg_d, stop=True)
    control = status(d.name)["info"]["control"]
    assert "silent for" in control["fenced"][str(cut_rank)]["reason"], control
    recover = [
        o for o in eepctl_json("events", "--name", d.name, timeout=60)["operations"] if o.get("kind") == "recover"
    ]
    assert recover and recover[-1]["state"] == "succeeded" and recover[-1]["dead_ranks"] == [cut_rank], recover
    assert res["failed"] == 0


def _serving_at(name: str, dp: int, timeout: float = 60.0) -> dict[str, Any]:
    """Status (its ranks: the serving ones) once ``dp`` ranks serve at DP ``dp``."""

    def ok() -> dict[str, Any] | None:
        s = status(name)
        live = [r for r in s["ranks"] if r["state"] == "serving" and r["dp_size"] == dp]
        return {**s, "ranks": live} if len(live) == dp else None

    return wait_for(ok, timeout=timeout, interval=0.5, what=f"{name}: DP {dp} serving")


def _store_host_on_worker(name: str) -> tuple[int, int]:
    """(the head's rank, the worker's rank) of a DP-2 deployment whose store is hosted on the
    worker node. Rank 0 hosts it from the start; when spread put rank 0 on the head, that rank is
    SIGKILLed (by pid: this test's own deployment's process), the recovery re-hosts the store on
    the worker's rank, and a scale back to 2 places the new rank on the head."""
    snap = serving_view(name, 2)
    where = nodes_of(snap)
    if where[0] == multinode.WORKER_IP:
        assert where[1] == multinode.HEAD_IP, where
        return 1, 0
    print("\n[store-cut] rank 0 was placed on the head: moving the store to the worker's rank")
    os.kill(int(next(r for r in snap["ranks"] if r["rank"] == 0)["pid"]), signal.SIGKILL)
    rec = wait_for(
        lambda: [o for o in events(name)["operations"] if o.get("kind") == "recover" and o.get("finished")],
        timeout=90,
        interval=0.5,
        what="the recovery of the killed store host",
    )[-1]
    assert rec["state"] == "succeeded" and rec["dead_ranks"] == [0], rec
    regroup = [
        e
        for e in events(name, rec["op_id"])["events"]
        if e.get("phase") == "regroup" and "new_store_host" in (e.get("detail") or {})
    ]
    assert regroup and regroup[0]["detail"]["new_store_host"] == 1, regroup
    serving_view(name, [1], timeout=60)
    assert scale_json(name, 2)["state"] == "succeeded"
    where = nodes_of(_serving_at(name, 2))
    head = [r for r, ip in where.items() if ip == multinode.HEAD_IP]
    assert where.get(1) == multinode.WORKER_IP and len(head) == 1, where
    return head[0], 1


@pytest.mark.ray
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    "abandon",
    [True, pytest.param(False, marks=pytest.mark.harm("no_sleeper_abandon"))],
    ids=["abandon", "no_sleeper_abandon"],
)
def test_store_host_cut_off_while_the_survivor_sleeps_on_it(md, two_nodes, abandon):
    """Issue 22 point 4, the store's host behind a downed link while the deployment is idle: the
    survivor's step thread sleeps in a wait on that store, which neither answers nor fails. The
    recovery's halt leaves that sleeper behind (it holds no lock and no step): the head's rank
    serves alone at DP 1, and the survivor's abort phase says it left the thread. Without it
    (``no_sleeper_abandon``) the halt waits for the sleeper in vain and the recovery fails: "the
    step loop did not stop"."""
    d = md("mn-storecut" if abandon else "mn-storecut-off")
    up_with_faults(
        d.name, 2, 4, [] if abandon else ["no_sleeper_abandon"], 5.0, placement="spread", on_rank_failure="shrink"
    )
    head_rank, cut_rank = _store_host_on_worker(d.name)
    serving_view(d.name, sorted([head_rank, cut_rank]), timeout=30)  # idle: no request since the scale
    t_cut = time.time()
    two_nodes.set_link(False)
    try:
        rec = wait_for(
            lambda: [
                o
                for o in events(d.name)["operations"]
                if o.get("kind") == "recover" and o["started"] >= t_cut and o.get("finished")
            ],
            timeout=90,
            interval=0.5,
            what="the recovery without the cut-off store host",
        )[-1]
        if abandon:
            alone = _serving_at(d.name, 1)
    finally:
        two_nodes.set_link(True)
    print(
        f"\n[store-cut] {'abandon' if abandon else 'no_sleeper_abandon'}: store host rank {cut_rank} cut off, "
        f"recovery {rec['state']} {rec['finished'] - t_cut:.1f}s after the cut: {rec.get('error') or 'ok'}"
    )
    assert rec["dead_ranks"] == [cut_rank], rec
    if not abandon:
        assert rec["state"] == "failed" and "did not stop" in (rec.get("error") or ""), rec
        return
    assert rec["state"] == "succeeded" and [r["rank"] for r in alone["ranks"]] == [head_rank], (rec, alone["ranks"])
    abort = [
        e for e in events(d.name, rec["op_id"])["events"] if e.get("phase") == "abort" and e.get("rank") == head_rank
    ]
    assert any("left asleep" in str((e.get("detail") or {}).get("step_loop", "")) for e in abort), abort
    assert not alone.get("violations"), alone["violations"]
    gen = eepctl_json("generate", "--name", d.name, "--max-tokens", "8", timeout=90)
    assert gen["results"] and all(not r["error"] for r in gen["results"]), gen


def _lost_ingress_served_again(
    name: str, load: dict[str, Any], head_url: str, lost_url: str, cfg_d: dict[str, Any]
) -> None:
    """The ingress on the lost node: what it dropped was re-sent to the head's (the head's own
    requests never dropped), and Ray restarted it on the head, where it serves."""
    import httpx

    drops = re.findall(r"re-sent from its prompt to (\S+): (\S+) ", load["stderr"])
    assert any(r["resent"] for r in load["records"]) and drops, load["stderr"][-2000:]
    assert {dropped for _, dropped in drops} == {lost_url} and {to for to, _ in drops} == {head_url}, drops

    def moved() -> dict[str, Any] | None:
        ing = {i["index"]: i for i in status(name)["info"]["ingress"]}.get(1) or {}
        return ing if ing.get("restarted") and str(ing.get("url")).startswith(f"http://{multinode.HEAD_IP}:") else None

    back = wait_for(moved, timeout=90, interval=1.0, what="ingress 1 restarted on the head")
    got = httpx.post(back["url"] + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
    assert got.status_code == 200 and got.json()["choices"][0]["token_ids"] == oracle(cfg_d, [1, 2, 3], 4), got.text
    print(f"\n[node-loss] ingress 1 back on the head at {back['url']}; {len(drops)} request(s) re-sent from it")


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_worker_node_lost_under_load_shrinks_to_head_rank(md, two_nodes):
    """Issue 11 point 4: the worker node dies (every process in its namespace SIGKILLed) under
    open-loop load; the head node's rank keeps serving with nothing lost. Issue 22: under policy
    replace and strict-spread (one rank per node) nothing can grow back while the node is gone:
    status says it waits for capacity, and once a worker node joins again the growth is retried
    and succeeds. Issue 33: two ingresses, one per node; the one on the lost node is restarted by
    Ray on the head and serves there, the requests whose streams it dropped are re-sent by
    `eepctl generate` to the head's ingress (a note each), and none sent to the head's failed."""
    d = md("mn-nodeloss")
    # Each rank holds once in its first step with a request mid-decode: the worker's rank is
    # killed in that hold, so it certainly holds requests with tokens (the head's hold just delays;
    # when the worker's is rank 1, its hold comes once rank 0's ended).
    up_with_faults(
        d.name,
        2,
        4,
        ["hold:step@0", "hold:step@1"],
        6.0,
        placement="strict-spread",
        on_rank_failure="replace",
        ingress=2,
    )
    snap = serving_view(d.name, 2)
    head_url, lost_url = (i["url"] for i in sorted(snap["info"]["ingress"], key=lambda i: i["index"]))
    assert head_url.startswith(f"http://{multinode.HEAD_IP}:") and lost_url.startswith(
        f"http://{multinode.WORKER_IP}:"
    ), snap["info"]["ingress"]
    where = nodes_of(snap)
    assert sorted(where.values()) == sorted([multinode.HEAD_IP, multinode.WORKER_IP]), where
    head_rank = next(r for r, ip in where.items() if ip == multinode.HEAD_IP)
    # The control plane is on the head node by policy, not left to Ray's choice.
    assert snap["info"]["control_node"]["node_ip"] == multinode.HEAD_IP, snap["info"].get("control_node")
    lost_rank = 1 - head_rank
    cfg_d = snap["info"]["config"]
    # The load outlasts Ray marking the node dead (its health check, ~5 s on this test cluster:
    # multinode.HEALTH_CHECK), which Ray forwards to every driver as a "(raylet) ..." line: issue 21
    # point 6, -o json stdout stays only JSON.
    load = d.popen("generate", "--name", d.name, "--rate", "2", "--duration", "15", "-o", "json")
    watched_to = tempfile.TemporaryFile("w+")
    watch = d.popen("status", "--name", d.name, "--watch", "--interval", "0.5", "-o", "json", stdout=watched_to)
    wait_held(d.name, lost_rank, "step")
    assert two_nodes.kill_worker_node(), "no process in the worker namespace"

    unavailable: list[str] = []

    def shrunk() -> dict[str, Any] | None:
        got = eepctl("status", "--name", d.name, "-o", "json", timeout=60)
        if got.returncode != 0:  # the lost node's actors are "temporarily unavailable" until Ray marks them dead
            unavailable.append(got.stderr.strip()[:200])
            return None
        s = last_json(got.stdout)
        live = [r for r in s["ranks"] if r["state"] == "serving"]
        ok = [r["rank"] for r in live] == [head_rank] and live[0]["dp_size"] == 1 and not s.get("operation")
        return s if ok else None

    seen: list[Any] = []
    try:
        after = wait_for(
            lambda: seen.append(0) or shrunk(), timeout=90, interval=0.5, what="the head rank serving alone at DP 1"
        )
    except AssertionError as e:
        raise AssertionError(
            f"{e}; {len(unavailable)}/{len(seen)} status calls failed, last: {unavailable[-1:]}"
        ) from e
    print(f"\n[node-loss] status failed {len(unavailable)} time(s) before recovery: {unavailable[:1]}")
    assert not after.get("violations"), after["violations"]
    res = finish_load(load, cfg_d)
    moved_off(res["records"], lost_rank)  # every line of its stdout parses as JSON
    _lost_ingress_served_again(d.name, res, head_url, lost_url, cfg_d)
    watch.terminate()  # SIGTERM: a SIGINT is ignored by a child of a shell's background job
    watch.communicate(timeout=30)
    watched_to.seek(0)
    watched = json_lines(watched_to.read())
    assert len(watched) >= 5 and all(o.get("object") == "status" for o in watched), watched[-1:]
    text = eepctl("status", "--name", d.name, timeout=60).stdout
    # (a growth tried before Ray marked the node dead takes the rank's number again, so the dead
    # rank's line may be gone: the reconciling line below says why it stays at DP 1)
    assert "DP 1 of desired 2" in text, text
    assert f"rank {lost_rank} dead: unknown cause" not in text, text
    recover = [
        o for o in eepctl_json("events", "--name", d.name, timeout=60)["operations"] if o.get("kind") == "recover"
    ]
    assert recover and recover[-1]["state"] == "succeeded" and recover[-1]["dead_ranks"] == [lost_rank], recover

    # Too little capacity to grow back: status says why, and the growth is retried, not dropped.
    def waiting() -> str | None:
        got = eepctl("status", "--name", d.name, timeout=60).stdout
        return got if "waiting for capacity" in got and "strict-spread" in got else None

    text = wait_for(waiting, timeout=90, interval=1.0, what="status saying the growth waits for capacity")
    assert "reconciling: grow DP 1 -> 2: waiting for capacity" in text, text
    assert "last reconcile error" in text and "no capacity to grow DP 1 -> 2" in text, text
    two_nodes.restart_worker_node()  # the capacity returns: a fresh node on the worker's IP

    def two_serving() -> dict[str, Any] | None:
        s = status(d.name)
        live = [r for r in s["ranks"] if r["state"] == "serving" and r["dp_size"] == 2]
        return {**s, "ranks": live} if len(live) == 2 and not s.get("operation") else None

    grown = wait_for(two_serving, timeout=150, interval=1.0, what="DP 2 serving again on both nodes")
    assert sorted(nodes_of(grown).values()) == sorted([multinode.HEAD_IP, multinode.WORKER_IP]), grown["ranks"]
    scales = [o for o in eepctl_json("events", "--name", d.name, timeout=60)["operations"] if o.get("kind") == "scale"]
    assert scales and scales[-1]["state"] == "succeeded" and scales[-1]["to_size"] == 2, scales[-1:]
    control = status(d.name)["info"]["control"]
    assert not control["working_on"], control
