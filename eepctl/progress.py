"""Live progress of a scale: rich per-rank rows on a terminal, plain lines otherwise, JSON lines with -o json."""

from __future__ import annotations

import sys
from typing import Any

from eepctl.render import event_line, to_json


class ScaleProgress:
    def __init__(self, *, json_lines: bool, plain: bool) -> None:
        self.json_lines = json_lines
        self.plain = plain or json_lines
        self._live: Any = None
        self._rows: dict[str, str] = {}

    def __enter__(self) -> ScaleProgress:
        if not self.plain:
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            self._live = Live(Text("waiting for the first phase..."), console=Console(stderr=True),
                              auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def on_event(self, ev: dict[str, Any]) -> None:
        if self.json_lines:
            sys.stdout.write(to_json("event", ev) + "\n")
            sys.stdout.flush()
            return
        if self.plain:
            sys.stderr.write(event_line(ev) + "\n")
            return
        from rich.table import Table

        who = "controller" if ev["rank"] == -1 else f"rank {ev['rank']}"
        self._rows[who] = f"{ev['phase']} {ev['outcome']} ({ev.get('duration_s', 0.0):.2f}s)"
        table = Table(title=f"{ev['op_id']}", title_justify="left")
        table.add_column("who")
        table.add_column("last phase")
        for k in sorted(self._rows, key=lambda s: (s != "controller", s)):
            table.add_row(k, self._rows[k])
        self._live.update(table, refresh=True)
