"""The registry: a named, detached actor per deployment holding what its ranks report.

Ranks push to it fire-and-forget; losing it never stops serving, and a new one rebuilds the
picture from the ranks' next heartbeats and re-sent events. It also serves its snapshot and its
events over HTTP for eepctl's light read path (eepctl/readpath.py, docs/operations.md "Read path").
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec

from engine_ext.control.registry_state import RegistryState
from engine_ext.ray import ray_private

KV_NAMESPACE = "eepctl"  # eepctl.readpath reads the same key; engine_ext must not import eepctl
SECRET_HEADER = "X-Eep-Secret"


def endpoint_key(namespace: str, name: str) -> str:
    return f"registry-endpoint/{namespace}/{name}"


class Registry:
    def __init__(self, deployment: str, kind: str = "reference", expected_ranks: int | None = None) -> None:
        self.state = RegistryState(deployment, kind)
        if expected_ranks:  # recreated by the controller: rebuilding until that many ranks report
            self.state.expected_ranks = expected_ranks
        self._lock = threading.Lock()  # the HTTP thread reads while actor calls write
        self._server: ThreadingHTTPServer | None = None
        self.endpoint: dict[str, str] | None = None
        try:
            self._serve_snapshot()
        except Exception:  # noqa: BLE001 - no light read path: eepctl falls back to the Ray driver
            self.endpoint = None

    def _serve_snapshot(self) -> None:
        """An HTTP server on this node's IP answering GET with the snapshot to a caller holding
        the secret; its URL and secret go into the GCS internal KV, which only a caller that
        may talk to the GCS (with the Ray token, when token auth is on) can read."""
        import ray

        if not ray.is_initialized():
            return
        secret = secrets.token_hex(16)
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if not hmac.compare_digest(self.headers.get(SECRET_HEADER, ""), secret):
                    self.send_error(403)
                    return
                url = urlsplit(self.path)
                if url.path == "/snapshot":
                    data = registry.snapshot()
                elif url.path == "/events":  # GET /events?op=ID&since=SEQ: what the `events` actor call answers
                    q = parse_qs(url.query)
                    try:
                        since = int(q.get("since", ["0"])[0])
                    except ValueError:
                        self.send_error(400)
                        return
                    data = registry.events(q.get("op", [None])[0] or None, since)
                else:
                    self.send_error(404)
                    return
                body = msgspec.json.encode(data, enc_hook=str)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        ip = ray.util.get_node_ip_address()
        self._server = ThreadingHTTPServer((ip, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="registry-http", daemon=True).start()
        self.endpoint = {"url": f"http://{ip}:{self._server.server_address[1]}/snapshot", "secret": secret}
        namespace = ray.get_runtime_context().namespace
        ray_private.kv_put(endpoint_key(namespace, self.state.deployment), json.dumps(self.endpoint), KV_NAMESPACE)

    def set_info(self, info: dict[str, Any]) -> None:
        with self._lock:
            self.state.set_info(info)

    def info_value(self, key: str) -> Any:
        """One entry of the deployment's info (the vLLM API server reads its desired standby count)."""
        with self._lock:
            return self.state.info.get(key)

    def report_status(self, status: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self.state.report_status(status)

    def report_worker(self, record: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self.state.report_worker(record)

    def report_events(self, events: list[dict[str, Any]]) -> dict[str, int]:
        """Each event on its own: a malformed one (ValueError/TypeError) is counted, not fatal to the
        rest of the batch (callers send fire-and-forget, so no error is raised for it)."""
        if not isinstance(events, (list, tuple)):
            raise TypeError(f"events must be a list, not {type(events).__name__}")
        refused = 0
        with self._lock:
            for ev in events:
                try:
                    self.state.report_event(ev)
                except (ValueError, TypeError):
                    refused += 1
        return {"accepted": len(events) - refused, "refused": refused}

    def record_operation(self, op: dict[str, Any]) -> None:
        with self._lock:
            self.state.record_operation(op)

    def forget_rank(self, rank: int) -> None:
        with self._lock:
            self.state.forget_rank(rank)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self.state.snapshot()

    def events(self, op_id: str | None = None, since_seq: int = 0) -> dict[str, Any]:
        with self._lock:
            return {"events": self.state.events_for(op_id, since_seq), "operations": self.state.operations(op_id)}

    def ping(self) -> str:
        return self.state.deployment
