"""A reference deployment's HTTP API, as `eepctl up` sets it: where its ingresses listen and the
key they want. Pure: no Ray, no network."""

from __future__ import annotations

import hashlib
import ipaddress

from engine_ext.protocol import UsageError


def check_listen(host: str, port: int, ingress: int) -> None:
    """``--host``: an IPv4 address; ``--port``: 0 (any free port) or one that leaves room for
    every ingress (ingress i listens on port + i)."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise UsageError(
            f"--host must be an IPv4 address (0.0.0.0: every interface; 127.0.0.1: this node only), not {host!r}"
        ) from None
    if port != 0 and not 0 < port <= 65536 - ingress:
        raise UsageError(
            f"--port must be 0 (any free port) or 1-{65536 - ingress} (ingress i listens on PORT+i), got {port}"
        )


def key_digest(api_key: str) -> str:
    """What the ingress keeps of an API key: its SHA-256 (the key itself never reaches Ray)."""
    return hashlib.sha256(api_key.encode()).hexdigest()
