"""Security: eepctl against a Ray cluster with token authentication on (RAY_AUTH_MODE=token),
secrets never printed, logged or stored (names are validated before they reach Ray: test_cli.py).

The authenticated head is this test's own (own port, own temp dir, own process group), stopped
by that group; it never touches the session's cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, STOP_GRACE_S

pytestmark = pytest.mark.ray

RAY_TOKEN = "eeptok" + "7f3c9a1e5b2d4c6e8a0b1c2d3e4f5a6b"  # Ray's token format: at least 32 chars
API_KEY = "eepkey-" + "d41d8cd98f00b204e9800998ecf8427e"
ENGINE = ("--dtype", "float64", "--layers", "1", "--hidden", "32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k not in ("RAY_ADDRESS", "VLLM_API_KEY")
    }
    env.update(NO_COLOR="1", COLUMNS="200", **extra)
    return env


@pytest.fixture(scope="module")
def auth_cluster():
    tmp = Path(tempfile.mkdtemp(prefix="eepauth", dir="/tmp"))  # short: Ray's socket paths are length-limited
    home = tmp / "home"
    home.mkdir()  # no ~/.ray/auth_token of the real user is picked up
    port = _free_port()
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    env = _clean_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=RAY_TOKEN, HOME=str(home))
    log = open(tmp / "head.log", "wb")
    proc = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
            f"--temp-dir={tmp / 'ray'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 90
        while True:
            assert proc.poll() is None, f"authenticated head exited {proc.returncode}; see {tmp / 'head.log'}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                assert time.time() < deadline, "authenticated head did not come up"
                time.sleep(0.3)
        yield {"address": f"127.0.0.1:{port}", "tmp": tmp, "home": home}
    finally:
        from eepctl import cluster

        cluster.stop_process_group(proc.pid, grace_s=STOP_GRACE_S)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


class Runner:
    """Runs the real CLI against the authenticated cluster and keeps every output."""

    def __init__(self, c: dict[str, Any]) -> None:
        self.c = c
        self.outputs: list[str] = []

    def __call__(
        self, *args: str, token: bool = True, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        e = _clean_env(
            RAY_ADDRESS=self.c["address"], HOME=str(self.c["home"]), EEPCTL_STATE_DIR=str(self.c["tmp"] / "state")
        )
        e.update(env or {})
        if token:
            e.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=RAY_TOKEN)
        res = subprocess.run(
            [sys.executable, "-m", "eepctl", *args], capture_output=True, text=True, env=e, timeout=timeout, cwd=ROOT
        )
        self.outputs += [res.stdout, res.stderr]
        return res


@pytest.mark.timeout(480)
def test_without_token_exit_3_with_token_everything_works(auth_cluster):
    run = Runner(auth_cluster)
    name = "auth-dep"
    t0 = time.time()
    res = run("status", "--name", name, token=False, timeout=60)
    took = time.time() - t0
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert "token authentication" in res.stderr and "RAY_AUTH_TOKEN" in res.stderr, res.stderr
    assert took < 15, f"refusal took {took:.1f}s"
    res = run(
        "status", "--name", name, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x" * 40}, token=False, timeout=60
    )
    assert res.returncode == 3 and "refused" in res.stderr, (res.returncode, res.stderr)
    res = run("up", "--dp", "1", "--max-dp", "2", "--name", name, *ENGINE, token=False, timeout=60)
    assert res.returncode == 3, (res.returncode, res.stderr)

    try:
        res = run("up", "--dp", "1", "--max-dp", "2", "--name", name, *ENGINE, "-o", "json")
        assert res.returncode == 0, res.stderr
        # A token saved where Ray keeps it (`ray get-auth-token --generate`), RAY_AUTH_MODE unset: as
        # `ray start` does for a local cluster, eepctl turns token auth on (Ray's own clients would
        # not, for an explicit address, and every command was refused).
        saved = auth_cluster["tmp"] / "saved-home"
        (saved / ".ray").mkdir(parents=True, exist_ok=True)
        (saved / ".ray" / "auth_token").write_text(RAY_TOKEN)
        res = run("status", "--name", name, "-o", "json", token=False, env={"HOME": str(saved)})
        assert res.returncode == 0, res.stderr
        snap = json.loads(res.stdout.splitlines()[-1])
        assert [r["state"] for r in snap["ranks"]] == ["serving"], snap["ranks"]
        res = run("generate", "--name", name, "--prompt-ids", "1,2,3", "-o", "json")
        assert res.returncode == 0, res.stderr
        # An API key handed to every command that takes one, by flag and by environment, together
        # with the Ray token: neither may surface anywhere.
        res = run(
            "scale", "--dp", "2", "--name", name, "--api-key", API_KEY, "-o", "json", env={"VLLM_API_KEY": API_KEY}
        )
        assert res.returncode == 0, res.stderr
        res = run("scale", "--dp", "1", "--name", name, "--dry-run", "-o", "json", env={"VLLM_API_KEY": API_KEY})
        assert res.returncode == 0, res.stderr
        res = run("scale", "--dp", "9", "--name", name, "--api-key", API_KEY)  # an error path too
        assert res.returncode == 4, (res.returncode, res.stderr)
        run("status", "--name", name, "-o", "json", env={"VLLM_API_KEY": API_KEY})
        res = run("events", "--name", name, "-o", "json", env={"VLLM_API_KEY": API_KEY})
        assert res.returncode == 0, res.stderr
        run("scale", "--help", env={"VLLM_API_KEY": API_KEY})
    finally:
        res = run("down", "--name", name, timeout=120)
    assert res.returncode == 0, res.stderr

    # Every stdout/stderr of the run (status/events -o json are the registry snapshot and history),
    # and every file Ray wrote for this cluster (session logs of the head, the controller, the
    # ranks and the drivers).
    haystacks = {f"cli output #{i}": o for i, o in enumerate(run.outputs)}
    ray_dir = auth_cluster["tmp"] / "ray"
    files = 0
    for p in ray_dir.rglob("*"):
        if p.is_file() and not p.is_symlink() and p.suffix not in (".sock",):
            try:
                haystacks[str(p)] = p.read_bytes().decode("utf-8", "replace")
                files += 1
            except OSError:
                pass
    assert files > 10, f"only {files} files under {ray_dir}: the session logs were not found"
    leaks = [
        (where, which)
        for where, text in haystacks.items()
        for which, secret in (("ray token", RAY_TOKEN), ("api key", API_KEY))
        if secret in text
    ]
    assert not leaks, leaks
    print(f"\n[auth] no secret in {len(run.outputs)} CLI outputs and {files} files of the cluster's session dir")
