"""Requests through a deployment's HTTP endpoint, whatever engine serves it: `generate`'s prompts
streamed, and open-loop load (eepctl.loadgen)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from eepctl import loadgen
from eepctl.core.reading import status_reader
from eepctl.core.target import Target, driver
from engine_ext.drivers import endpoints, request_key, served_model
from engine_ext.drivers.base import Submit
from engine_ext.drivers.completions import CompletionsClient, TokenSink
from engine_ext.protocol import EepError, UnreachableError, UsageError


def generate(
    t: Target,
    prompts: list[list[int]],
    max_tokens: int,
    timeout_s: float,
    api_key: str | None = None,
    note: Callable[[str], None] = lambda s: None,
    on_token: TokenSink | None = None,
    on_answer: Callable[[int, dict[str, Any]], None] = lambda i, r: None,
) -> dict[str, Any]:
    """Every prompt at once, streamed (``on_token``: each token by prompt position, ``on_answer``:
    each answer in order)."""
    t.validated()
    if max_tokens < 1:
        raise UsageError("--max-tokens must be >= 1")
    deadline = time.time() + timeout_s
    results = []
    with requests(t, max_tokens, timeout_s, api_key, note, on_token) as submit:
        pending = [submit(p) for p in prompts]
        for i, (p, sent) in enumerate(zip(prompts, pending)):
            r = sent.wait(max(0.1, deadline - time.time()))
            results.append(
                {
                    "prompt": p,
                    "output": r.get("output", []),
                    "error": loadgen.error_text(r),
                    "latency_s": round(r.get("latency_s") or 0.0, 4),
                    **{
                        k: r.get(k, d)
                        for k, d in (("rank", None), ("moved_from", []), ("resumed_with", 0), ("resent", 0))
                    },
                }
            )
            on_answer(i, results[-1])
    return {"deployment": t.name, "results": results}


def load(
    t: Target,
    prompts: list[list[int]],
    max_tokens: int,
    rate: float,
    duration_s: float,
    timeout_s: float,
    seed: int = 0,
    api_key: str | None = None,
    note: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Open-loop load: ``rate`` requests per second for ``duration_s``; report outcomes and latency."""
    t.validated()
    if rate <= 0 or duration_s <= 0 or max_tokens < 1:
        raise UsageError("--rate and --duration must be > 0" if max_tokens >= 1 else "--max-tokens must be >= 1")
    with requests(t, max_tokens, timeout_s, api_key, note) as submit, loadgen.interrupt_ends_sending() as stop:
        res = loadgen.open_loop(submit, prompts, rate, duration_s, timeout_s, seed, stop, note)
    return {"deployment": t.name, **res}


def requests(
    t: Target,
    max_tokens: int,
    timeout_s: float,
    api_key: str | None = None,
    note: Callable[[str], None] = lambda s: None,
    on_token: TokenSink | None = None,
) -> AbstractContextManager[Submit]:
    """Prompts through the deployment's HTTP endpoint, whatever engine serves it (the URLs `status`
    shows, from the snapshot; else asked of the cluster), looked up again when one drops a request."""
    try:
        read: Callable[[], dict[str, Any]] | None = status_reader(t)
    except UnreachableError:
        read = None  # the registry is gone (or the deployment): the driver says which
    snap: dict[str, Any] | None = None

    def lookup() -> list[str]:
        nonlocal snap
        try:
            snap = read() if read is not None else None
        except EepError:
            snap = None
        return (endpoints(snap) if snap else []) or driver(t, api_key).endpoints()

    urls = lookup()
    key = request_key(snap, api_key)
    model = served_model(snap, t.name, urls[0], key)
    return CompletionsClient(lookup, key, model, max_tokens, timeout_s, note, on_token).requests()
