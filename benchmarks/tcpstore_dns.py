"""What reverse DNS costs TCPStore connections on this host (engine_ext.vllm.reverse_dns).

Opens ``--connections`` TCPStore client connections to a dual-stack TCPStore server on
``--address`` (each one: torch looks up the peer's name on both ends), first with the host's
resolver as it is, then (as root, in a private mount namespace: ``unshare -m``) with an
/etc/hosts that also lists the peer forms reverse_dns names. Prints, for each, the connections
slower than 0.5 s and the slowest. A vLLM elastic scale opens tens of these connections, so a
host where some take the resolver's timeout has scales that stall by it.

    PYTHONPATH=. python3 benchmarks/tcpstore_dns.py [--connections 300] [--address 127.0.0.1]

``--run CMD...`` instead runs CMD (a benchmark, a server) with that /etc/hosts, listing the forms of
every ``--address`` (repeatable; 127.0.0.1 always): what a host whose resolver answers them gets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

SLOW_S = 0.5


def measure(address: str, n: int) -> dict[str, object]:
    from torch.distributed import TCPStore

    server = TCPStore(address, 0, is_master=True, world_size=-1, wait_for_workers=False)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        TCPStore(address, server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
        times.append(time.perf_counter() - t)
    slow = [round(x, 3) for x in times if x > SLOW_S]
    return {"connections": n, "slow": len(slow), "slow_s": slow, "median_ms": round(1e3 * statistics.median(times), 2)}


def run_with_listed_hosts(addresses: list[str], argv: list[str], capture: bool) -> subprocess.CompletedProcess[str]:
    """``argv`` in a private mount namespace whose /etc/hosts also lists the peer forms of
    ``addresses`` that reverse_dns finds missing (root and unshare(1) needed)."""
    from engine_ext.vllm.reverse_dns import network_lookups

    missing = network_lookups([*addresses, "127.0.0.1"])
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"{a} eepctl-peer\n" for a in missing))
        print(f"listed in a private /etc/hosts: {', '.join(missing) or 'nothing missing'}", file=sys.stderr)
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "sh", *argv],
            capture_output=capture,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )


def with_listed_hosts(address: str, n: int) -> dict[str, object] | str:
    """The same measure with the peer forms listed; a string saying why not where that cannot be made."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) for a private /etc/hosts"
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "--address", address, "--connections", str(n)]
    res = run_with_listed_hosts([address], child, capture=True)
    if res.returncode != 0:
        return f"private /etc/hosts failed: {res.stderr.strip().splitlines()[-1:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=300)
    p.add_argument("--address", action="append", help="the peer address (repeatable; default 127.0.0.1)")
    p.add_argument("--run", nargs=argparse.REMAINDER, help="run this command with the peer forms listed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    addresses = a.address or ["127.0.0.1"]
    if a.run:
        sys.exit(run_with_listed_hosts(addresses, a.run, capture=False).returncode)
    a.address = addresses[0]
    if a.child:
        print(json.dumps(measure(a.address, a.connections)))
        return
    print(f"TCPStore connections to {a.address}, {a.connections} each (slow: > {SLOW_S} s)")
    print("host resolver as it is:", json.dumps(measure(a.address, a.connections)))
    listed = with_listed_hosts(a.address, a.connections)
    print("peer forms listed in /etc/hosts:", listed if isinstance(listed, str) else json.dumps(listed))


if __name__ == "__main__":
    main()
