"""Reverse DNS on a scale's path: which of the deployment's addresses a lookup sends to the network.

torch's c10d names the peer of every TCPStore connection it opens or accepts with a blocking
``getnameinfo`` (without ``NI_NUMERICHOST``; ``SocketImpl``'s constructor formats it eagerly), and
an elastic scale opens tens of them: the scale's store, and a store and two gloo groups per standby
group on every rank. A peer that /etc/hosts does not list is looked up on the DNS server; a reply
the resolver loses costs its timeout (glibc: 5 s) on that connection, and the group it belongs to
waits on every rank. On the 2-core box 1-8 % of lookups took 5.0 s, the 5.1 s stalls of vLLM's
scale-down prepare (docs/vllm-plugin.md, "Reverse DNS"). A dual-stack server sees an IPv4 peer as
``::ffff:a.b.c.d``, a form /etc/hosts must list as such. The plugin cannot change torch's lookup;
it names the addresses so that the operator can list them (or shorten the resolver's timeout).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from pathlib import Path

HOSTS = Path("/etc/hosts")
NSSWITCH = Path("/etc/nsswitch.conf")


def peer_forms(address: str) -> list[str]:
    """The forms a TCPStore peer at ``address`` is looked up in: an IPv4 address also as the
    v4-mapped IPv6 address a dual-stack listener reports."""
    ip = ipaddress.ip_address(address)
    return [str(ip), f"::ffff:{ip}"] if ip.version == 4 else [str(ip)]


def listed(hosts: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses an /etc/hosts text names."""
    out: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for line in hosts.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2:
            try:
                out.add(ipaddress.ip_address(fields[0]))
            except ValueError:
                continue
    return out


def consults_dns(nsswitch: str | None) -> bool:
    """Whether host lookups reach DNS (glibc's default without an nsswitch.conf does)."""
    if nsswitch is None:
        return True
    for line in nsswitch.splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and fields[0] == "hosts:":
            return "dns" in fields[1:]
    return True


def network_lookups(addresses: Iterable[str], hosts: Path = HOSTS, nsswitch: Path = NSSWITCH) -> list[str]:
    """The peer forms of ``addresses`` whose reverse lookup leaves this host, sorted; [] where
    every one is answered from /etc/hosts or DNS is not consulted. Unparseable addresses
    (a host name) are skipped."""
    try:
        ns = nsswitch.read_text()
    except OSError:
        ns = None
    if not consults_dns(ns):
        return []
    try:
        local = listed(hosts.read_text())
    except OSError:
        local = set()
    out: set[str] = set()
    for address in addresses:
        try:
            out.update(f for f in peer_forms(address) if ipaddress.ip_address(f) not in local)
        except ValueError:
            continue
    return sorted(out)
