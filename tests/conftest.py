"""Shared fixtures. Ray tests run against a real local Ray head that this test session
starts (in its own process group) and stops by that group: no other Ray processes are touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("eepctl-state")
    os.environ["EEPCTL_STATE_DIR"] = str(d)
    return d


@pytest.fixture(scope="session")
def ray_cluster(state_dir: Path) -> dict[str, Any]:
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


def eepctl(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as an operator or a script would."""
    full_env = dict(os.environ, NO_COLOR="1", COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-m", "eepctl", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def eepctl_json(*args: str, timeout: float = 300) -> dict[str, Any]:
    res = eepctl(*args, "-o", "json", timeout=timeout)
    assert res.returncode == 0, f"eepctl {' '.join(args)} exited {res.returncode}: {res.stderr}"
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


def wait_for(pred, timeout: float = 20.0, interval: float = 0.25, what: str = "condition") -> Any:
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
