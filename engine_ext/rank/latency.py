"""Per-request time to first token and time per output token, as the rank measures them, and
their windowed p50/p95 for the rank's status (the autoscaler's SLO signals).

TTFT runs from the request's arrival at this rank to its first token; a request moved here with
tokens already generated elsewhere has none. TPOT is the mean gap between its later tokens.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

WINDOW_S = 60.0


def percentile(samples: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``samples``; None when there are none."""
    if not samples:
        return None
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class LatencyWindow:
    """The TTFT/TPOT samples (ms) of the requests finished in the last ``window_s`` seconds."""

    def __init__(self, window_s: float = WINDOW_S, keep: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, ttft_ms: float | None, tpot_ms: float | None, now: float | None = None) -> None:
        with self._lock:
            self._samples.append((time.time() if now is None else now, ttft_ms, tpot_ms))

    def summary(self, now: float | None = None) -> dict[str, float | int | None]:
        """``ttft_ms_p50/p95``, ``tpot_ms_p50/p95`` (None without samples), ``latency_samples``."""
        now = time.time() if now is None else now
        with self._lock:
            while self._samples and self._samples[0][0] < now - self.window_s:
                self._samples.popleft()
            rows = list(self._samples)
        ttft = [t for _, t, _ in rows if t is not None]
        tpot = [t for _, _, t in rows if t is not None]
        out: dict[str, float | int | None] = {"latency_samples": len(rows), "latency_window_s": self.window_s}
        for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot)):
            for q in (50, 95):
                v = percentile(xs, q / 100)
                out[f"{name}_p{q}"] = None if v is None else round(v, 3)
        return out


class RequestSeconds:
    """The requests held here (waiting + running) integrated over time, a counter that only grows.
    Two readings give the exact mean held between them (Little's law), where a count sampled once
    a tick misses every request shorter than the tick: a light load read as no load at all."""

    def __init__(self) -> None:
        self._held, self._total, self._since = 0, 0.0, time.time()
        self._lock = threading.Lock()

    def change(self, delta: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._total += self._held * max(0.0, now - self._since)
            self._held, self._since = max(0, self._held + delta), now

    def total(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        with self._lock:
            return self._total + self._held * max(0.0, now - self._since)


def request_latency(
    arrival: float, first_token_at: float | None, finished_at: float, tokens: int
) -> tuple[float | None, float | None]:
    """(TTFT ms, TPOT ms) of one finished request; None where it cannot be measured here."""
    if first_token_at is None:
        return None, None
    ttft = (first_token_at - arrival) * 1000.0
    tpot = (finished_at - first_token_at) * 1000.0 / (tokens - 1) if tokens > 1 else None
    return round(ttft, 3), None if tpot is None else round(tpot, 3)


class ServedTokens:
    """Tokens this rank served (a request's prompt positions and each output token it produced:
    ``len(prompt) + max_tokens`` over its life, what the router counts it asking for), and the seconds
    and tokens of the steps it took while requests waited for room (saturated: its batch was as
    full as its slots, KV blocks and token budget allow). Counters that only grow: two readings'
    saturated tokens over saturated seconds are the rank's capacity at saturation, in tokens per
    second, which the autoscaler learns from the ranks' status records."""

    def __init__(self) -> None:
        self.tokens, self.saturated_tokens, self.saturated_s = 0, 0, 0.0
        self._lock = threading.Lock()

    def add(self, tokens: int, seconds: float, saturated: bool) -> None:
        with self._lock:
            self.tokens += tokens
            if saturated:
                self.saturated_tokens += tokens
                self.saturated_s += max(0.0, seconds)

    def summary(self) -> dict[str, float | int]:
        """``tokens_served``, ``saturated_tokens``, ``saturated_s``: one consistent reading."""
        with self._lock:
            return {
                "tokens_served": self.tokens,
                "saturated_tokens": self.saturated_tokens,
                "saturated_s": round(self.saturated_s, 6),
            }
