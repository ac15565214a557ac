"""Helpers shared by the engine tests (not a test module: nothing here is collected)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """Run a scenario in a fresh event loop, bounded so a hang fails instead of blocking CI."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def oracle_mismatch(pairs: list[tuple[int, dict]], ref: list[dict], *, rel_tol: float = 1e-9,
                    logits: bool = True) -> str:
    """'' when every (prompt index, result) equals the oracle's greedy tokens (and logits), else why not."""
    for idx, got in pairs:
        if got.get("error"):
            return f"request for prompt {idx} failed: {got['error']}"
        want = ref[idx]
        if got["output"] != want["output"]:
            return f"prompt {idx}: tokens {got['output']} != oracle {want['output']}"
        if logits:
            for a, b in zip(got["logits"], want["logits"], strict=True):
                if not math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0):
                    return f"prompt {idx}: logit {a!r} != oracle {b!r}"
    return ""


async def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
