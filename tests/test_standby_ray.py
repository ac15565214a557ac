"""The standby pool on Ray through the CLI: `up --standby 1` keeps one rank actor launched ahead
(state standby, named <name>_standby0, not counted in DP); `scale` adopts it as _dp2 with a
launch phase near zero and outputs equal to the oracle; the pool refills; `standby --count 0`
stops it."""

from __future__ import annotations

import pytest

from tests.helpers import Deployment, eepctl_json, last_json, eepctl, oracle, scale_json, status, up_cli, wait_for

pytestmark = pytest.mark.ray


def _standbys(name: str) -> list[dict]:
    return [r for r in status(name)["ranks"] if r["state"] == "standby"]


@pytest.mark.timeout(240)
def test_scale_up_adopts_the_standby_actor_and_the_pool_refills(deployments):
    d: Deployment = deployments("sbray")
    up_cli(d, 2, 3, "--standby", "1")
    first = wait_for(lambda: _standbys(d.name), 60, what="a standby rank")
    assert [r["instance_id"] for r in first] == [f"{d.name}_standby0"]
    snap = status(d.name)
    assert snap["summary"]["standby"] == 1 and snap["violations"] == []
    op = scale_json(d.name, 3)
    assert op["state"] == "succeeded", op
    assert op["phase_durations"]["launch"] < 1.0, op["phase_durations"]
    serving = {r["rank"]: r for r in status(d.name)["ranks"] if r["state"] == "serving"}
    assert {r: v["instance_id"] for r, v in serving.items()} == {r: f"{d.name}_dp{r}" for r in range(3)}
    assert serving[2]["pid"] == first[0]["pid"], "rank 2 is the standby actor, adopted"
    res = eepctl("generate", "--name", d.name, "--timeout", "30", "-o", "json", timeout=120)
    assert res.returncode == 0, res.stderr
    cfg_d = status(d.name)["info"]["config"]
    for r in last_json(res.stdout)["results"]:
        assert r["error"] is None and r["output"] == oracle(cfg_d, r["prompt"]), r
    refilled = wait_for(lambda: _standbys(d.name), 90, what="the pool refilled")
    assert [r["instance_id"] for r in refilled] == [f"{d.name}_standby1"]
    pool = eepctl_json("standby", "--count", "0", "--name", d.name, timeout=120)
    assert pool["ready"] == [] and pool["taken"] == 1
    wait_for(lambda: not _standbys(d.name), 30, what="the standby stopped")
