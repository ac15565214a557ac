"""An address that is no Ray head is refused in seconds, in one line: real sockets, no Ray.

A web server on the port (an ingress's HOST:PORT is the likeliest mistake: `eepctl status`
prints it) and a port nothing listens on exit 3 naming what is there; an address that is no
HOST:PORT is bad input, exit 2, before any connection. (``ray.init`` at such an address retried
for over ten minutes.) A real Ray head at a real address still connects:
tests/test_cli_ray.py::test_bad_input_exit_codes; an ingress's own port, tests/test_ingress_ray.py.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.protocol import ExitCode
from tests.helpers import eepctl


class _Health(http.server.BaseHTTPRequestHandler):
    """A web server that answers every GET (as a dashboard or any HTTP service would)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_local_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path / "state"
    monkeypatch.setenv("EEPCTL_STATE_DIR", str(state))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return state


def _one_line(res: subprocess.CompletedProcess, code: int) -> str:
    assert res.returncode == code and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    err = res.stderr
    assert err.startswith("eepctl: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["status"], ["up", "--dp", "1"]])
def test_an_http_port_is_no_ray_head(http_port: int, no_local_cluster: Path, command: list[str]) -> None:
    t0 = time.time()
    res = eepctl(*command, "--name", "addr", "--address", f"127.0.0.1:{http_port}", timeout=60)
    took = time.time() - t0
    err = _one_line(res, ExitCode.UNREACHABLE)
    assert f"no Ray cluster answers at 127.0.0.1:{http_port}; that port answers HTTP" in err, err
    assert "it is an ingress" not in err, err  # a web server that is no ingress is not called one
    assert took < 30, f"refused after {took:.1f}s"  # a bound, not a speed: ray.init retried for minutes
    assert not (no_local_cluster / "local-cluster.json").exists()  # `up` started no head instead


@pytest.mark.timeout(120)
def test_a_port_nothing_listens_on(closed_port: int, no_local_cluster: Path) -> None:
    res = eepctl("status", "--name", "addr", "--address", f"127.0.0.1:{closed_port}", timeout=60)
    err = _one_line(res, ExitCode.UNREACHABLE)
    assert f"nothing listens at 127.0.0.1:{closed_port}" in err, err


@pytest.mark.parametrize(
    "address", ["garbage", "host:notaport", "127.0.0.1:0", "127.0.0.1:70000", ":6379", "127.0.0.1:\u00b2"]
)
def test_an_address_that_is_no_host_port_is_bad_input(address: str, no_local_cluster: Path) -> None:
    from eepctl.main import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(["status", "--name", "addr", "--address", address])
    assert code == ExitCode.USAGE and out.getvalue() == "", (code, out.getvalue(), err.getvalue())
    assert err.getvalue() == f"eepctl: cannot parse Ray address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:6379\n"


@pytest.mark.timeout(120)
def test_a_grpc_server_that_is_not_rays(no_local_cluster: Path) -> None:
    """A gRPC server with no Ray service (a raylet's or a worker's port has others)."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        res = eepctl("status", "--name", "addr", "--address", f"127.0.0.1:{port}", timeout=60)
    finally:
        server.stop(0)
    err = _one_line(res, ExitCode.UNREACHABLE)
    assert "a gRPC server that is not Ray's GCS answers there" in err, err
