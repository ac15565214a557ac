"""Finding, starting and stopping the Ray cluster eepctl talks to.

eepctl stops only a cluster it started itself, by the process group it recorded; it never
runs a blanket ``ray stop``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eepctl import streams
from engine_ext.protocol import UnreachableError, UsageError


def state_dir() -> Path:
    d = Path(os.environ.get("EEPCTL_STATE_DIR") or Path.home() / ".cache" / "eepctl")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _state_file() -> Path:
    return state_dir() / "local-cluster.json"


def started_cluster() -> dict[str, Any] | None:
    try:
        data = json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return None
    try:
        os.killpg(int(data["pgid"]), 0)
    except (OSError, KeyError, ValueError):
        return None
    return data


def parse_address(address: str) -> tuple[str, int]:
    """HOST and PORT of a Ray address (``ray://`` allowed; an IPv6 host keeps its brackets);
    anything else is bad input (exit 2), found before any connection."""
    addr = address.strip().removeprefix("ray://")
    host, _, port = addr.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise UsageError(f"cannot parse Ray address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:6379")
    return host, int(port)


def reachable(host: str, port: int, timeout_s: float = 1.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolve_address(address: str | None) -> str | None:
    """The explicit address, RAY_ADDRESS, a cluster eepctl started, or None."""
    if address:
        return address
    env = os.environ.get("RAY_ADDRESS")
    if env:
        return env
    started = started_cluster()
    return started["address"] if started else None


def connect(address: str | None, namespace: str) -> str:
    """Connect this process to the cluster as a Ray driver. Exit 3 when there is none (found in
    seconds: eepctl.probe), exit 2 for an address that is no HOST:PORT."""
    addr = resolve_address(address)
    if addr is None:
        raise UnreachableError("no Ray cluster: pass --address or set RAY_ADDRESS (or run `eepctl up` to start one)")
    hostport = None if addr == "auto" else parse_address(addr)
    if hostport is not None:  # seconds, not ray.init's many minutes, when no Ray cluster is there
        from eepctl.probe import require_ray

        require_ray(*hostport)
    import ray

    streams.divert_library_output()
    if ray.is_initialized():
        return addr
    if hostport is not None:
        _check_auth(addr, *hostport)
    try:
        ray.init(address=addr, namespace=namespace, logging_level="ERROR", log_to_driver=False, configure_logging=True)
    except ConnectionError as e:
        raise UnreachableError(f"cannot connect to the Ray cluster at {addr}: {str(e).splitlines()[0]}") from None
    except Exception as e:  # auth failures and version mismatches surface as other types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "auth" in msg.lower() or "token" in msg.lower() or "unauthenticated" in msg.lower():
            raise UnreachableError(
                f"the Ray cluster at {addr} refused the connection (authentication): {msg}"
            ) from None
        raise UnreachableError(f"cannot connect to the Ray cluster at {addr}: {msg}") from None
    finally:
        from eepctl import interrupt

        interrupt.install()  # ray.init put in Ray's SIGTERM handler (a stack dump): ours wins
    return addr


def connect_or_start(
    address: str | None, namespace: str, say: Callable[[str], None]
) -> tuple[str, dict[str, Any] | None]:
    """Connect to the cluster named (``address``, RAY_ADDRESS or the one eepctl started); with
    none named anywhere, start a local head and say so. Returns the address and what was
    started (None: nothing)."""
    try:
        return connect(address, namespace), None
    except UnreachableError:
        if resolve_address(address) is not None:
            raise
    say(
        "No Ray cluster is running: starting a local Ray head (eepctl started it; "
        "`eepctl down --stop-cluster` stops it)."
    )
    started = start_local()
    return connect(started["address"], namespace), started


def _check_auth(addr: str, host: str, port: int, timeout_s: float = 3.0) -> None:
    """One cheap GCS call carrying this process's Ray token (if any), so that a cluster with
    token authentication refusing it is reported at once, clearly and with exit 3, instead of
    after ray.init's ~20 s of retries. Anything else is left for ray.init to report."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        from engine_ext.ray import ray_private
    except Exception:  # noqa: BLE001 - a Ray without token auth: nothing to check
        return
    try:
        metadata = ray_private.auth_metadata()
    except Exception:  # noqa: BLE001 - e.g. RAY_AUTH_MODE=token with no token anywhere, or a Ray without token auth
        metadata = ()
    try:
        with grpc.insecure_channel(f"{host}:{port}") as channel:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata
            )
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED and not addr.startswith("ray://"):
            raise UnreachableError(
                f"no Ray cluster answers at {host}:{port}: a gRPC server that is not Ray's "
                "GCS answers there (a raylet's or a worker's port?)"
            ) from None
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            if not metadata and _adopt_saved_token():
                return _check_auth(addr, host, port, timeout_s)
            how = "the token this process has was refused" if metadata else "this process has no Ray token"
            raise UnreachableError(
                f"the Ray cluster at {addr} requires token authentication and {how}: set "
                "RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or a file named by "
                "RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token)"
            ) from None
    except Exception:  # noqa: BLE001 - not our concern here; ray.init reports it
        return


