"""The client-side load generator: open-loop requests at a fixed rate, and latency percentiles.

It knows nothing of Ray or HTTP: a ``submit`` function sends one prompt and returns a ``Pending``
whose ``wait(timeout_s)`` gives the engine's answer (``output``, ``latency_s``, ``error``,
``moved_from``, ``resumed_with``). Each deployment's driver provides one (``engine_ext.drivers``, its ``requests``).
"""

from __future__ import annotations

import random
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from engine_ext.drivers.base import Pending, Submit
from engine_ext.protocol import EepError

__all__ = [
    "DEFAULT_PROMPTS",
    "SENDING",
    "Pending",
    "Submit",
    "error_text",
    "interrupt_ends_sending",
    "open_loop",
    "percentiles",
]

DEFAULT_PROMPTS: list[list[int]] = [
    [1, 2, 3, 4, 5],
    [17, 42, 99, 7],
    [200, 13, 13, 8, 250, 3, 61],
    [5, 6, 7, 8, 9, 10, 11, 12],
    [128],
    [77, 78, 79],
]


def error_text(answer: dict[str, Any]) -> str | None:
    e = answer.get("error")
    if e is None:
        return None
    return e if isinstance(e, str) else str(e)


# The note `generate --rate` gives once connected and sending: before it, a SIGINT interrupts the
# command (exit 130); from it on, the first SIGINT ends the sending and the report still comes.
SENDING = (
    "sending {rate:g} requests/s for {duration:g} s (the first Ctrl-C ends the sending; what was "
    "sent is still awaited and reported)"
)


@contextmanager
def interrupt_ends_sending() -> Iterator[threading.Event]:
    """While open: the first SIGINT (Ctrl-C, or a script's ``kill -INT``) sets the event, which
    ends the sending early; the requests already sent are still awaited and reported. A second
    SIGINT interrupts as usual. Outside the main thread nothing is installed."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if stop.is_set():
            from eepctl.interrupt import interrupted

            interrupted(signum, frame)
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def open_loop(
    submit: Submit,
    prompts: list[list[int]],
    rate: float,
    duration_s: float,
    timeout_s: float,
    seed: int = 0,
    stop: threading.Event | None = None,
    note: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """``rate`` requests per second for ``duration_s`` (open loop: a slow answer does not delay
    the next request), prompts drawn with ``seed``; every outcome and the latency percentiles.
    ``stop`` set: no more requests are sent (``stopped_early`` in the result); those sent are awaited.
    Each request gets ``timeout_s`` from its own sending, so a long load does not eat the last ones'.
    ``note`` gets `SENDING` as the sending begins (a caller's SIGINT handler is in place by then)."""
    stop = stop or threading.Event()
    t0 = time.time()
    note(SENDING.format(rate=rate, duration=duration_s))
    sent = _send_paced(submit, prompts, rate, max(1, int(rate * duration_s)), random.Random(seed), stop, t0)
    n = len(sent)
    records = [_answer_record(idx, sent_at, pending, timeout_s) for idx, sent_at, pending in sent]
    lat = sorted(r["latency_s"] for r in records if not r["error"] and r["latency_s"] is not None)
    return {
        "sent": n,
        "completed": len(lat),
        "failed": n - len(lat),
        "duration_s": round(time.time() - t0, 2),
        "rate": rate,
        "stopped_early": stop.is_set(),
        "latency_s": percentiles(lat),
        "prompts": prompts,
        "records": records,
    }


def _send_paced(
    submit: Submit,
    prompts: list[list[int]],
    rate: float,
    n: int,
    rng: random.Random,
    stop: threading.Event,
    t0: float,
) -> list[tuple[int, float, Pending]]:
    """Up to ``n`` prompts drawn with ``rng``, the i-th sent at ``t0 + i / rate`` whatever the
    answers do; ``stop`` set ends the sending once one was sent. Each: (prompt index, sent at, pending)."""
    sent: list[tuple[int, float, Pending]] = []
    for i in range(n):
        delay = t0 + i / rate - time.time()
        if delay > 0:
            stop.wait(delay)
        if stop.is_set() and sent:
            break
        idx = rng.randrange(len(prompts))
        sent.append((idx, time.time(), submit(prompts[idx])))
    return sent


def _answer_record(idx: int, sent_at: float, pending: Pending, timeout_s: float) -> dict[str, Any]:
    """A sent request's outcome, awaited ``timeout_s`` from its own sending (at least a second)."""
    try:
        r = pending.wait(max(1.0, timeout_s - (time.time() - sent_at)))
    except EepError as e:
        r = {"error": e.message}
    return {
        "prompt_index": idx,
        "output": r.get("output", []),
        "error": error_text(r),
        "latency_s": r.get("latency_s"),
        "rank": r.get("rank"),
        "moved_from": r.get("moved_from", []),
        "resumed_with": r.get("resumed_with", 0),
        "sent_at": round(sent_at, 3),
        "resent": r.get("resent", 0),
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (nearest rank), max and mean, rounded to 0.1 ms; all None without values."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    v = sorted(values)

    def pct(p: float) -> float:
        return round(v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))], 4)

    return {
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": round(v[-1], 4),
        "mean": round(statistics.fmean(v), 4),
    }
