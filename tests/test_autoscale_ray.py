"""`eepctl autoscale` through the driver seam on a real Ray cluster: the real CLI (subprocesses)
calls the reference driver, which calls ``set_autoscale`` / ``autoscale_show`` /
``autoscale_decisions`` on a detached actor named as the deployment's controller whose three
methods hand the call to an ``AutoscaleHost`` (as the controller's do), fed real-shaped rank
status records. The policy persists through the host's ``persist`` and survives the actor's
replacement."""

from __future__ import annotations

from typing import Any

import pytest

from engine_ext.protocol import DEFAULT_NAMESPACE
from engine_ext.ray.names import controller_name
from tests.helpers import eepctl, eepctl_json

pytestmark = pytest.mark.ray
NAME = "as-seam"


def _start_host(saved: dict[str, Any] | None) -> Any:
    """The actor, named as the controller; its class is built here so Ray ships it by value."""
    import ray
    from engine_ext.ray.autoscale_host import AutoscaleHost

    class AutoscalingController:
        def __init__(self, saved: dict[str, Any] | None) -> None:
            self.saved: dict[str, Any] = saved or {}
            self.autoscale_host = AutoscaleHost(NAME, max_dp=4, persist=self._persist, saved=saved)

        def set_autoscale(self, changes: dict[str, Any]) -> dict[str, Any]:
            return self.autoscale_host.set_autoscale(changes)

        def autoscale_show(self) -> dict[str, Any]:
            return self.autoscale_host.autoscale_show()

        def autoscale_decisions(self, since: float = 0.0, limit: int = 200) -> dict[str, Any]:
            return self.autoscale_host.autoscale_decisions(since, limit)

        def _persist(self, state: dict[str, Any]) -> None:
            self.saved = state

        def durable(self) -> dict[str, Any]:
            return self.saved

        def feed(self, ticks: list[tuple[float, list[dict[str, Any]]]]) -> list[str]:
            return [
                d.action
                for at, sts in ticks
                if (
                    d := self.autoscale_host.tick(
                        sts, [s["rank"] for s in sts], now=at, num_experts=8, slots_per_rank=8
                    )
                )
                is not None
            ]

    return (
        ray.remote(AutoscalingController)
        .options(name=controller_name(NAME), namespace=DEFAULT_NAMESPACE, lifetime="detached", num_cpus=0)
        .remote(saved)
    )


def _status(rank: int, requests: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "requests_waiting": requests,
        "requests_running": 0,
        "kv_blocks_used": 4,
        "kv_blocks_total": 64,
        "ttft_ms_p95": 40.0 * requests,
        "tpot_ms_p95": 5.0,
        "eplb_imbalance": 1.1,
    }


@pytest.mark.timeout(300)
def test_autoscale_commands_through_the_driver_seam(ray_cluster: dict) -> None:
    import ray
    from eepctl import cluster

    cluster.connect(ray_cluster["address"], DEFAULT_NAMESPACE)
    host = _start_host(None)
    try:
        res = eepctl_json(
            "autoscale", "--name", NAME, "--min-dp", "1", "--max-dp", "4", "--target-queue", "2", "--up-delay", "0"
        )
        assert res["object"] == "autoscale" and res["policy"]["mode"] == "advisory" and res["previous"] is None
        over = eepctl("autoscale", "--name", NAME, "--max-dp", "9")
        assert over.returncode == 4 and "over the deployment's max DP 4" in over.stderr, over.stderr
        actions = ray.get(host.feed.remote([(1000.0 + t, [_status(0, 6), _status(1, 6)]) for t in range(0, 30, 5)]))
        assert set(actions) == {"advisory: not acted"}, actions  # queue 6/rank vs 2: DP 4, recorded, not acted
        shown = eepctl_json("autoscale", "--name", NAME, "--show")
        assert shown["last"]["recommendation"] == 4 and shown["last"]["rule"].startswith("queue held up")
        trail = eepctl_json("events", "--name", NAME, "--autoscaler")["decisions"]
        assert len(trail) == 6 and all(d["signals"][0]["name"] == "queue" for d in trail)
        plot = eepctl("autoscale", "--name", NAME, "--plot")
        assert plot.returncode == 0 and "DP  (# actual, * recommended)" in plot.stdout and "A" in plot.stdout
        durable = ray.get(host.durable.remote())
        ray.kill(host)  # a controller restart: the new one is given what was persisted
        host = _start_host(durable)
        again = eepctl_json("autoscale", "--name", NAME, "--mode", "on")
        assert again["previous"]["target_queue"] == 2.0 and again["policy"]["mode"] == "on"
        assert len(eepctl_json("events", "--name", NAME, "--autoscaler")["decisions"]) == 6
    finally:
        ray.kill(host)
