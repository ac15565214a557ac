"""The ingress's HTTP API: OpenAI's completions with a token-id prompt, as vLLM serves it.

``POST /v1/completions`` (``prompt``: a list of token ids, or a list of such lists; ``stream``:
server-sent events, one chunk per token as the owning rank streams it), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). With an API key, ``/v1/*`` and ``/metrics``
want ``Authorization: Bearer <key>`` (``/health`` stays open for load balancers, as vLLM's).

The reference model has no tokenizer: a choice's ``text`` is its token ids joined by spaces, and
``token_ids`` (vLLM's name) holds them as numbers. FastAPI on uvicorn, as vLLM: both come with
the engine's dependencies, and uvicorn runs on the ingress actor's own event loop, so a request
handler awaits the router directly (no thread, no copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request  # module level: FastAPI reads the handlers' annotations from here

from engine_ext.control.router import Router
from engine_ext.ray.completion_request import BadRequest, check_limits, parse_completion, served_model


class IngressHost(Protocol):
    """What the HTTP side uses of the ingress actor that hosts it (engine_ext.ray.ingress.Ingress)."""

    deployment: str
    namespace: str
    index: int
    api_key_sha256: str
    started_at: float
    router: Router
    limits: dict[str, int] | None  # the model's (completion_request.model_limits), as the controller said

    def stats(self) -> dict[str, Any]: ...

    async def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]: ...

    def new_request_id(self) -> str: ...


def _choice(index: int, tokens: list[int], finish: str | None, res: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice; the last one of a request adds ``eep``: the rank that answered, the ranks it
    moved off and the tokens it continued with there (an extension OpenAI clients ignore;
    `eepctl generate` reports it)."""
    choice = {
        "index": index,
        "text": "".join(f" {t}" for t in tokens),
        "token_ids": tokens,
        "logprobs": None,
        "finish_reason": finish,
    }
    if res is not None:
        choice["eep"] = {k: res.get(k) for k in ("rank", "moved_from", "resumed_with", "ingress")}
    return choice


def _error(status: int, message: str, kind: str) -> Any:
    return _refused(BadRequest(message, status=status, kind=kind))


def _refused(e: BadRequest) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


