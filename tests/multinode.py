"""A real two-node Ray cluster on one machine (DESIGN section 9), for the multi-node tests and
benchmarks/multinode.py. Not a test module.

The head runs on the root side of a veth pair (10.213.0.1), the second node inside a network
namespace (10.213.0.2). Hostnames resolve to 127.0.0.1 here, so any component that advertises
its hostname's address instead of the node IP Ray reports is caught: the namespace cannot reach
the root side's loopback. Everything is torn down by the pids and process groups this module
started and by ``ip netns del``; no other process is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HEAD_IP = "10.213.0.1"
WORKER_IP = "10.213.0.2"
PREFIX = 24
# Ray's node health check, tightened for this test cluster (Ray's defaults: a check every 3 s, a
# node dead after 5 failed ones, ~15 s). A killed node refuses the check at once, so it is marked
# dead ~5 s after the loss; a node behind a downed link fails each check only at its 10 s timeout
# (Ray's default, kept), so the partition tests' cuts (well under 50 s) never make Ray declare
# the worker dead, which would end its raylet once the link is back.
HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5, "health_check_timeout_ms": 10000}
# The controllers of this cluster retry a growth that found no capacity at least every 3 s, not at
# the escalated 30 s (engine_ext.control.reconciler): the tests bring a node back seconds later.
# RAY_AUTH_MODE pinned: `ray start` turns token auth on by itself where a token is saved in
# ~/.ray/auth_token, and the probes here connect by explicit address, which never sends one.
CONTROL_ENV = {"EEPCTL_TEST_BACKOFF_MAX_S": "3", "RAY_AUTH_MODE": "disabled"}
STOP_GRACE_S = 3.0  # SIGTERM to SIGKILL for the `ray start --block` processes (their nodes end with them)


class NamespaceRefused(RuntimeError):
    """The machine does not let us build a network namespace (not root, no CAP_NET_ADMIN, no `ip`)."""


def _run(*cmd: str) -> None:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class TwoNodeCluster:
    """Handles of what :func:`start` built; :meth:`stop` removes all of it."""

    ns: str
    veth_root: str
    address: str
    temp_root: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    num_cpus: int = 8

    def ns_pids(self) -> list[int]:
        """Every process inside the namespace (the worker node's raylet and its workers)."""
        res = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, timeout=10)
        return [int(p) for p in res.stdout.split() if p.strip().isdigit()]

    def kill_worker_node(self) -> list[int]:
        """SIGKILL every process in the namespace, by pid (node loss)."""
        pids = self.ns_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def restart_worker_node(self, timeout_s: float = 90.0) -> None:
        """Start a fresh worker raylet in the namespace (capacity coming back after a node loss):
        same IP, a new Ray node id; returns once the cluster has two alive nodes again."""
        env = dict(os.environ, **CONTROL_ENV)
        env.pop("RAY_ADDRESS", None)
        n = len(self.procs)
        log = open(self.temp_root / f"worker{n}.log", "w")
        self.procs.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.ns,
                    _ray_bin(),
                    "start",
                    f"--address={self.address}",
                    f"--node-ip-address={WORKER_IP}",
                    f"--temp-dir={self.temp_root / f'worker{n}'}",
                    f"--num-cpus={self.num_cpus}",
                    "--disable-usage-stats",
                    "--block",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        )
        _wait_nodes(self.address, 2, timeout_s)

    def eepctl_on_worker(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """The CLI run from the worker node's shell (inside its namespace), as an operator there would."""
        env = dict(os.environ, **CONTROL_ENV, RAY_ADDRESS=self.address, NO_COLOR="1", COLUMNS="200")
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, sys.executable, "-m", "eepctl", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )

    def set_link(self, up: bool) -> None:
        """Cut the worker node off (its processes live, no packet crosses) or connect it again."""
        _run("ip", "link", "set", self.veth_root, "up" if up else "down")

    def stop(self) -> None:
        """Stop both nodes (our process groups, then whatever is left in the namespace) and
        remove the namespace and veth pair. Safe to call twice and after a partial start."""
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self.kill_worker_node()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.veth_root], capture_output=True, timeout=30)
        shutil.rmtree(self.temp_root, ignore_errors=True)


def _ray_bin() -> str:
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray is None:
        raise RuntimeError("the `ray` command is not installed")
    return ray


def _wait_nodes(address: str, want: int, timeout_s: float) -> None:
    code = (
        "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False);"
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    deadline = time.time() + timeout_s
    last = ""
    while time.time() < deadline:
        res = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60)
        last = res.stdout.strip() or res.stderr[-500:]
        if res.returncode == 0 and last.isdigit() and int(last) >= want:
            return
        time.sleep(1.0)
    raise RuntimeError(f"the two-node Ray cluster did not come up in {timeout_s:.0f}s (alive nodes: {last})")


def start(num_cpus: int = 8, timeout_s: float = 90.0) -> TwoNodeCluster:
    """Build the namespace, the veth pair and both Ray nodes; raise NamespaceRefused where the
    machine does not allow network namespaces."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise NamespaceRefused("needs root and iproute2 (`ip`) to build a network namespace")
    tag = uuid.uuid4().hex[:6]
    ns, veth_root, veth_ns = f"eepmn-{tag}", f"eepr{tag}", f"eepn{tag}"
    try:
        _run("ip", "netns", "add", ns)
    except RuntimeError as e:
        raise NamespaceRefused(f"the machine refuses network namespaces: {e}") from None
    cl = TwoNodeCluster(ns, veth_root, "", Path(tempfile.mkdtemp(prefix="eepmn-")), num_cpus=num_cpus)
    try:
        _run("ip", "link", "add", veth_root, "type", "veth", "peer", "name", veth_ns)
        _run("ip", "link", "set", veth_ns, "netns", ns)
        _run("ip", "addr", "add", f"{HEAD_IP}/{PREFIX}", "dev", veth_root)
        _run("ip", "link", "set", veth_root, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{WORKER_IP}/{PREFIX}", "dev", veth_ns)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", veth_ns, "up")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        port = _free_port(HEAD_IP)
        cl.address = f"{HEAD_IP}:{port}"
        ray = _ray_bin()
        common = [f"--num-cpus={num_cpus}", "--disable-usage-stats", "--block"]
        env = dict(os.environ, **CONTROL_ENV)
        env.pop("RAY_ADDRESS", None)
        for name, cmd in (
            (
                "head",
                [
                    ray,
                    "start",
                    "--head",
                    f"--port={port}",
                    f"--node-ip-address={HEAD_IP}",
                    f"--system-config={json.dumps(HEALTH_CHECK)}",
                    f"--temp-dir={cl.temp_root / 'head'}",
                    "--include-dashboard=false",
                    *common,
                ],
            ),
            (
                "worker",
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    ray,
                    "start",
                    f"--address={cl.address}",
                    f"--node-ip-address={WORKER_IP}",
                    f"--temp-dir={cl.temp_root / 'worker'}",
                    *common,
                ],
            ),
        ):
            log = open(cl.temp_root / f"{name}.log", "w")
            cl.procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
                )
            )
            if name == "head":
                _wait_port(HEAD_IP, port, timeout_s, cl)
        _wait_nodes(cl.address, 2, timeout_s)
        return cl
    except BaseException:
        cl.stop()
        raise


def _wait_port(host: str, port: int, timeout_s: float, cl: TwoNodeCluster) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cl.procs[-1].poll() is not None:
            raise RuntimeError(f"ray head exited: {(cl.temp_root / 'head.log').read_text()[-2000:]}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"ray head did not listen on {host}:{port} in {timeout_s:.0f}s")
