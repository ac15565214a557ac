"""Where an ingress listens (engine_ext.ray.ingress_listen), with real sockets and a real uvicorn
server, no Ray: a pinned port that is taken is an error naming it; a restart whose old port was
taken takes another and says the URL changed; a server whose serve task fails before it listens
raises that failure at once instead of being waited for forever. The same through `eepctl up
--port` on a real cluster: tests/test_ingress_ray.py::test_http_api_with_curl_and_the_openai_client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from engine_ext.ray.ingress_listen import ListenError, bind, serve_started, url_for


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port a socket of this test listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_pinned_port_that_is_taken_is_an_error_naming_it(held_port: int) -> None:
    with pytest.raises(ListenError, match=rf"cannot listen on 127.0.0.1:{held_port}: Address already in use"):
        bind("127.0.0.1", held_port, saved=_free_port())  # pinned wins over a saved port


def test_a_pinned_port_is_taken_when_free() -> None:
    port = _free_port()
    where = bind("127.0.0.1", port, saved=0)
    with contextlib.closing(where.sock):
        assert (where.port, where.note) == (port, "")


def test_a_restart_takes_its_old_port_again_or_says_the_url_changed(held_port: int) -> None:
    port = _free_port()
    again = bind("127.0.0.1", 0, saved=port)
    with contextlib.closing(again.sock):
        assert (again.port, again.note) == (port, "")
    moved = bind("127.0.0.1", 0, saved=held_port)
    with contextlib.closing(moved.sock):
        assert moved.port not in (0, held_port)
        assert moved.note == f"port {held_port} was taken when it restarted: now {moved.port} (the URL changed)"


def test_an_address_the_node_does_not_have_is_an_error() -> None:
    with pytest.raises(ListenError, match="cannot listen on 203.0.113.77:0: Cannot assign requested address"):
        bind("203.0.113.77", 0)  # TEST-NET-3 (documentation only): on no interface


def test_url_names_the_node_when_listening_everywhere() -> None:
    assert url_for("0.0.0.0", 8000, "10.0.0.5") == "http://10.0.0.5:8000"
    assert url_for("127.0.0.1", 8000, "10.0.0.5") == "http://127.0.0.1:8000"


def _server() -> Any:
    import uvicorn
    from fastapi import FastAPI

    return uvicorn.Server(uvicorn.Config(FastAPI(), log_level="critical", lifespan="off", access_log=False))


def test_a_serve_task_that_fails_before_it_listens_raises_its_error() -> None:
    """Two sockets may bind one port while neither listens (SO_REUSEADDR); the one that listens
    first wins and the other's listen fails: the uvicorn serve task dies with EADDRINUSE and
    ``server.started`` never turns true. The start says so at once (it waited forever)."""
    where = bind("127.0.0.1", 0)
    rival = socket.socket()
    rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    rival.bind(("127.0.0.1", where.port))
    rival.listen()  # first
    server = _server()

    async def start() -> None:
        await asyncio.wait_for(serve_started(server, where, timeout_s=60), timeout=20)

    try:
        with pytest.raises(ListenError, match=rf"cannot listen on 127.0.0.1:{where.port}: Address already in use"):
            asyncio.run(start())
    finally:
        rival.close()
        where.sock.close()
    assert not server.started


def test_a_server_that_starts_answers() -> None:
    where = bind("127.0.0.1", 0)
    server = _server()

    async def start_and_stop() -> bool:
        task = await serve_started(server, where)
        _, writer = await asyncio.open_connection("127.0.0.1", where.port)
        writer.close()
        server.should_exit = True
        await asyncio.wait_for(task, timeout=20)
        return task.done() and task.exception() is None

    assert asyncio.run(start_and_stop())
