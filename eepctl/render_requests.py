"""Renderers of `eepctl generate`: one line per prompt (streamed piece by piece on a terminal:
eepctl.streamed), and the load generator's summary. Pure."""

from __future__ import annotations

from typing import Any


def generate_text(res: dict[str, Any]) -> str:
    return "".join(generate_head(r["prompt"]) + generate_tail(r) for r in res["results"])


def generate_head(prompt: list[int]) -> str:
    """A generate line up to its first token (the streamed output goes on from here)."""
    return f"[{' '.join(map(str, prompt))}] ->"


def generate_tail(r: dict[str, Any], printed: int = 0) -> str:
    """The rest of a generate line once answered: tokens after the ``printed`` ones, latency, rank."""
    out = "".join(f" {t}" for t in r["output"][printed:]) if not r["error"] else f" ERROR {r['error']}"
    where = f", rank {r['rank']}" if r.get("rank") is not None else ""  # vLLM does not say which rank
    return f"{out}  ({r['latency_s'] * 1000:.0f} ms{where})\n"


def load_text(res: dict[str, Any]) -> str:
    lat = res["latency_s"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    early = " (sending ended early by SIGINT)" if res.get("stopped_early") else ""
    return (
        f"sent {res['sent']} at {res['rate']:g}/s over {res['duration_s']:.1f}s{early}: completed {res['completed']}, "
        f"failed {res['failed']}\nlatency p50 {ms(lat['p50'])}, p90 {ms(lat['p90'])}, p99 {ms(lat['p99'])}, "
        f"max {ms(lat['max'])}\n"
    )
