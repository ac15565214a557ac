"""Ray metrics of ranks and transitions, read back from the Prometheus endpoint of a real local
Ray head (``--metrics-export-port``) after a deployment served and scaled.

The head is this test's own (own ports, temp dir and process group), stopped by that group. Ray's
metrics agent needs packages of ``ray[default]`` (opencensus, opentelemetry's Prometheus exporter);
without them there is no endpoint, and the test skips saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import ROOT, STOP_GRACE_S, wait_for

pytestmark = pytest.mark.ray

ENGINE = ("--dtype", "float64", "--layers", "1", "--hidden", "32", "--capture-policy", "recapture")
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent_missing() -> str | None:
    # Ray starts its agent --minimal (no metrics) unless ray.dashboard.optional_deps imports.
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray.dashboard.optional_deps; import ray.dashboard.modules.reporter.reporter_agent",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if res.returncode == 0:
        return None
    last = (res.stderr.strip().splitlines() or ["?"])[-1]
    return f"Ray's metrics agent cannot load here ({last}); install ray[default] to export metrics"


def parse(body: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in body.splitlines():
        m = _SAMPLE.match(line)
        if m:
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), tags, float(m.group(3))))
    return out


@pytest.fixture(scope="module")
def metrics_cluster():
    reason = _agent_missing()
    if reason:
        pytest.skip(reason)
    tmp = Path(tempfile.mkdtemp(prefix="eepmet", dir="/tmp"))
    port, mport = _free_port(), _free_port()
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
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
            f"--metrics-export-port={mport}",
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
            assert proc.poll() is None, f"head exited {proc.returncode}; see {tmp / 'head.log'}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                assert time.time() < deadline, "head did not come up"
                time.sleep(0.3)
        yield {"address": f"127.0.0.1:{port}", "metrics": f"http://127.0.0.1:{mport}/metrics", "tmp": tmp}
    finally:
        from eepctl import cluster

        cluster.stop_process_group(proc.pid, grace_s=STOP_GRACE_S)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(420)
def test_rank_and_transition_metrics_reach_the_ray_endpoint(metrics_cluster):
    c = metrics_cluster
    env = dict(os.environ, RAY_ADDRESS=c["address"], EEPCTL_STATE_DIR=str(c["tmp"] / "state"), NO_COLOR="1")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "eepctl", *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
        )

    name = "met-dep"
    try:
        res = run("up", "--dp", "1", "--max-dp", "2", "--name", name, *ENGINE, "-o", "json")
        assert res.returncode == 0, res.stderr
        res = run("scale", "--dp", "2", "--name", name, "-o", "json")
        assert res.returncode == 0, res.stderr
        op = json.loads(res.stdout.splitlines()[-1])
        res = run("generate", "--name", name, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "-o", "json")
        assert res.returncode == 0, res.stderr
        res = run("status", "--name", name, "-o", "json")
        snap = json.loads(res.stdout.splitlines()[-1])
        ws = {str(r["rank"]): r["workspace_bytes"] for r in snap["ranks"]}

        want = {
            "ray_eep_rank_requests_running",
            "ray_eep_rank_kv_blocks_used",
            "ray_eep_rank_kv_blocks_total",
            "ray_eep_rank_workspace_bytes",
            "ray_eep_rank_state",
            "ray_eep_rank_graph_captures_total",
            "ray_eep_rank_capture_seconds_count",
            "ray_eep_transition_phase_seconds_count",
            "ray_eep_serving_pause_seconds_count",
            "ray_eep_transitions_total",
            "ray_eep_rank_steps_total",
            "ray_eep_rank_ttft_p95_seconds",
            "ray_eep_rank_tpot_p95_seconds",
        }  # the autoscaler's SLO signals
        samples: list = []

        def ready() -> bool:
            nonlocal samples
            try:
                body = urllib.request.urlopen(c["metrics"], timeout=5).read().decode()
            except OSError:
                return False
            samples = [s for s in parse(body) if s[1].get("deployment") == name]
            names = {s[0] for s in samples}
            seen: dict[str, float] = {}  # each rank's workspace gauge as last exported: fresh once it is status's
            for n, t, v in samples:
                if n == "ray_eep_rank_workspace_bytes" and t.get("identity") == f"{name}_dp{t.get('rank')}":
                    seen[t["rank"]] = max(v, seen.get(t["rank"], v))
            return want <= names and all(seen.get(r) == ws[r] for r in ("0", "1"))

        try:  # Ray's metrics agent exports every few seconds
            wait_for(ready, timeout=60, interval=1.0, what="every eep metric of both ranks, the workspace fresh")
        except AssertionError:
            names = sorted({s[0] for s in samples})
            workspace = {(t.get("rank"), v) for n, t, v in samples if n == "ray_eep_rank_workspace_bytes"}
            raise AssertionError(
                f"after 60s: missing {sorted(want - set(names))}; have {names}; workspace {sorted(workspace)} vs {ws}"
            ) from None

        def value(metric: str, **tags: str) -> float:
            vals = [v for n, t, v in samples if n == metric and all(t.get(k) == w for k, w in tags.items())]
            assert vals, (metric, tags)
            return max(vals)

        for rank in ("0", "1"):
            assert value("ray_eep_rank_workspace_bytes", rank=rank, identity=f"{name}_dp{rank}") == ws[rank]
            assert value("ray_eep_rank_kv_blocks_total", rank=rank) > 0
            assert value("ray_eep_rank_state", rank=rank, state="serving") == 1.0
            assert value("ray_eep_rank_state", rank=rank, state="failed") == 0.0
            assert value("ray_eep_rank_graph_captures_total", rank=rank) >= 1
        assert value("ray_eep_transition_phase_seconds_count", phase="capture") >= 2
        assert value("ray_eep_transitions_total", state="succeeded") == 1
        assert value("ray_eep_serving_pause_seconds_count") == 1
        assert value("ray_eep_rank_steps_total", rank="0") > 0
        print(
            f"\n[metrics] {len({s[0] for s in samples})} eep metric names, {len(samples)} samples; "
            f"op {op['op_id']} pause {op.get('serving_pause_s')}s"
        )
    finally:
        run("down", "--name", name)