def _adopt_saved_token() -> bool:
    """Ray's rule for a local cluster, applied to one that asks for a token: with RAY_AUTH_MODE
    unset, a saved token (``ray get-auth-token --generate``) turns token auth on, as `ray start`
    did for the cluster itself. Ray's clients skip the rule for an explicit address, so without
    this every eepctl command against the cluster `eepctl up` started would be refused."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return False
    try:
        from engine_ext.ray import ray_private

        return ray_private.adopt_saved_token()
    except Exception:  # noqa: BLE001 - a Ray without token auth: nothing to adopt
        return False


def _free_port(preferred: int = 6379) -> int:
    """``preferred`` when it is free, else (or with 0) one the OS picks."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local(
    num_cpus: int | None = None,
    timeout_s: float = 90.0,
    dashboard: bool = False,
    resources: dict[str, float] | None = None,
    temp_dir: str | None = None,
    any_port: bool = False,
) -> dict[str, Any]:
    """Start a local Ray head in its own process group and remember it; ``resources`` are custom
    resources it advertises (the tests' head: ``vllm_cpu_rank`` for vLLM's Ray DP ranks on CPU).
    ``temp_dir`` and ``any_port`` (not Ray's 6379 first) keep heads started side by side apart."""
    port = _free_port(0 if any_port else 6379)
    cpus = num_cpus or max(os.cpu_count() or 1, 8)
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if ray_bin is None:
        raise UnreachableError("cannot start a local Ray cluster: the `ray` command is not installed")
    log = state_dir() / "local-cluster.log"
    cmd = [
        ray_bin,
        "start",
        "--head",
        f"--port={port}",
        f"--num-cpus={cpus}",
        f"--include-dashboard={'true' if dashboard else 'false'}",
        "--disable-usage-stats",
        "--block",
        *([f"--resources={json.dumps(resources)}"] if resources else []),
        *([f"--temp-dir={temp_dir}"] if temp_dir else []),
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    address = f"127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise UnreachableError(f"the local Ray head exited with code {proc.returncode}; see {log}")
        if reachable("127.0.0.1", port, 0.5):
            break
        time.sleep(0.3)
    else:
        stop_process_group(proc.pid)
        raise UnreachableError(f"the local Ray head did not come up in {timeout_s:.0f}s; see {log}")
    info = {
        "address": address,
        "pid": proc.pid,
        "pgid": proc.pid,
        "num_cpus": cpus,
        "started": time.time(),
        "log": str(log),
    }
    _state_file().write_text(json.dumps(info))
    return info


def stop_process_group(pgid: int, grace_s: float = 15.0) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:  # a leader that is our child stays in its group as a zombie until reaped
            os.waitpid(pgid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            os.killpg(pgid, 0)
        except OSError:
            return
        if not _live_members(pgid):  # only zombies left: their parents reap them
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _live_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is not yet a zombie (True where /proc cannot tell)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_started(address: str | None) -> dict[str, Any] | None:
    """Stop the cluster eepctl started, if ``address`` (when given) is that cluster."""
    started = started_cluster()
    if started is None or (address and address != started["address"]):
        return None
    stop_process_group(int(started["pgid"]))
    _state_file().unlink(missing_ok=True)
    return started
