"""This host's addresses, as a rank binds its store and gloo device to them (no torch, no state)."""

from __future__ import annotations

import fcntl
import socket
import struct


def interface_ip(ifname: str) -> str:
    """The IPv4 address of a network interface (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            raise ValueError(f"interface {ifname!r} has no IPv4 address here: {e}") from None
    return socket.inet_ntoa(packed[20:24])


def local_ip() -> str:
    """The process launcher's guess (one node): the default route's address."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the default route's address
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
