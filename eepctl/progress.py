"""Live progress of long work (scale, recovery, up, down).

On a terminal: a rich display whose size does not grow with the rank count — the operation's
phases in the order they happen (taken from its events and its record, not from a fixed list, so
a recovery's phases show as well as a scale's), a spinner and the elapsed time on the current one,
ranks done/total and the slowest rank per phase, and the serving-pause clock once commit starts.
``--verbose`` adds one row per rank. Without a terminal (or with NO_COLOR): plain lines on stderr,
the operation's own events (``--verbose``: each rank's too); with -o json: JSON lines on stdout.
``ProgressModel`` and ``progress_view`` are pure, for tests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from eepctl import streams
from eepctl.render import to_json
from eepctl.render_events import event_line, operation_level

_PAUSE_STARTS = "commit"  # the serving pause begins with commit and ends inside it (rank detail pause_s)


@dataclass
class PhaseProgress:
    """What the events so far say about one phase."""

    name: str
    first_seen: float
    ranks_done: dict[int, float] = field(default_factory=dict)  # rank -> duration
    controller_s: float | None = None  # the controller's own span of the phase, when it has one
    errors: int = 0
    rank_only: bool = False  # reported by ranks only (warm, capture): drawn inside an operation phase (commit)

    @property
    def duration_s(self) -> float:
        return max([*self.ranks_done.values(), self.controller_s or 0.0], default=0.0)

    def slowest(self) -> tuple[int, float] | None:
        return max(self.ranks_done.items(), key=lambda kv: (kv[1], -kv[0])) if self.ranks_done else None


class ProgressModel:
    """The state of one operation as its events and its record arrive."""

    def __init__(self, started: float | None = None) -> None:
        self.started = started or time.time()
        self.op: dict[str, Any] = {}
        self.phases: dict[str, PhaseProgress] = {}
        self.rank_last: dict[int, dict[str, Any]] = {}
        self.pause_s: float | None = None  # the measured pause, once a rank reported its commit
        self.pause_started: float | None = None
        self.finished: float | None = None

    def _phase(self, name: str, at: float, top: bool) -> PhaseProgress:
        """The phase's record. Operation phases (the controller's, or the op record's) are rows of
        their own; a phase only ranks report is drawn under the operation phase it started in
        (commit holds warm and capture)."""
        ph = self.phases.get(name)
        if ph is None:
            ph = self.phases[name] = PhaseProgress(name, at, rank_only=not top)
        if top:
            ph.rank_only = False
        ph.first_seen = min(ph.first_seen, at)
        return ph

    def operation_phases(self) -> list[PhaseProgress]:
        return sorted((p for p in self.phases.values() if not p.rank_only), key=lambda p: p.first_seen)

    def _parent_of(self, ph: PhaseProgress) -> str | None:
        """The operation phase that had begun last when ``ph`` began; None when there is none."""
        before = [t for t in self.operation_phases() if t.first_seen <= ph.first_seen]
        return before[-1].name if before else None

    def _top_current(self) -> str | None:
        if self.op.get("phase") in self.phases:
            return self.op["phase"]
        tops = self.operation_phases()
        return tops[-1].name if tops else None

    def on_event(self, ev: dict[str, Any]) -> None:
        self.op.setdefault("op_id", ev.get("op_id", ""))
        ph = self._phase(ev["phase"], float(ev["start"]), top=ev["rank"] == -1)
        dur = float(ev.get("duration_s", 0.0))
        if ev.get("outcome", "ok") != "ok":
            ph.errors += 1
        if ev["rank"] == -1:
            ph.controller_s = dur
        else:
            ph.ranks_done[int(ev["rank"])] = dur
            self.rank_last[int(ev["rank"])] = ev
        if ev["phase"] == _PAUSE_STARTS:
            self.pause_started = min(self.pause_started or float(ev["start"]), float(ev["start"]))
            pause = (ev.get("detail") or {}).get("pause_s")
            if isinstance(pause, (int, float)):
                self.pause_s = max(self.pause_s or 0.0, float(pause))

    def on_operation(self, op: dict[str, Any], now: float | None = None) -> None:
        """The operation's record (its current phase, sizes, final state)."""
        now = now or time.time()
        self.op.update({k: v for k, v in op.items() if k != "phase_durations"})
        if op.get("phase"):
            self._phase(op["phase"], now, top=True)
            if op["phase"] == _PAUSE_STARTS and self.pause_started is None:
                self.pause_started = now
        if op.get("state") not in (None, "running"):
            self.finished = self.finished or now
            if op.get("serving_pause_s"):
                self.pause_s = float(op["serving_pause_s"])

    def ordered(self) -> list[PhaseProgress]:
        """Operation phases in the order they began, each followed by the rank phases inside it."""
        children: dict[str | None, list[PhaseProgress]] = {}
        for p in self.phases.values():
            if p.rank_only:
                children.setdefault(self._parent_of(p), []).append(p)
        out: list[PhaseProgress] = sorted(children.pop(None, []), key=lambda p: p.first_seen)
        for top in self.operation_phases():
            out.append(top)
            out.extend(sorted(children.get(top.name, []), key=lambda p: p.first_seen))
        return out

    def current(self) -> str | None:
        return None if self.finished is not None else self._top_current()

    def expected_ranks(self) -> int:
        sizes = [int(self.op[k]) for k in ("from_size", "to_size") if isinstance(self.op.get(k), int)]
        return max([*sizes, len(self.rank_last)], default=0)


