"""Where an ingress listens: its socket, the port it keeps across restarts, and its HTTP server's
start, bounded.

An ingress with a pinned port (`eepctl up --port P`: ingress i takes P + i) listens there or not at
all: a port that is taken is an error naming it (`up` fails with exit 4; a restarted ingress tries
again, and status says why it does not listen). Without one, the first start takes any free port;
a restart takes the same port again, so the URL stays, and when another process took it, another
port and a note saying the URL changed (status shows it). The port is kept in the GCS key-value
store (``port_key``), which `eepctl down` clears.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from dataclasses import dataclass
from typing import Any

KV_NAMESPACE = "eepctl"
START_TIMEOUT_S = 30.0  # the HTTP server listens within this, or its start fails with why
NOT_HERE = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)  # the address is the problem, not the server


class ListenError(Exception):
    """The ingress cannot listen where it must (a pinned port taken, an address not on its node)."""


@dataclass
class Listener:
    """A bound socket, where it is bound, and why the port is not the one asked for (or "")."""

    sock: socket.socket
    host: str
    port: int
    note: str = ""


def bind(host: str, pinned: int, saved: int = 0) -> Listener:
    """A socket bound to ``host`` at the ``pinned`` port (ListenError when taken), else at the
    ``saved`` one (another free one when taken, with a note), else at any free port."""
    want = pinned or saved
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, want))
    except OSError as e:
        if pinned or e.errno != errno.EADDRINUSE:
            sock.close()
            raise ListenError(f"cannot listen on {host}:{want}: {e.strerror}") from None
        sock.bind((host, 0))  # its old port taken: any free one (the port is pinned only with --port)
        port = sock.getsockname()[1]
        return Listener(sock, host, port, f"port {want} was taken when it restarted: now {port} (the URL changed)")
    return Listener(sock, host, sock.getsockname()[1])


async def serve_started(server: Any, listener: Listener, timeout_s: float = START_TIMEOUT_S) -> asyncio.Task:
    """Run ``server`` (a uvicorn.Server) on the listener's socket; return its task once it
    listens. A serve task that ends first raises its error (a port another socket started
    listening on first is a ListenError); one that does not listen within ``timeout_s`` is
    stopped and is an error too."""
    task = asyncio.ensure_future(server.serve(sockets=[listener.sock]))
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if task.done():
            err = None if task.cancelled() else task.exception()
            if isinstance(err, OSError) and err.errno in NOT_HERE:
                raise ListenError(f"cannot listen on {listener.host}:{listener.port}: {err.strerror}") from err
            if err is not None:
                raise err
            raise RuntimeError("the HTTP server stopped before it listened")
        if time.monotonic() > deadline:
            server.should_exit = True
            task.cancel()
            raise TimeoutError(
                f"the HTTP server did not listen on {listener.host}:{listener.port} within {timeout_s:.0f}s"
            )
        await asyncio.sleep(0.02)
    return task


def url_for(host: str, port: int, node_ip: str) -> str:
    """The URL clients use: the node's IP when listening on every interface, else the address."""
    return f"http://{node_ip if host in ('0.0.0.0', '') else host}:{port}"


def port_key_prefix(namespace: str, deployment: str) -> bytes:
    return f"ingress-port/{namespace}/{deployment}/".encode()


def port_key(namespace: str, deployment: str, index: int) -> bytes:
    return port_key_prefix(namespace, deployment) + str(index).encode()


def saved_port(namespace: str, deployment: str, index: int) -> int:
    from engine_ext.ray import ray_private

    raw = ray_private.kv_get(port_key(namespace, deployment, index), KV_NAMESPACE)
    return int(raw) if raw else 0


def save_port(namespace: str, deployment: str, index: int, port: int) -> None:
    from engine_ext.ray import ray_private

    ray_private.kv_put(port_key(namespace, deployment, index), str(port).encode(), KV_NAMESPACE)
