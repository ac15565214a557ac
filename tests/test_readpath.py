"""The light read path's hand-encoded GCS messages agree with Ray's generated protobuf classes,
and its endpoint cache is a user-only file that a failing endpoint drops."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from eepctl import readpath


def test_kv_get_request_and_reply_match_rays_protobuf() -> None:
    gcs = pytest.importorskip("ray.core.generated.gcs_service_pb2")
    key = b"registry-endpoint/eepctl/" + b"x" * 200  # a length over one varint byte
    req = gcs.InternalKVGetRequest.FromString(readpath._field_bytes(1, key) + readpath._field_bytes(2, b"eepctl"))
    assert req.key == key and req.namespace == b"eepctl"
    found = gcs.InternalKVGetReply(status=gcs.GcsStatus(code=0), value=b'{"url": "u"}').SerializeToString()
    assert readpath._read_fields(found)[2] == b'{"url": "u"}'
    missing = gcs.InternalKVGetReply(status=gcs.GcsStatus(code=17, message="key not found")).SerializeToString()
    fields = readpath._read_fields(missing)
    assert 2 not in fields and readpath._read_fields(fields[1])[2] == b"key not found"


def test_endpoint_cache_is_user_only_and_dropped_when_it_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EEPCTL_STATE_DIR", str(tmp_path))
    path = readpath._cache_file("127.0.0.1:1", "eepctl", "moe")
    readpath._remember(path, {"url": "http://127.0.0.1:1/snapshot", "secret": "s"})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert readpath._cached(path) == {"url": "http://127.0.0.1:1/snapshot", "secret": "s"}
    # nothing listens there and no GCS either: no light path, and the dead endpoint is forgotten
    assert readpath.reader("127.0.0.1:1", "eepctl", "moe") is None
    assert not path.exists()
