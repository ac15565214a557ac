"""Where eepctl's own output goes once this process is a Ray driver.

Ray's driver prints cluster events it receives ("(raylet) The node with node id ... has been
marked dead") on ``sys.stdout`` from a thread of its own, whatever ``log_to_driver`` says. A
script reading ``-o json`` must see only JSON there, so on connecting, ``sys.stdout`` is pointed
at stderr and the command's own output keeps the stream stdout was.
"""

from __future__ import annotations

import sys
from typing import TextIO

_output: TextIO | None = None
_owned = False  # whether this process is the eepctl command (not a script using eepctl.core)


def own_stdout() -> None:
    """This process is the eepctl command: its stdout is its own output only (eepctl.main)."""
    global _owned
    _owned = True


def divert_library_output() -> None:
    """In the eepctl command, what libraries print from now on goes to stderr; ``output()``
    stays the real stdout. A script that imports eepctl.core keeps its stdout as it is."""
    global _output
    if _owned and sys.stdout is not sys.stderr:
        _output = sys.stdout
        sys.stdout = sys.stderr


def output() -> TextIO:
    """The stream the command's own output goes to."""
    if sys.stdout is sys.stderr and _output is not None:
        return _output
    return sys.stdout
