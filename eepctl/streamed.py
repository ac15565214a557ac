"""`eepctl generate`'s table output as it streams: each prompt's line, in order, its tokens
written as they arrive. All prompts are in flight at once; a later prompt's tokens wait here
until the lines before it are done. The finished text is ``render.generate_text``'s."""

from __future__ import annotations

import threading
from typing import Any, TextIO

from eepctl.render_requests import generate_head, generate_tail


class StreamedLines:
    """``on_token`` (client threads) and ``on_answer`` (in prompt order) write to ``out``."""

    def __init__(self, prompts: list[list[int]], out: TextIO) -> None:
        self.prompts, self.out = prompts, out
        self.current = 0
        self.printed: int | None = None  # tokens of the current line written (None: not begun)
        self.waiting: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def _begin(self) -> None:
        """The current line, up to the tokens that came before its turn (a line begins with its
        first token, so an error before any answer leaves stdout empty)."""
        if self.printed is None:
            early = self.waiting.pop(self.current, [])
            self.out.write(generate_head(self.prompts[self.current]) + "".join(f" {t}" for t in early))
            self.printed = len(early)

    def on_token(self, index: int, token: int) -> None:
        with self._lock:
            if index != self.current:
                self.waiting.setdefault(index, []).append(token)
                return
            self._begin()
            self.out.write(f" {token}")
            self.out.flush()
            self.printed = (self.printed or 0) + 1

    def on_answer(self, index: int, record: dict[str, Any]) -> None:
        """The prompt's answer: the rest of its line; the next line begins with what it has."""
        with self._lock:
            self._begin()
            self.out.write(generate_tail(record, 0 if record["error"] else self.printed or 0))
            self.current, self.printed = index + 1, None
            if self.waiting.get(self.current):
                self._begin()
            self.out.flush()
