"""Shared fixtures. Ray tests run against a real local Ray head that this test session
starts (in its own process group) and stops by that group: no other Ray processes are touched.
Shared helpers (not fixtures) are in tests/helpers.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Deployment, owned_deployments


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("eepctl-state")
    os.environ["EEPCTL_STATE_DIR"] = str(d)
    return d


@pytest.fixture(scope="session")
def ray_cluster(state_dir: Path) -> Iterator[dict[str, Any]]:
    """A local Ray head for the whole session; RAY_ADDRESS points at it."""
    from eepctl import cluster

    info = cluster.start_local(num_cpus=16)
    os.environ["RAY_ADDRESS"] = info["address"]
    try:
        yield info
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            cluster.stop_process_group(int(info["pgid"]))
            os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture
def deployments(ray_cluster: dict[str, Any]) -> Iterator[Callable[[str], Deployment]]:
    """Makes ``Deployment``s by name; on teardown ends their background CLI processes and brings
    each down by name."""
    with owned_deployments() as make:
        yield make
