"""The text primitives every renderer shares: rich renderables to plain text, a table's natural
width, byte counts for people. rich is imported inside them: `-o json` output never pays for it."""

from __future__ import annotations

import io
from typing import Any


def rich_text(renderables: list[Any], width: int = 160) -> str:
    buf = io.StringIO()
    # markup=False: error texts (gloo's "[/path/pair.cc:553]") must print as they are.
    from rich.console import Console

    console = Console(
        file=buf, width=width, force_terminal=False, color_system=None, highlight=False, markup=False, emoji=False
    )
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def natural_width(renderable: Any) -> int:
    """The columns ``renderable`` takes when nothing limits it (a table: every cell on one line)."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(file=io.StringIO(), width=100_000, color_system=None)
    return Measurement.get(console, console.options, renderable).maximum


def human_bytes(n: int | None) -> str:
    if not n:
        return "0 B"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
