"""Transports for the per-step collectives, below the rank side and free of Ray and the
controller: shared memory among the ranks of one host (``shm``); gloo (in engine_ext.elastic.comm)
everywhere else; CUDA IPC (``cuda_ipc``) among GPU ranks of one host. A group picks one per world
from its members' placement and its device."""

from __future__ import annotations

import socket

MAPPED = ("shm", "cuda_ipc")  # transports whose buffers every member maps in prepare (I2's evidence)


class TransportNotPrepared(RuntimeError):
    """A world's transport is not ready for its exchanges (a member did not map its shared memory,
    or it is sized for a smaller exchange): I2 refuses the transition before anything moves."""


def host_key(node_ip: str) -> str:
    """What ranks that share one host (and one address on it) have in common: the kernel's boot
    id, the hostname and the node address ranks bind (two network namespaces of one machine are
    two nodes here, as they are to gloo)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}/{socket.gethostname()}/{node_ip}"
