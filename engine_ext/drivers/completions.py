"""Requests through a deployment's OpenAI completions endpoint, the same for every engine kind.

A reference deployment's ingresses (engine_ext.ray.ingress_http) and a vLLM API server both
take ``POST /v1/completions`` with a token-id prompt and stream server-sent events with the
token ids (``return_token_ids``); `eepctl generate` sends every prompt that way, streamed, on
client threads. A request whose endpoint dropped it (connection refused, timed out or reset, a
stream cut before ``[DONE]``, HTTP 503) is sent again from its prompt, to the next endpoint,
within the retry window and its own deadline; ``note`` gets one line saying so, and its answer
counts the re-sends (``resent``). Greedy decoding makes the retry's first tokens the ones already
passed to ``on_token``: they are not passed again.

What ends the command instead of one request (the exit-code table): a refused key (401/403,
exit 3), a request the endpoint refuses as input (other 4xx, or an ``invalid_request_error`` in
the stream: exit 2, never sent again), and a request that never reached any endpoint (exit 3).
``httpx`` is imported inside the calls; the key goes into one header only.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

from engine_ext.drivers.base import Submit
from engine_ext.protocol import TransitionTimeout, UnreachableError, UsageError

RETRY_WINDOW_S = 20.0  # how long after its first drop a request is still sent again
CONNECT_TIMEOUT_S = 5.0  # a connection not made within it is an endpoint not reachable: sent again
REFRESH_EVERY_S = 1.0  # the endpoints are looked up again at most this often (an ingress moved)
CLIENT_THREADS = 64

TokenSink = Callable[[int, int], None]
"""Receives (the request's number in sending order, one output token) as it streams."""


class Dropped(Exception):
    """The endpoint dropped the request (not reached, reset, stream cut, 503): send it again."""


class Failed(Exception):
    """The endpoint answered the request with an error that a retry would not change."""


class HttpPending:
    """One request in flight on a client thread."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self.future.result(timeout=timeout_s)
        except FutureTimeout:
            raise TransitionTimeout(f"no answer within {timeout_s:.0f}s") from None


class CompletionsClient:
    """Prompts to the endpoints ``endpoints()`` names (looked up again when one drops a request)."""

    def __init__(
        self,
        endpoints: Callable[[], list[str]],
        api_key: str | None,
        model: str,
        max_tokens: int,
        timeout_s: float,
        note: Callable[[str], None] = lambda s: None,
        on_token: TokenSink | None = None,
        retry_window_s: float = RETRY_WINDOW_S,
    ) -> None:
        self._lookup, self.urls = endpoints, list(endpoints())
        self._looked_at = time.time()
        self._lock = threading.Lock()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model, self.max_tokens, self.timeout_s = model, max_tokens, timeout_s
        self.note, self.on_token, self.retry_window_s = note, on_token, retry_window_s
        self.http: Any = None
        self._closed = threading.Event()  # the command is ending: drops are its own doing, never re-sent

    def __repr__(self) -> str:  # never shows the key
        return f"CompletionsClient({self.urls!r})"

    @contextmanager
    def requests(self) -> Iterator[Submit]:
        import httpx

        self._closed.clear()
        self.http = httpx.Client(limits=httpx.Limits(max_connections=CLIENT_THREADS))
        pool = ThreadPoolExecutor(max_workers=CLIENT_THREADS, thread_name_prefix="eepctl-request")
        sent = iter(range(1 << 62))
        try:
            yield lambda prompt: HttpPending(pool.submit(self.complete, next(sent), list(prompt), time.time()))
        finally:  # after a timeout or a signal, do not wait for answers nobody reads (their streams end here)
            self._closed.set()
            pool.shutdown(wait=False, cancel_futures=True)
            self.http.close()

    def _refresh(self) -> None:
        with self._lock:
            if time.time() - self._looked_at < REFRESH_EVERY_S:
                return
            self._looked_at = time.time()
        try:
            urls = self._lookup()
        except Exception:  # noqa: BLE001 - keep the endpoints known; the next drop asks again
            return
        if urls:
            self.urls = list(urls)

    def complete(self, seq: int, prompt: list[int], submitted: float) -> dict[str, Any]:
        """One request, sent again from its prompt while its endpoint drops it."""
        deadline = submitted + self.timeout_s
        delivered, resent, reached, first_drop = [0], 0, False, 0.0
        at = seq
        while True:
            url = self.urls[at % len(self.urls)]
            try:
                res = self._once(url, seq, prompt, deadline, delivered)
                res["latency_s"] = round(time.time() - submitted, 4)
                return dict(res, resent=resent) if resent else res
            except Failed as e:
                return {"output": [], "error": str(e), "latency_s": round(time.time() - submitted, 4), "resent": resent}
            except Dropped as e:
                if self._closed.is_set():  # the client closed its own streams: nothing to re-send or note
                    return {
                        "output": [],
                        "error": "the client stopped reading",
                        "resent": resent,
                        "latency_s": round(time.time() - submitted, 4),
                    }
                reached = reached or not str(e).startswith("not reachable")
                first_drop = first_drop or time.time()
                wait = min(2.0, 0.5 * 2 ** min(resent, 4))
                if time.time() + wait >= min(deadline, first_drop + self.retry_window_s):
                    if not reached:
                        raise UnreachableError(f"{url}: {e}") from None
                    return {
                        "output": [],
                        "error": f"{url}: {e} (sent {resent + 1} times)",
                        "latency_s": round(time.time() - submitted, 4),
                        "resent": resent,
                    }
                if self._closed.wait(wait):
                    return {
                        "output": [],
                        "error": "the client stopped reading",
                        "resent": resent,
                        "latency_s": round(time.time() - submitted, 4),
                    }
                self._refresh()
                at += 1
                resent += 1
                self.note(f"request {seq} re-sent from its prompt to {self.urls[at % len(self.urls)]}: {url} {e}")

    def _once(self, url: str, seq: int, prompt: list[int], deadline: float, delivered: list[int]) -> dict[str, Any]:
        """Send once and read the stream to its end: the output and where it was served."""
        import httpx

        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        left = max(0.1, deadline - time.time())
        try:
            with self.http.stream(
                "POST",
                url + "/v1/completions",
                json=body,
                headers=self._headers,
                timeout=httpx.Timeout(left, connect=min(left, CONNECT_TIMEOUT_S)),
            ) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise _refusal(url, resp.status_code, _decoded(resp.text))
                return self._read(url, resp.iter_lines(), seq, delivered)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # before TimeoutException: a ConnectTimeout is one
            raise Dropped(f"not reachable ({type(e).__name__})") from None
        except httpx.TimeoutException:
            raise Failed(f"no answer within {self.timeout_s:.0f}s") from None
        except httpx.HTTPError as e:  # reset, or the stream cut mid-way (the ingress died)
            raise Dropped(f"dropped the stream ({type(e).__name__})") from None

    def _read(self, url: str, lines: Iterator[str], seq: int, delivered: list[int]) -> dict[str, Any]:
        tokens: list[int] = []
        where: dict[str, Any] = {}
        for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return {
                    "output": tokens,
                    "error": None,
                    "rank": where.get("rank"),
                    "moved_from": where.get("moved_from") or [],
                    "resumed_with": where.get("resumed_with") or 0,
                    "ingress": where.get("ingress"),
                }
            chunk = _decoded(data)
            if isinstance(chunk, dict) and chunk.get("error"):
                err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                if err.get("type") == "invalid_request_error":  # the input, refused after the stream began
                    raise _refusal(url, 400, chunk)
                raise (Dropped if err.get("code") in (503, None, "503") else Failed)(f"answered: {_message(chunk)}")
            for choice in (chunk.get("choices") or []) if isinstance(chunk, dict) else []:
                for tok in choice.get("token_ids") or []:
                    tokens.append(int(tok))
                    if len(tokens) > delivered[0]:
                        delivered[0] = len(tokens)
                        if self.on_token is not None:
                            self.on_token(seq, int(tok))
                where = choice.get("eep") or where
        raise Dropped("dropped the stream (it ended before [DONE])")


def _refusal(url: str, code: int, body: Any) -> Exception:
    """A non-200 answer: for the whole command (key, input) or for this request."""
    if code in (401, 403):
        return UnreachableError(f"{url} refused the API key (HTTP {code}); pass --api-key or set VLLM_API_KEY")
    if code == 503:
        return Dropped(f"answered HTTP 503: {_message(body)}")
    if 400 <= code < 500:
        return UsageError(f"{url} refused the request (HTTP {code}): {_message(body)}")
    return Failed(f"HTTP {code}: {_message(body)}")


def _decoded(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _message(body: Any) -> str:
    from engine_ext.control.vllm_api import message_of

    return message_of(body)
