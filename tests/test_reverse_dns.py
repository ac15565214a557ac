"""Reverse DNS on a vLLM scale's path (engine_ext.vllm.reverse_dns): the addresses whose lookup
leaves the host, read from /etc/hosts and nsswitch.conf as glibc reads them, and the status line that
names them. The stall itself (a TCPStore connection waiting the resolver's timeout) is shown by
benchmarks/tcpstore_dns.py: it depends on the box's DNS server losing a reply, which no test can
make happen on demand."""

from __future__ import annotations

from pathlib import Path

from eepctl import render
from engine_ext.control.registry_state import RegistryState
from engine_ext.vllm.reverse_dns import consults_dns, network_lookups, peer_forms

HOSTS = "127.0.0.1 localhost\n::1 localhost ip6-localhost  # loopback\n10.0.0.7 node7\nnot-an-ip name\n"


def test_addresses_not_in_etc_hosts_are_named_in_both_forms_a_dual_stack_listener_sees(tmp_path: Path) -> None:
    hosts, ns = tmp_path / "hosts", tmp_path / "nsswitch.conf"
    hosts.write_text(HOSTS)
    ns.write_text("passwd: files\nhosts:          files dns\n")
    assert peer_forms("10.0.0.7") == ["10.0.0.7", "::ffff:10.0.0.7"] and peer_forms("::1") == ["::1"]
    # 127.0.0.1 is listed, but a dual-stack TCPStore server sees the peer as ::ffff:127.0.0.1
    assert network_lookups(["127.0.0.1", "10.0.0.7", "::1", "vm"], hosts, ns) == ["::ffff:10.0.0.7", "::ffff:127.0.0.1"]
    hosts.write_text(HOSTS + "::ffff:127.0.0.1 localhost\n::ffff:10.0.0.7 node7\n")
    assert network_lookups(["127.0.0.1", "10.0.0.7"], hosts, ns) == []
    ns.write_text("hosts: files\n")  # DNS never consulted: nothing leaves the host
    assert network_lookups(["192.0.2.9"], hosts, ns) == []
    assert consults_dns(None) and consults_dns("passwd: files\n"), "glibc's default consults DNS"
    assert network_lookups(["192.0.2.9"], tmp_path / "none", tmp_path / "none") == ["192.0.2.9", "::ffff:192.0.2.9"]


def test_status_names_them_with_the_fix() -> None:
    state = RegistryState("vllm")
    state.set_info({"kind": "vllm", "dp": 2, "reverse_dns": ["::ffff:127.0.0.1"]})
    lines = [ln for ln in render.status_summary_lines(state.snapshot()) if ln.startswith("reverse DNS")]
    assert lines == [
        "reverse DNS: ::ffff:127.0.0.1 not in /etc/hosts: torch looks up every peer of a scale's TCPStore "
        "connections, and a DNS reply lost costs a scale the resolver's timeout (5 s); list them there"
    ]
    state.set_info({"kind": "vllm", "dp": 2, "reverse_dns": []})
    assert not [ln for ln in render.status_summary_lines(state.snapshot()) if ln.startswith("reverse DNS")]