def _fmt_s(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f}s"


def progress_view(
    model: ProgressModel, now: float | None = None, *, verbose: bool = False, spinner: bool = True
) -> Any:
    """The display: a header, one row per phase, the pause line (and rank rows with verbose)."""
    from rich.console import Group
    from rich.spinner import Spinner
    from rich.table import Table
    from rich.text import Text

    now = now or time.time()
    end = model.finished or now
    op = model.op
    head = f"{op.get('op_id') or 'operation'}"
    if "from_size" in op and "to_size" in op:
        head += f"  DP {op['from_size']} -> {op['to_size']}"
    head += f"  {op.get('state', 'running')}  elapsed {end - model.started:.1f}s"
    table = Table(title=head, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("", "phase", "time", "ranks done", "slowest rank"):
        table.add_column(col, no_wrap=True)
    current = model.current()
    total = model.expected_ranks()
    nested = bool(model.operation_phases())  # rank phases are indented only under operation phases
    for ph in model.ordered():
        if ph.name == current:
            mark: Any = Spinner("dots") if spinner else Text(">")
            took = f"{now - ph.first_seen:.1f}s"
        else:
            mark = Text("x" if ph.errors else "✓")
            took = _fmt_s(ph.duration_s)
        done = f"{len(ph.ranks_done)}/{total}" if ph.ranks_done or (ph.name == current and total) else "-"
        slow = ph.slowest()
        label = ph.name if not ph.rank_only or not nested else f"  {ph.name}"
        table.add_row(mark, label, took, done, f"rank {slow[0]} ({_fmt_s(slow[1])})" if slow else "-")
    lines: list[Any] = [table]
    if model.pause_s is not None:
        lines.append(Text(f"serving pause: {model.pause_s * 1000:.1f} ms"))
    elif model.pause_started is not None and model.finished is None:
        lines.append(Text(f"serving paused for {max(0.0, now - model.pause_started):.1f}s (commit in progress)"))
    if verbose and model.rank_last:
        ranks = Table(show_edge=False, pad_edge=False)
        for col in ("rank", "last phase", "outcome", "took"):
            ranks.add_column(col, no_wrap=True)
        for r in sorted(model.rank_last):
            ev = model.rank_last[r]
            ranks.add_row(str(r), ev["phase"], ev.get("outcome", "ok"), _fmt_s(float(ev.get("duration_s", 0.0))))
        lines.append(ranks)
    if not model.phases:
        lines.append(Text(f"waiting for the first phase... {now - model.started:.1f}s"))
    return Group(*lines)


def progress_text(model: ProgressModel, now: float, *, verbose: bool = False, width: int = 100) -> str:
    """The display as plain text (no spinner animation): what the snapshot tests compare."""
    from eepctl.render_text import rich_text

    return rich_text([progress_view(model, now, verbose=verbose, spinner=False)], width)


class _LiveView:
    """Renders the model afresh on every refresh, so the spinner and the clocks move between events."""

    def __init__(self, model: ProgressModel, verbose: bool) -> None:
        self.model, self.verbose = model, verbose

    def __rich__(self) -> Any:
        return progress_view(self.model, verbose=self.verbose)


class ScaleProgress:
    """Where a scale's (or a recovery's) events go while the command waits."""

    def __init__(self, *, json_lines: bool, plain: bool, verbose: bool = False) -> None:
        self.json_lines = json_lines
        self.plain = plain or json_lines
        self.model = ProgressModel()
        self.verbose = verbose
        self._live: Any = None

    def __enter__(self) -> ScaleProgress:
        if not self.plain:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                _LiveView(self.model, self.verbose), console=Console(stderr=True), refresh_per_second=8, transient=False
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            if self.model.finished is None:
                self.model.finished = time.time()
            self._live.refresh()
            self._live.__exit__(*exc)

    def on_event(self, ev: dict[str, Any]) -> None:
        if self.json_lines:
            out = streams.output()
            out.write(to_json("event", ev) + "\n")
            out.flush()
            return
        if self.plain:
            if self.verbose or operation_level(ev):
                sys.stderr.write(event_line(ev) + "\n")
            return
        self.model.on_event(ev)

    def on_operation(self, op: dict[str, Any]) -> None:
        if not self.plain:
            self.model.on_operation(op)


@contextmanager
def busy(what: str, *, plain: bool) -> Iterator[None]:
    """A spinner with the elapsed time for work that sends no events (up, down); nothing when plain."""
    if plain:
        yield
        return
    from rich.console import Console

    t0 = time.time()
    console = Console(stderr=True)
    with console.status(f"{what}...") as st:
        import threading

        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(0.2):
                st.update(f"{what}... {time.time() - t0:.1f}s")

        th = threading.Thread(target=tick, daemon=True)
        th.start()
        try:
            yield
        finally:
            stop.set()
            th.join()
