"""What answers at a Ray address, found in seconds before ``ray.init`` is trusted with it.

``ray.init`` at an address where no Ray cluster listens retries for many minutes and prints
Ray's own warnings; the likeliest such address is an ingress's HOST:PORT, which `eepctl status`
prints. So eepctl first asks the address: a TCP connection (nothing listens, or nothing answers),
then an HTTP/2 handshake (Ray's GCS speaks gRPC), and when that fails, an HTTP/1 request (an
ingress, Ray's dashboard or another web server). Each failure is one line, exit 3.
"""

from __future__ import annotations

import socket

from engine_ext.protocol import UnreachableError

HINT = "a Ray address is the cluster's GCS HOST:PORT, which `ray start --head` prints (port 6379 unless chosen)"


def require_ray(host: str, port: int, timeout_s: float = 3.0) -> None:
    """Return when an HTTP/2 (gRPC) server answers at ``host:port``; else raise UnreachableError
    saying what is there instead. Takes at most about ``2.5 * timeout_s``. ``host`` is as in the
    address (an IPv6 one in brackets)."""
    where, host = f"{host}:{port}", host.removeprefix("[").removesuffix("]")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except socket.gaierror as e:
        raise UnreachableError(f"no Ray cluster at {where}: cannot resolve {host!r} ({e.strerror})") from None
    except ConnectionRefusedError:
        raise UnreachableError(f"no Ray cluster answers at {where}: nothing listens at {where}") from None
    except TimeoutError:
        raise UnreachableError(f"no Ray cluster answers at {where}: no connection within {timeout_s:g}s") from None
    except OSError as e:
        raise UnreachableError(f"no Ray cluster answers at {where}: {e.strerror or type(e).__name__}") from None
    if speaks_grpc(where, timeout_s):
        return
    http = http_answer(host, port, timeout_s / 2)
    if http is None:
        raise UnreachableError(
            f"no Ray cluster answers at {where}: something listens there but does not speak Ray's protocol; {HINT}"
        )
    what = "it is an ingress" if _is_ingress(http) else "not Ray's protocol"
    raise UnreachableError(f"no Ray cluster answers at {where}; that port answers HTTP: {what}; {HINT}")


def speaks_grpc(target: str, timeout_s: float) -> bool:
    """Whether an HTTP/2 connection (what gRPC, and so Ray's GCS, speaks) to ``target``
    (HOST:PORT) comes up within ``timeout_s``. A server that answers the handshake with
    anything else fails it at once (no wait for the timeout)."""
    import threading

    import grpc

    seen: list[grpc.ChannelConnectivity] = []
    settled = threading.Event()

    def on_state(state: grpc.ChannelConnectivity) -> None:
        seen.append(state)
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            settled.set()

    with grpc.insecure_channel(target) as channel:
        channel.subscribe(on_state, try_to_connect=True)
        settled.wait(timeout_s)
        channel.unsubscribe(on_state)
    return grpc.ChannelConnectivity.READY in seen


def http_answer(host: str, port: int, timeout_s: float) -> bytes | None:
    """The start of the answer to ``GET /health`` over HTTP/1.0, or None when the answer is not
    HTTP (or none comes in time)."""
    request = f"GET /health HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode()
    data = b""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(request)
            while len(data) < 16384:  # HTTP/1.0: the server closes after its answer
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        pass  # a reset or a timeout: what came before it is judged
    return data if data.startswith(b"HTTP/") else None


def _is_ingress(answer: bytes) -> bool:
    """An ingress's ``/health`` body names its members and parked requests (ingress_http)."""
    return b'"members"' in answer and b'"parked"' in answer
