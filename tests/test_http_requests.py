"""`eepctl generate`'s HTTP client (engine_ext.drivers.completions) against a real HTTP server on
this host that answers as an ingress does, or fails as one can: a stream cut before ``[DONE]``
(the ingress died), HTTP 503, a refused key, refused input, a 500, nothing listening. In-process,
no cluster: the real ingress behind it is tests/test_ingress_ray.py's."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from engine_ext.drivers import completions
from engine_ext.drivers.completions import CompletionsClient
from engine_ext.protocol import UnreachableError, UsageError

TOKENS = [7, 8, 9]


class _Endpoint(BaseHTTPRequestHandler):
    """``/ok``: the whole stream; ``/cut``: one token, then the connection closes; ``/slow``: one
    token, then nothing for 3 s (the client ends first); ``/busy``:
    503; ``/key``: 401; ``/bad``: 400; ``/broken``: 500; ``/invalid``: a stream whose one event is
    an ``invalid_request_error`` (a rank refused the input after the stream began) (each an
    endpoint's URL prefix)."""

    hits: list[str] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        kind = self.path.split("/")[1]
        self.hits.append(kind)
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        codes = {"busy": 503, "key": 401, "bad": 400, "broken": 500}
        if kind in codes:
            body = json.dumps({"error": {"message": f"{kind} says no", "code": codes[kind]}}).encode()
            self.send_response(codes[kind])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if kind == "invalid":
            err = {
                "message": "prompt + max_tokens exceeds max_model_len 128",
                "type": "invalid_request_error",
                "param": None,
                "code": 400,
            }
            self.wfile.write(f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode())
            return
        for i, tok in enumerate(TOKENS):
            last = i == len(TOKENS) - 1
            choice: dict[str, Any] = {"index": 0, "token_ids": [tok], "finish_reason": "length" if last else None}
            if last:
                choice["eep"] = {"rank": 1, "moved_from": [0], "resumed_with": 2, "ingress": 1}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
            if kind == "cut":
                self.close_connection = True
                return  # no [DONE]: the stream ends as an ingress's does when it dies
            if kind == "slow":
                time.sleep(3.0)
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _send(urls: list[str], prompt: list[int] | None = None, **kw: Any) -> tuple[dict[str, Any], list[str], list[int]]:
    notes: list[str] = []
    streamed: list[int] = []
    client = CompletionsClient(
        lambda: urls, None, "m", 3, 10.0, note=notes.append, on_token=lambda seq, tok: streamed.append(tok), **kw
    )
    with client.requests() as submit:
        return submit(prompt or [1, 2]).wait(10.0), notes, streamed


def test_a_cut_stream_is_resent_from_the_prompt_to_the_next_endpoint_with_a_note(server: str) -> None:
    """Turned off, the re-send would leave the request failed (the next test's retry window 0)."""
    res, notes, streamed = _send([f"{server}/cut", f"{server}/ok"])
    assert res["output"] == TOKENS and res["error"] is None and res["resent"] == 1, res
    assert (res["rank"], res["moved_from"], res["resumed_with"], res["ingress"]) == (1, [0], 2, 1), res
    assert streamed == TOKENS, "the retry's first token was passed on twice"
    assert len(notes) == 1 and f"re-sent from its prompt to {server}/ok" in notes[0] and "/cut" in notes[0], notes


def test_without_the_retry_window_a_cut_stream_fails_the_request(server: str) -> None:
    res, notes, _ = _send([f"{server}/cut", f"{server}/ok"], retry_window_s=0.0)
    assert res["output"] == [] and "dropped the stream" in res["error"] and not notes, res


def test_a_client_ending_its_own_streams_neither_resends_nor_notes(server: str) -> None:
    """`eepctl generate` told SIGTERM closes its client with streams open: what those streams then
    raise is the client's own doing. Without the closed check each is noted as "re-sent" after the
    command's one interruption line, and sent again to the next endpoint."""
    _Endpoint.hits.clear()
    notes: list[str] = []
    client = CompletionsClient(lambda: [f"{server}/slow", f"{server}/ok"], None, "m", 3, 10.0, note=notes.append)
    with client.requests() as submit:
        pending = submit([1, 2])
        deadline = time.time() + 5
        while _Endpoint.hits != ["slow"] and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # its first token is on the way
    res = pending.wait(10.0)
    time.sleep(1.0)  # a re-send would have been noted within the first back-off (0.5 s)
    assert res["error"] == "the client stopped reading" and not notes and _Endpoint.hits == ["slow"], (res, notes)


def test_a_503_is_resent_and_what_a_retry_cannot_change_ends_the_request_or_the_command(server: str) -> None:
    _Endpoint.hits.clear()
    res, notes, _ = _send([f"{server}/busy", f"{server}/ok"])
    assert res["output"] == TOKENS and res["resent"] == 1 and _Endpoint.hits == ["busy", "ok"], (res, notes)
    res, notes, _ = _send([f"{server}/broken", f"{server}/ok"])
    assert res["error"] == "HTTP 500: broken says no" and not notes, res  # a request failed: exit 5
    with pytest.raises(UnreachableError, match=r"refused the API key \(HTTP 401\)"):  # exit 3
        _send([f"{server}/key"])
    with pytest.raises(UsageError, match=r"refused the request \(HTTP 400\): bad says no"):  # exit 2
        _send([f"{server}/bad"])


def test_input_refused_in_the_stream_ends_the_command_and_is_not_resent(server: str) -> None:
    """An ingress's rank refused the input after the stream's 200: exit 2 with the ingress's line,
    as a 400 is, and the request is not sent to the next endpoint."""
    _Endpoint.hits.clear()
    with pytest.raises(UsageError, match=r"refused the request \(HTTP 400\): prompt \+ max_tokens exceeds"):
        _send([f"{server}/invalid", f"{server}/ok"])
    assert _Endpoint.hits == ["invalid"]


@contextmanager
def _unanswering() -> Iterator[str]:
    """A URL whose connections are never made: a listening socket with a full accept queue, so the
    kernel drops each new connection's SYN and the client's connect times out."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        fill = [socket.socket() for _ in range(4)]
        for c in fill:
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for c in fill:
                c.close()


def test_a_connect_timeout_is_resent_as_a_refused_connection_is(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection not made in time is an endpoint not reachable (sent again to the next one), not a
    request that got no answer."""
    monkeypatch.setattr(completions, "CONNECT_TIMEOUT_S", 0.3)
    with _unanswering() as url:
        res, notes, streamed = _send([url, f"{server}/ok"])
    assert res["output"] == TOKENS and res["error"] is None and res["resent"] == 1, res
    assert len(notes) == 1 and f"{url} not reachable (ConnectTimeout)" in notes[0], notes


def test_nothing_listening_is_unreachable_after_the_retry_window() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UnreachableError, match=rf"127.0.0.1:{port}: not reachable \(ConnectError\)"):
        _send([f"http://127.0.0.1:{port}"], retry_window_s=1.0)