class IngressHttp:
    """The FastAPI app of one ingress and its uvicorn server."""

    def __init__(self, ingress: IngressHost) -> None:
        self.ingress = ingress
        self.server: Any = None
        self.serving: asyncio.Task | None = None  # the server's task, held (an unreferenced task may be collected)
        self.listen = ""  # HOST:PORT the server listens on
        self.note = ""  # why the port is not the one it had before a restart

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host`` at ``port`` (0: the port this ingress had before a restart, else any
        free one: engine_ext.ray.ingress_listen); the URL, once the server listens."""
        import uvicorn

        import ray
        from engine_ext.ray import ingress_listen

        ing = self.ingress
        where = ingress_listen.bind(host, port, ingress_listen.saved_port(ing.namespace, ing.deployment, ing.index))
        ingress_listen.save_port(ing.namespace, ing.deployment, ing.index, where.port)

        class _Server(uvicorn.Server):
            def capture_signals(self) -> Any:  # the actor's process keeps Ray's signal handlers
                return contextlib.nullcontext()

        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False)
        self.server = _Server(config)
        self.serving = await ingress_listen.serve_started(self.server, where)
        self.listen, self.note = f"{host}:{where.port}", where.note
        return ingress_listen.url_for(host, where.port, ray.util.get_node_ip_address())

    def _authorized(self, request: Any) -> bool:
        import hashlib

        want = self.ingress.api_key_sha256
        if not want:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(given.strip().encode()).hexdigest()
        return scheme.lower() == "bearer" and secrets.compare_digest(digest, want)

    def app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import PlainTextResponse, StreamingResponse

        app = FastAPI(title=f"eepctl ingress {self.ingress.deployment}", docs_url=None, redoc_url=None)
        ing = self.ingress

        @app.middleware("http")
        async def guard(request: Request, call_next: Any) -> Any:
            if request.url.path != "/health" and not self._authorized(request):
                return _error(401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key")
            return await call_next(request)

        @app.get("/health")
        async def health() -> Any:
            st = ing.stats()
            ok = bool(st["members"]) and not ing.router.closed
            return _ok_or({"status": "ok" if ok else "no ranks", **st}, 200 if ok else 503)

        @app.get("/v1/models")
        async def models() -> Any:
            return {
                "object": "list",
                "data": [
                    {"id": ing.deployment, "object": "model", "created": int(ing.started_at), "owned_by": "eepctl"}
                ],
            }

        @app.get("/metrics")
        async def metrics() -> Any:
            return PlainTextResponse(prometheus_text(ing), media_type="text/plain; version=0.0.4")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "the body is not JSON", "invalid_request_error")
            try:
                prompts, max_tokens, stream = parse_completion(body)
                model = served_model(body, ing.deployment)
                check_limits(prompts, max_tokens, ing.limits)
            except BadRequest as e:
                return _refused(e)
            if stream:
                return StreamingResponse(self._stream(prompts, max_tokens, model), media_type="text/event-stream")
            return await self._complete(prompts, max_tokens, model)

        return app

    async def _complete(self, prompts: list[list[int]], max_tokens: int, model: str) -> Any:
        results = await asyncio.gather(*(self.ingress.generate(p, max_tokens) for p in prompts))
        failed = sorted((r for r in results if r.get("error")), key=lambda r: not r.get("rejected"))
        if failed and failed[0].get("rejected"):  # a rank refused the input: the client's to change
            return _refused(BadRequest(str(failed[0]["error"])))
        if failed:  # retriable: the deployment could not serve it now (no rank, stopping)
            return _error(503, str(failed[0]["error"]), "service_unavailable")
        out = [r["output"] for r in results]
        n_prompt = sum(len(p) for p in prompts)
        n_out = sum(len(o) for o in out)
        return {
            "id": f"cmpl-{results[0]['request_id']}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [_choice(i, r["output"], "length", r) for i, r in enumerate(results)],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        }

    async def _stream(self, prompts: list[list[int]], max_tokens: int, model: str) -> AsyncIterator[str]:
        """One SSE chunk per token as it arrives (any prompt's), then ``[DONE]``. A request that
        fails ends the stream with an error event (clients see the error, then the end)."""
        router = self.ingress.router
        queue: asyncio.Queue[tuple[int, int | None, dict[str, Any] | None]] = asyncio.Queue()
        rids = [self.ingress.new_request_id() for _ in prompts]
        sent = [0] * len(prompts)
        for i, rid in enumerate(rids):
            router.watchers[rid] = lambda tok, i=i: queue.put_nowait((i, tok, None))

        async def one(i: int) -> None:
            res = await router.submit(prompts[i], max_tokens, rids[i])
            queue.put_nowait((i, None, res))

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        cid = f"cmpl-{rids[0]}"
        open_ = len(prompts)
        try:
            while open_:
                i, tok, res = await queue.get()
                if res is None:
                    sent[i] += 1
                    yield _sse(cid, model, [_choice(i, [int(tok)], None)])  # type: ignore[arg-type]
                    continue
                open_ -= 1
                if res.get("error"):
                    refused = (
                        BadRequest(str(res["error"]))
                        if res.get("rejected")
                        else BadRequest(str(res["error"]), status=503, kind="service_unavailable")
                    )
                    yield f"data: {json.dumps(refused.body())}\n\n"
                    continue
                rest = res["output"][sent[i] :]  # tokens not streamed (a rank that streams none)
                yield _sse(cid, model, [_choice(i, rest, "length", dict(res, ingress=self.ingress.index))])
            yield "data: [DONE]\n\n"
        finally:
            for rid in rids:
                router.watchers.pop(rid, None)
            for t in tasks:
                t.cancel()  # the client went away: its requests are not waited for (a rank still ends them)


def _sse(cid: str, model: str, choices: list[dict[str, Any]]) -> str:
    chunk = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    return f"data: {json.dumps(chunk)}\n\n"


def _ok_or(body: dict[str, Any], status: int) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=status)


def prometheus_text(ing: IngressHost) -> str:
    """The ingress's counters in Prometheus' text format (names in docs/operations.md)."""
    st = ing.stats()
    labels = f'deployment="{ing.deployment}",ingress="{ing.index}"'
    rows = [
        (
            "eep_ingress_requests_total",
            "counter",
            "Requests this ingress answered, by outcome",
            [(f'{labels},outcome="completed"', st["completed"]), (f'{labels},outcome="failed"', st["failed"])],
        ),
        ("eep_ingress_requests_in_flight", "gauge", "Requests on a rank now", [(labels, st["inflight"])]),
        (
            "eep_ingress_requests_parked",
            "gauge",
            "Requests waiting for a world that can serve them",
            [(labels, st["parked"])],
        ),
        ("eep_ingress_rerouted_total", "counter", "Requests moved off a dead rank", [(labels, st["rerouted"])]),
        (
            "eep_ingress_stale_messages_dropped_total",
            "counter",
            "Tokens and results from a non-owner or a fenced world",
            [(labels, st["stale_dropped"] + st["fenced_dropped"])],
        ),
    ]
    out = []
    for name, kind, help_, samples in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        out += [f"{name}{{{lab}}} {val}" for lab, val in samples]
    return "\n".join(out) + "\n"
