"""This process's network identity for the elastic groups, and its store connections: the
address its stores and gloo devices bind (set once per process by the rank engine), the store a
rank hosts, and the client connections it keeps per purpose."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from engine_ext.elastic.netaddr import interface_ip

IFNAME_ENV = "EEPCTL_IFNAME"  # operator override: the interface ranks bind (store and gloo)
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # what gloo users already set; honoured the same way


@dataclass(frozen=True)
class NodeAddress:
    """Where this rank's store listens and what its gloo device advertises. Ray ranks get the
    node IP Ray reports (a hostname here resolves to 127.0.0.1, unreachable from another node);
    ``ifname`` is set when an operator pinned the interface."""

    ip: str
    ifname: str = ""


_node: NodeAddress | None = None  # one rank per process: set once by the engine (configure_node)


def configure_node(node_ip: str, ifname: str = "") -> NodeAddress:
    """Fix this process's address for every store and group it creates: the operator's
    interface (argument, then $EEPCTL_IFNAME, then $GLOO_SOCKET_IFNAME) wins over Ray's node IP."""
    global _node
    ifname = ifname or os.environ.get(IFNAME_ENV, "") or os.environ.get(GLOO_IFNAME_ENV, "").split(",")[0]
    _node = NodeAddress(interface_ip(ifname), ifname) if ifname else NodeAddress(node_ip)
    return _node


def configured_ip() -> str:
    """The address configure_node fixed, or "" where none was (the process launcher, one node)."""
    return _node.ip if _node is not None else ""


def gloo_options(timeout: datetime.timedelta) -> dist.ProcessGroupGloo._Options | None:
    """Options with one device bound to this node's address, or None (process launcher on one
    node: gloo's default device, which honours GLOO_SOCKET_IFNAME itself)."""
    if _node is None:
        return None
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    if _node.ifname:
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=_node.ifname)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_node.ip)]
    return opts


def host_store(host: str | None = None) -> dist.TCPStore:
    """Start the store master of a deployment on a free port (rank 0 hosts it), on this node's
    address when one is configured."""
    host = host or (_node.ip if _node is not None else "0.0.0.0")
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)


_clients: dict[tuple[str, int, str], dist.TCPStore] = {}


def store_client(host: str, port: int, timeout_s: float = 60.0, purpose: str = "groups") -> dist.TCPStore:
    """One client connection per (store, purpose). A client serializes its requests, so a
    long blocking wait (an idle rank's sleep) gets a connection of its own."""
    key = (host, port, purpose)
    if key not in _clients:
        _clients[key] = dist.TCPStore(
            host,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return _clients[key]
