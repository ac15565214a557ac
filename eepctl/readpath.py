"""The light read path: the registry's snapshot without a Ray driver (docs/operations.md, "Read path").

The registry actor serves its snapshot over HTTP on its node's IP and publishes
``{"url", "secret"}`` under ``endpoint_key(namespace, name)`` in the GCS internal KV. eepctl reads
that key with one raw gRPC call to the GCS (InternalKVGet, carrying the Ray token when token auth
is on, as ``cluster._check_auth`` does) and then GETs the snapshot with the secret in a header.
Neither ray nor its generated protobuf modules are imported (importing ray alone costs ~0.8 s):
the two tiny messages are encoded by hand. The endpoint is remembered in eepctl's state dir
(mode 0600) so the next command skips the GCS call. Any failure returns None and the caller
falls back to the Ray driver.
"""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

KV_NAMESPACE = b"eepctl"
SECRET_HEADER = "X-Eep-Secret"
_KV_GET = "/ray.rpc.InternalKVGcsService/InternalKVGet"


def endpoint_key(namespace: str, name: str) -> bytes:
    return f"registry-endpoint/{namespace}/{name}".encode()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _read_fields(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields of a protobuf message (the only kind InternalKVGetReply has
    that we read: status (1) and value (2))."""
    out: dict[int, bytes] = {}
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            while data[i] & 0x80:
                i += 1
            i += 1
            continue
        if wire != 2:
            raise ValueError(f"unexpected wire type {wire}")
        n, i = _read_varint(data, i)
        out[number] = data[i : i + n]
        i += n
    return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    """A protobuf varint at ``i``: its value and the index after it."""
    value, shift = 0, 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def ray_token() -> str | None:
    """The Ray token this process would use, from the places Ray's token loader reads."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def kv_get(host: str, port: int, key: bytes, namespace: bytes = KV_NAMESPACE, timeout_s: float = 2.0) -> bytes | None:
    """One InternalKVGet against the GCS; None when the key is absent."""
    import grpc

    request = _field_bytes(1, key) + _field_bytes(2, namespace)
    token = ray_token()
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        reply = channel.unary_unary(_KV_GET)(request, timeout=timeout_s, metadata=metadata)
    fields = _read_fields(reply)
    status = _read_fields(fields.get(1, b""))  # GcsStatus {int32 code = 1; string message = 2}
    if status.get(2) and 2 not in fields:  # "key not found"
        return None
    return fields.get(2)


def fetch(endpoint: dict[str, Any], timeout_s: float = 10.0, path: str = "") -> dict[str, Any]:
    """GET the snapshot (the published URL), or ``path`` (e.g. ``events?op=ID``) next to it."""
    url = endpoint["url"] if not path else endpoint["url"].rsplit("/", 1)[0] + "/" + path
    req = urllib.request.Request(url, headers={SECRET_HEADER: endpoint["secret"]})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - a URL the registry published
        return msgspec.json.decode(resp.read())


def _cache_file(addr: str, namespace: str, name: str) -> Path:
    from eepctl import cluster

    safe = addr.replace(":", "_").replace("/", "_")
    return cluster.state_dir() / "endpoints" / f"{safe}__{namespace}__{name}.json"


def _cached(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _remember(path: Path, endpoint: dict[str, Any]) -> None:
    """Keep the endpoint for the next command (user-only file: it holds the read secret)."""
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(endpoint, f)
    except OSError:
        pass


def reader(address: str | None, namespace: str, name: str) -> Callable[[], dict[str, Any]] | None:
    """A function returning the snapshot over the light path, or None (use the Ray driver).
    The endpoint remembered from the last command is tried first (no GCS call, no gRPC start-up);
    when it fails the KV is read again."""
    found = _resolve(address, namespace, name, "")
    if found is None:
        return None
    endpoint, first = found
    pending = [first]

    def read() -> dict[str, Any]:
        return pending.pop() if pending else fetch(endpoint)

    return read


def events(
    address: str | None, namespace: str, name: str, op_id: str | None = None, since_seq: int = 0
) -> dict[str, Any] | None:
    """The registry's events and operations (what its ``events`` actor call answers) over the
    light path, or None (use the Ray driver)."""
    query = urllib.parse.urlencode({"since": since_seq, **({"op": op_id} if op_id else {})})
    found = _resolve(address, namespace, name, f"events?{query}")
    if found is None or not {"events", "operations"} <= set(found[1]):  # a registry that serves only its snapshot
        return None
    return found[1]


def _resolve(address: str | None, namespace: str, name: str, path: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the endpoint, its answer at ``path``), from the remembered endpoint or the GCS KV; None
    when there is no light path (or ``EEPCTL_READ_PATH=ray``)."""
    if os.environ.get("EEPCTL_READ_PATH") == "ray":
        return None
    from eepctl import cluster

    addr = cluster.resolve_address(address)
    if addr is None or addr == "auto":
        return None
    cache = _cache_file(addr, namespace, name)
    endpoint = _cached(cache)
    if endpoint is not None:
        try:
            return endpoint, fetch(endpoint, timeout_s=2.0, path=path)
        except Exception:  # noqa: BLE001 - a new registry, or none: ask the GCS
            cache.unlink(missing_ok=True)
    try:
        host, port = cluster.parse_address(addr)
        raw = kv_get(host, port, endpoint_key(namespace, name))
        if not raw:
            return None
        endpoint = json.loads(raw)
        first = fetch(endpoint, timeout_s=2.0, path=path)
    except Exception:  # noqa: BLE001 - any trouble: the Ray driver path reports it properly
        return None
    _remember(cache, endpoint)
    return endpoint, first
